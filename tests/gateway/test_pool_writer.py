"""One writer per server: gateway processes share a real vLLM server and a real broker. The one that applies a
weight update is killed (-9) mid-update, and another finishes it: the server ends on the weights of the version it
reports, the survivors' agents see no error, and the engine holds no request while it is paused (the survivors
hold theirs until the pool event says the update is done). A replica that sees the update late is waited for:
the writer pauses only once every live replica said it holds (`gateway/barrier.py`), so no request reaches the
paused engine and every call's recorded version is that of the weights that answered it."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from agentstream.gateway.pool import _BUSY
from agentstream.schemas import CallEvent, PoolUpdateEvent
from tests.gateway.test_pool_sync import MESSAGES, publish, served_version, weights
from tests.support.gateway import GatewayProcess, pool_group_is, read_events
from tests.support.vllm import hf_logprobs, served_logprobs
from tests.support.wait import wait_for_async

pytestmark = [pytest.mark.vllm,
              pytest.mark.slow]  # a broker's session timeout (10 s) before another replica takes the update over

REPLICAS = 3
TOKENS = [1, 42, 7, 99, 200, 5, 120, 12]


class Engine:
    """What the test sees of the vLLM server: its pause state, and the requests it holds while paused."""

    def __init__(self, url: str):
        self.http = httpx.AsyncClient(base_url=url, timeout=10)
        self.paused_seen = 0
        self.busy_while_paused: list[float] = []
        self.problems: list[str] = []

    async def is_paused(self) -> bool:
        return (await self.http.get("/is_paused")).json()["is_paused"] is True

    async def busy(self) -> float:
        text = (await self.http.get("/metrics")).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.split("{", 1)[0].split(" ", 1)[0] in _BUSY)

    async def slower_than(self, seconds: float) -> float:
        """How many requests the server finished took longer than `seconds` (a bound of vLLM's latency buckets)."""
        families = text_string_to_metric_families((await self.http.get("/metrics")).text)
        [latency] = [family for family in families if family.name == "vllm:e2e_request_latency_seconds"]
        count = sum(sample.value for sample in latency.samples if sample.name.endswith("_count"))
        return count - sum(sample.value for sample in latency.samples
                           if sample.name.endswith("_bucket") and float(sample.labels["le"]) == seconds)

    async def watch(self) -> None:
        """Sample the requests the engine holds, between two samples that both found it paused."""
        while True:
            try:
                before = await self.is_paused()
                busy = await self.busy()
                after = await self.is_paused()
            except httpx.HTTPError as exc:  # a slow answer under load: sample again
                self.problems.append(f"{type(exc).__name__}: {exc}")
                continue
            if before and after:
                self.paused_seen += 1
                if busy:
                    self.busy_while_paused.append(busy)


@pytest.mark.parametrize("fault", ["gateway.after_reload", "gateway.after_label"])
async def test_a_writer_killed_mid_update_is_replaced_and_no_request_sees_the_paused_engine(
        kafka, vllm_server, tmp_path, fault):
    env = {"AGENTSTREAM_HOLD_TIMEOUT_S": "180", "AGENTSTREAM_HEALTH_INTERVAL_S": "0.5",
           "AGENTSTREAM_FAULT_ONCE": str(tmp_path / "fired"), "AGENTSTREAM_LOG_LEVEL": "info"}
    replicas = [GatewayProcess(kafka, [f"tiny={vllm_server.url}"], tmp_path / f"gw-{i}.log", fault=fault,
                               env={**env, "AGENTSTREAM_REPLICA_ID": f"gw-{i}"}) for i in range(REPLICAS)]
    engine = Engine(vllm_server.url)
    start_version = _version(vllm_server)
    new_version = start_version + 1
    errors: dict[str, list[str]] = {f"gw-{i}": [] for i in range(REPLICAS)}
    done: list[tuple[str, float]] = []  # (replica, monotonic time the call started)
    stop = asyncio.Event()

    async def agent(name: str, replica: GatewayProcess) -> None:
        async with replica.http() as http:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    async with http.stream("POST", "/v1/chat/completions", json={
                            "model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": True}) as response:
                        body = (await response.aread()).decode()
                    problem = None if response.status_code == 200 and "[DONE]" in body else \
                        f"{response.status_code}: {body[:300]}"
                except httpx.HTTPError as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                if problem:
                    errors[name].append(problem)  # the killed replica's are not counted
                else:
                    done.append((name, started))
                if replica.process.poll() is not None:
                    return

    watcher = asyncio.create_task(engine.watch())
    agents: list[asyncio.Task[None]] = []
    try:
        for replica in replicas:
            await asyncio.to_thread(replica.start)
        agents = [asyncio.create_task(agent(f"gw-{i}", replica)) for i, replica in enumerate(replicas) for _ in range(3)]
        await wait_for_async(lambda: len(done) >= 15, timeout=120, what="traffic before the update")

        await publish(kafka, weights("tiny", new_version, vllm_server.other_checkpoint))
        [killed] = await wait_for_async(lambda: [r for r in replicas if r.process.poll() is not None], timeout=180,
                                        what="the replica applying the update to die")
        killed_name = killed.env["AGENTSTREAM_REPLICA_ID"]
        assert killed.process.returncode == -9
        survivors = [replica for replica in replicas if replica is not killed]

        async def finished() -> bool:
            return served_version(vllm_server) == str(new_version) and not await engine.is_paused()

        await wait_for_async(finished, timeout=240, what="another replica to finish the update")
        for replica in survivors:
            await wait_for_async(lambda replica=replica: _released(replica, new_version), timeout=60,
                                 what="every survivor to release its hold")
        released = time.monotonic()
        await wait_for_async(lambda: sum(started > released for _, started in done) >= 12, timeout=120,
                             what="traffic after the update")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*agents), 120)

        assert {name: seen for name, seen in errors.items() if name != killed_name and seen} == {}, \
            "the surviving replicas' agents saw errors"
        if watcher.done():
            watcher.result()  # its failure, if it stopped
        assert engine.paused_seen > 0, f"the test never saw the engine paused: it checked nothing {engine.problems[:3]}"
        assert engine.busy_while_paused == [], "requests ran on (or waited in) a paused engine"
        # the weights served are those of the version the server reports
        served = served_logprobs(vllm_server, TOKENS)
        loaded = (served - hf_logprobs(vllm_server.other_checkpoint, TOKENS)).abs().max().item()
        before = (served - hf_logprobs(vllm_server.model_dir, TOKENS)).abs().max().item()
        assert loaded < 2e-3 < before, f"served logprobs differ by {loaded} from the new weights, {before} from the old"

        updates = [event.data for event in await read_events(kafka, kafka.topics.pool, count=1)
                   if isinstance(event, PoolUpdateEvent) and event.data.version == new_version]
        assert {update.status for update in updates} == {"ok"}
        assert {update.applied_by for update in updates} <= {f"gw-{i}" for i in range(REPLICAS)} - {killed_name}
        calls = [event.data for event in await read_events(kafka, kafka.topics.calls, count=len(done))]
        assert all(call.weight_version in (start_version, new_version) for call in calls)
    finally:
        stop.set()
        watcher.cancel()
        for task in agents:
            task.cancel()
        await asyncio.gather(watcher, *agents, return_exceptions=True)
        with contextlib.suppress(AssertionError):  # the session's server back on its first weights for other tests
            await _restore(kafka, vllm_server, replicas)
        for replica in replicas:
            replica.stop()
        await engine.http.aclose()


LATE_S = 8
"""how late each replica's follower sees a weights event"""
SLOW_S = 8
"""how much longer than the tiny model's a reload takes (the engine stays paused long enough to be watched)"""
FROZEN_S = 5.0
"""a request that took longer than this in vLLM (one of its latency buckets) waited in the paused engine: the
busy gauges do not count one that came after the pause (the engine takes no step to update them)"""


async def test_the_writer_pauses_only_once_every_replica_holds_and_no_call_is_mislabelled(kafka, vllm_server, tmp_path):
    """Both replicas' followers see the weights event LATE_S seconds late: the writer holds at once (it applies the
    event), the other keeps sending until its follower sees it. A request sent through each replica the moment the
    engine is paused would, from the late one, wait in the paused engine through the reload and be recorded with the
    version before while the new weights answer it; with the barrier, the writer pauses after the late one holds."""
    env = {"AGENTSTREAM_HOLD_TIMEOUT_S": "180", "AGENTSTREAM_HEALTH_INTERVAL_S": "0.5", "AGENTSTREAM_LOG_LEVEL": "info"}
    replicas = [GatewayProcess(kafka, [f"tiny={vllm_server.url}"], tmp_path / f"gw-{i}.log",
                               fault=f"gateway.late_weights:{LATE_S},gateway.slow_reload:{SLOW_S}", env={**env, "AGENTSTREAM_REPLICA_ID": f"gw-{i}"})
                for i in range(2)]
    engine = Engine(vllm_server.url)
    first, second = _checkpoints(vllm_server)
    start_version = _version(vllm_server)
    new_version = start_version + 1
    watcher = asyncio.create_task(engine.watch())
    try:
        for replica in replicas:
            await asyncio.to_thread(replica.start)
        # both replicas are members of the group the writer asks, and it is done rebalancing, before the update
        await wait_for_async(lambda: pool_group_is(kafka, {"gw-0", "gw-1"}), timeout=60,
                             what="both replicas in the pool-sync group")
        await asyncio.gather(*(_call(replica) for replica in replicas))
        slow_before = await engine.slower_than(FROZEN_S)

        await publish(kafka, weights("tiny", new_version, second))
        await wait_for_async(engine.is_paused, timeout=120, interval=0.01, what="the engine paused for the update")
        during = await asyncio.gather(*(_call(replica) for replica in replicas))  # each waits out the hold
        assert not await engine.is_paused() and served_version(vllm_server) == str(new_version)
        for replica in replicas:
            await wait_for_async(lambda replica=replica: _released(replica, new_version), timeout=60,
                                 what="every replica to release its hold")
        await asyncio.gather(*(_call(replica) for replica in replicas))

        if watcher.done():
            watcher.result()
        assert all(status == 200 for status in during)
        assert engine.paused_seen > 0, f"the test never saw the engine paused: it checked nothing {engine.problems[:3]}"
        assert engine.busy_while_paused == [], "requests ran on (or waited in) a paused engine"
        calls = [event.data for event in await read_events(kafka, kafka.topics.calls, count=6)
                 if isinstance(event, CallEvent)]
        assert len(calls) == 6
        mislabelled = [call.weight_version for call in calls  # the version recorded is that of the weights that
                       if _distance(call, first if call.weight_version == start_version else second) > 2e-3]  # answered
        assert mislabelled == [], "calls answered by the new weights were recorded with the version before"
        assert await engine.slower_than(FROZEN_S) == slow_before, "a request waited in the paused engine"
        assert {call.weight_version for call in calls} == {start_version, new_version}
        [update] = [event.data for event in await read_events(kafka, kafka.topics.pool, count=1)
                    if isinstance(event, PoolUpdateEvent) and event.data.version == new_version]
        assert update.status == "ok" and update.held_ms is not None and update.held_ms >= LATE_S * 1000, \
            f"the writer did not wait for the late replica: {update}"
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        with contextlib.suppress(AssertionError):
            await _restore(kafka, vllm_server, replicas, first)
        for replica in replicas:
            replica.stop()
        await engine.http.aclose()


async def _call(replica: GatewayProcess) -> int:
    async with replica.http() as http:
        response = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                                  "max_tokens": 8}, timeout=240)
    assert response.status_code == 200, response.text
    return response.status_code


def _distance(call, checkpoint) -> float:
    """How far the call's recorded logprobs are from those `checkpoint` gives its tokens."""
    tokens = [*call.prompt_token_ids, *call.completion_token_ids]
    expected = hf_logprobs(checkpoint, tokens)[len(call.prompt_token_ids) - 1:]
    return (expected - torch.tensor(call.logprobs)).abs().max().item()


def _checkpoints(vllm_server):
    """(the checkpoint the server serves now, the other one)."""
    served = served_logprobs(vllm_server, TOKENS)
    if (served - hf_logprobs(vllm_server.model_dir, TOKENS)).abs().max().item() < 2e-3:
        return vllm_server.model_dir, vllm_server.other_checkpoint
    return vllm_server.other_checkpoint, vllm_server.model_dir


async def _released(replica: GatewayProcess, version: int) -> bool:
    async with replica.http() as http:
        health = (await http.get("/healthz")).json()
    return not health["holds"] and all(upstream["weight_version"] == version for upstream in health["upstreams"])


async def _restore(kafka, vllm_server, replicas: list[GatewayProcess], folder=None) -> None:
    if not any(replica.process and replica.process.poll() is None for replica in replicas):
        return
    version = _version(vllm_server) + 1
    await publish(kafka, weights("tiny", version, folder or vllm_server.model_dir))
    await wait_for_async(lambda: served_version(vllm_server) == str(version), timeout=180,
                         what="the first weights back")


def _version(vllm_server) -> int:
    reported = served_version(vllm_server)
    return 0 if reported == "default" else int(reported)

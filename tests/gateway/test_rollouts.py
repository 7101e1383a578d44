"""Attribution, rewards, rollout ends and security: calls and rewards land under the right rollout,
a token cannot write for another one, and no secret reaches the log."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import openai
import pytest

from agentstream.schemas import RewardEvent, RolloutFinishedEvent
from agentstream.schemas.sessions import session_rollout_id
from agentstream.schemas.tokens import mint_rollout_token
from agentstream.stack.process import free_port
from tests.support.gateway import (
    OPERATOR_KEY,
    TOKEN_SECRET,
    gateway_settings,
    raw_records,
    read_events,
    running_gateway,
    token,
)

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gw_without_upstream(kafka):
    """Auth, rewards and finish never reach an upstream; this one is not even there."""
    async with running_gateway(gateway_settings(kafka, [f"tiny=http://127.0.0.1:{free_port()}"])) as running:
        yield running


@pytest.mark.vllm
async def test_concurrent_rollouts_each_call_lands_once_under_its_rollout(kafka, vllm_server, caplog):
    caplog.set_level(logging.DEBUG)
    async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"], access_log=True)) as gw:
        async def agent(rollout: str, attempt: str, how: str) -> None:
            key = token(rollout, attempt)
            if how == "url":  # what the controller gives an agent: a rollout-scoped base URL and token
                client = gw.openai(api_key=key, base_url=gw.rollout_url(rollout, attempt))
            elif how == "token":  # plain /v1: the token alone names the rollout
                client = gw.openai(api_key=key)
            else:  # an operator key, with the rollout in headers
                client = gw.openai(api_key=OPERATOR_KEY, default_headers={
                    "x-agentstream-rollout-id": rollout, "x-agentstream-attempt-id": attempt})
            for turn in range(3):
                content = f"{rollout}/{attempt}/{turn}"
                if turn == 1:
                    stream = await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=3, stream=True)
                    [chunk async for chunk in stream]
                else:
                    await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=3)

        agents = [(f"r{i}", f"a{i % 2}", ("url", "token", "headers")[i % 3]) for i in range(9)]
        session = gw.openai(default_headers={"x-agentstream-session-id": "s1"})
        await asyncio.gather(*(agent(*spec) for spec in agents),
                             session.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2))

        events = await read_events(kafka, kafka.topics.calls, count=28)
        assert len(events) == 28 and len({event.id for event in events}) == 28, "a call is missing or duplicated"
        per_attempt = Counter((event.rollout_id, event.attempt_id) for event in events)
        session = session_rollout_id("s1")  # a session's calls are keyed by its rollout id, with no attempt
        assert per_attempt == Counter({(r, a): 3 for r, a, _ in agents} | {(session, None): 1})
        for event in events:
            if event.rollout_id != session:
                content = event.data.request["messages"][0]["content"]
                assert content.startswith(f"{event.rollout_id}/{event.attempt_id}/"), "a call landed under another rollout"
                assert event.data.status == 200 and event.data.completion_token_ids
            else:
                assert event.data.session_id == "s1"
        assert sorted(e.data.streamed for e in events if e.rollout_id != session).count(True) == 9
        access = [record.fields for record in caplog.records if record.name == "gateway.calls"]
        assert len(access) == 28 and {"r0", session} <= {entry["rollout_id"] for entry in access}


async def test_reward_and_finish_become_events_of_the_tokens_attempt(gw_without_upstream, kafka):
    gw = gw_without_upstream
    async with gw.http(token("r1", "a1")) as agent:
        reward = await agent.post("/rollouts/r1/reward", json={
            "value": 0.75, "turns": [{"turn": 0, "value": 1.0}], "details": {"tests_passed": 3}})
        finish = await agent.post("/rollouts/r1/finish", json={"exit_code": 0, "details": {"note": "done"}})
    async with gw.http(OPERATOR_KEY) as operator:
        scored = await operator.post("/rollouts/r9/attempts/a3/reward", json={"value": -1})
    assert reward.status_code == finish.status_code == scored.status_code == 200, (reward.text, finish.text)

    [got, by_operator] = sorted(await read_events(kafka, kafka.topics.rewards, count=2), key=lambda e: e.rollout_id)
    assert isinstance(got, RewardEvent) and (got.rollout_id, got.attempt_id) == ("r1", "a1")
    assert got.id == reward.json()["id"] and got.data.value == 0.75 and got.data.reward_fn is None
    assert got.data.turns[0].turn == 0 and got.data.details == {"tests_passed": 3}
    assert (by_operator.rollout_id, by_operator.attempt_id, by_operator.data.value) == ("r9", "a3", -1.0)

    [ended] = await read_events(kafka, kafka.topics.rollouts, count=1)
    assert isinstance(ended, RolloutFinishedEvent) and ended.id == finish.json()["id"]
    assert (ended.rollout_id, ended.attempt_id, ended.data.by, ended.data.exit_code) == ("r1", "a1", "agent", 0)


async def test_bad_reward_bodies_are_400_with_the_reason(gw_without_upstream, kafka):
    async with gw_without_upstream.http() as http:
        missing = await http.post("/rollouts/r1/reward", json={"turns": []})
        wrong = await http.post("/rollouts/r1/reward", json={"value": "high"})
        malformed = await http.post("/rollouts/r1/reward", content=b"{")
        extra = await http.post("/rollouts/r1/finish", json={"exit_code": 0, "colour": "red"})
    assert [r.status_code for r in (missing, wrong, malformed, extra)] == [400] * 4
    assert missing.json()["error"]["message"].startswith("value:")
    assert malformed.json()["error"]["code"] == "invalid_json"
    assert "colour" in extra.json()["error"]["message"]
    assert await read_events(kafka, kafka.topics.rewards, settle_ms=200) == []


async def test_auth_missing_invalid_and_wrong_rollout(gw_without_upstream, kafka):
    gw = gw_without_upstream
    chat = {"model": "tiny", "messages": MESSAGES}
    async with gw.http(api_key=None) as anonymous:
        assert (await anonymous.post("/v1/chat/completions", json=chat)).status_code == 401
        assert (await anonymous.post("/rollouts/r1/reward", json={"value": 1})).status_code == 401
    forged = token("r1", "a1")[:-4] + "AAAA"
    other_secret = mint_rollout_token("another-secret", "r1", "a1")
    for key in (forged, other_secret, "not-a-key"):
        async with gw.http(key) as http:
            response = await http.post("/v1/chat/completions", json=chat)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"

    async with gw.http(token("r1", "a1")) as r1:
        attempts = [
            await r1.post("/rollouts/r2/attempts/a1/v1/chat/completions", json=chat),
            await r1.post("/rollouts/r1/attempts/a2/v1/chat/completions", json=chat),
            await r1.post("/v1/chat/completions", json=chat, headers={"x-agentstream-rollout-id": "r2"}),
            await r1.post("/rollouts/r2/reward", json={"value": 1}),
            await r1.post("/rollouts/r1/reward", json={"value": 1, "attempt_id": "a2"}),
            await r1.post("/rollouts/r2/finish", json={}),
        ]
    assert [r.status_code for r in attempts] == [403] * 6, [r.text for r in attempts]
    assert "r1" in attempts[0].json()["error"]["message"] and "r2" in attempts[0].json()["error"]["message"]

    with pytest.raises(openai.PermissionDeniedError):
        await gw.openai(api_key=token("r1", "a1"), base_url=gw.rollout_url("r2", "a1")).chat.completions.create(
            model="tiny", messages=MESSAGES)
    assert await read_events(kafka, kafka.topics.rewards, settle_ms=200) == []
    assert await read_events(kafka, kafka.topics.calls, settle_ms=200) == [], "a refused request was recorded"


async def test_secrets_never_reach_the_log(gw_without_upstream, kafka, caplog):
    caplog.set_level(logging.DEBUG)
    gw = gw_without_upstream
    agent_token = token("r1", "a1")
    async with gw.http(agent_token) as http:
        # the upstream is down: a 502, recorded with the request, which carries a key in its body
        failed = await http.post("/v1/chat/completions", json={**{"model": "tiny", "messages": MESSAGES},
                                                                "api_key": "sk-in-the-body"})
        await http.post("/rollouts/r1/reward", json={"value": 1})
    async with gw.http(OPERATOR_KEY) as http:
        await http.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert failed.status_code == 502
    [call] = [e for e in await read_events(kafka, kafka.topics.calls, count=2) if e.rollout_id == "r1"]
    assert "api_key" not in call.data.request and call.data.request["model"] == "tiny"

    records = b"".join([*await raw_records(kafka, kafka.topics.calls), *await raw_records(kafka, kafka.topics.rewards)])
    assert records, "nothing was recorded, so nothing was checked"
    for secret in (agent_token, OPERATOR_KEY, TOKEN_SECRET, "sk-in-the-body"):
        assert secret.encode() not in records, f"a secret ({secret[:8]}…) is in the log"
        assert secret not in caplog.text, f"a secret ({secret[:8]}…) is in the gateway's logs"

"""Tenants (#48): which tenant a key or a rollout token belongs to, recorded on every call event it makes; a
settings file that gives one key to two tenants, or a tenant a key of no app or read scope, stops the gateway and
the dashboard at start (exit 2). Attacked from the second tenant and from a forged token claim."""

from __future__ import annotations

import base64

import orjson
import pytest

from agentstream.controller.attempt import Attempt, Gateway, agent_env
from agentstream.controller.tasks import PlannedRollout
from agentstream.dashboard.__main__ import main as dashboard_main
from agentstream.gateway.__main__ import main as gateway_main
from agentstream.schemas.events import CallEvent, Task
from agentstream.schemas.keys import KeyRing
from agentstream.schemas.tokens import PREFIX, InvalidToken, mint_rollout_token, verify_rollout_token
from tests.support.gateway import (
    OPERATOR_KEY,
    TOKEN_SECRET,
    canned_upstream,
    gateway_settings,
    read_events,
    running_gateway,
)

KEY_A, KEY_B, KEY_SHARED, READ_A = "tenant-a-app-key", "tenant-b-app-key", "no-tenant-app-key", "tenant-a-read-key"
TENANTS = {"agent-a": [KEY_A, READ_A], "agent-b": [KEY_B]}
MESSAGES = [{"role": "user", "content": "hi"}]
ANSWER = orjson.dumps({
    "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "tiny", "prompt_token_ids": [1, 2],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop",
                 "token_ids": [7], "logprobs": {"content": [{"token": "a", "logprob": -0.1}]}}]})


def test_each_key_has_its_tenant_and_an_operator_key_none():
    ring = KeyRing([OPERATOR_KEY], [KEY_A, KEY_B, KEY_SHARED], [READ_A], TENANTS)
    assert [ring.tenant_of(key) for key in (KEY_A, READ_A, KEY_B)] == ["agent-a", "agent-a", "agent-b"]
    # an operator key, a key of no tenant, an unknown one, a prefix of a tenant's key: no tenant
    assert {ring.tenant_of(key) for key in (OPERATOR_KEY, KEY_SHARED, "stranger", KEY_A[:-1], "")} == {None}


BAD_TENANTS = [
    ({"a": [KEY_A], "b": [KEY_A]}, "two tenants"),
    ({"a": [KEY_A, "never-declared"]}, "not app or read keys"),
    ({"a": [OPERATOR_KEY]}, "not app or read keys"),  # an operator sees every tenant: it is none of them
    ({"A/../b": [KEY_A]}, "a tenant's name is"),
    (["agent-a"], "valid dictionary"),
]


@pytest.mark.parametrize("tenants, why", BAD_TENANTS)
@pytest.mark.parametrize("main", [gateway_main, dashboard_main], ids=["gateway", "dashboard"])
def test_a_key_of_two_tenants_or_an_undeclared_one_stops_the_service_at_start(monkeypatch, capsys, main, tenants,
                                                                               why):
    monkeypatch.setenv("AGENTSTREAM_API_KEYS", OPERATOR_KEY)
    monkeypatch.setenv("AGENTSTREAM_APP_KEYS", f"{KEY_A},{KEY_B}")
    monkeypatch.setenv("AGENTSTREAM_TENANTS", orjson.dumps(tenants).decode())
    with pytest.raises(SystemExit) as stopped:
        main([])
    said = capsys.readouterr().err
    assert stopped.value.code == 2 and why in said and "AGENTSTREAM_TENANTS" in said
    assert KEY_A not in said  # (the error names the tenants, never a key)


def test_a_rollout_token_carries_the_tenant_it_was_launched_for_and_a_forged_claim_does_not_verify(tmp_path):
    rollout = PlannedRollout("r", Task(id="t", input="say hi"), "g", "train", 0, 0)
    env = agent_env(Gateway("http://gw", TOKEN_SECRET, tenant="agent-a"), Attempt(rollout, "a1", 1, None, tmp_path),
                    "task.json", 60)
    assert verify_rollout_token(TOKEN_SECRET, env["OPENAI_API_KEY"]).tenant == "agent-a"
    assert verify_rollout_token(TOKEN_SECRET, mint_rollout_token(TOKEN_SECRET, "r", "a1")).tenant is None
    # agent-a's agent rewrites its claim to agent-b's: the signature no longer matches
    _, body, signature = env["OPENAI_API_KEY"].split(".")
    claims = orjson.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    forged = base64.urlsafe_b64encode(orjson.dumps({**claims, "t": "agent-b"})).decode().rstrip("=")
    with pytest.raises(InvalidToken, match="signature"):
        verify_rollout_token(TOKEN_SECRET, f"{PREFIX}.{forged}.{signature}")


async def test_every_call_event_records_its_callers_tenant(kafka):
    async with canned_upstream(ANSWER) as url:
        settings = gateway_settings(kafka, [f"tiny={url}"], app_keys=[KEY_A, KEY_B, KEY_SHARED], read_keys=[READ_A],
                                    tenants=TENANTS)
        async with running_gateway(settings) as gw:
            callers = {"agent-a": KEY_A, "agent-b": KEY_B, "none": KEY_SHARED, "operator": OPERATOR_KEY,
                       "token-b": mint_rollout_token(TOKEN_SECRET, "r-b", "a1", tenant="agent-b")}
            for name, key in callers.items():
                # agent-b's app key claims agent-a's tenant by every header it could: the key decides
                headers = {"x-agentstream-tenant": "agent-a", "x-agentstream-session-id": name}
                await gw.openai(key, default_headers=headers).chat.completions.create(model="tiny", messages=MESSAGES)
    events = await read_events(kafka, kafka.topics.calls, count=len(callers))
    assert all(isinstance(event, CallEvent) and event.data.status == 200 for event in events)
    by_session = {event.data.session_id.rsplit(":", 1)[-1] if event.data.session_id else event.rollout_id:
                  event.data.tenant for event in events if isinstance(event, CallEvent)}
    assert by_session == {"agent-a": "agent-a", "agent-b": "agent-b", "none": None, "operator": None,
                          "r-b": "agent-b"}

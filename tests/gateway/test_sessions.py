"""The gateway's session endpoints under attack and misuse: who may post, what a body may hold, what is
recorded (only what was answered 200, once per client id), and where session calls are keyed."""

from __future__ import annotations

import openai
import pytest

from agentstream.schemas import FeedbackEvent, SessionEndedEvent
from agentstream.schemas.sessions import default_session_id, feedback_id, key_identity, session_rollout_id
from agentstream.stack.process import free_port
from tests.support.gateway import OPERATOR_KEY, gateway_settings, read_events, running_gateway, token


@pytest.fixture
async def gw(kafka):
    async with running_gateway(gateway_settings(kafka, [f"tiny=http://127.0.0.1:{free_port()}"])) as running:
        yield running


async def test_feedback_and_ends_are_recorded_once_acknowledged_with_who_sent_them(gw, kafka):
    async with gw.http() as operator:
        first = await operator.post("/sessions/chat-1/feedback", json={"thumbs": "up", "user": "u-1", "id": "fb-1"})
        again = await operator.post("/sessions/chat-1/feedback", json={"thumbs": "up", "user": "u-1", "id": "fb-1"})
        on_call = await operator.post("/sessions/chat-1/calls/call-9/feedback", json={"score": -0.5, "label": "slow"})
        ended = await operator.post("/sessions/chat-1/end")
        never_seen = await operator.post("/sessions/a-session-from-last-year/feedback", json={"label": "resolved"})
    assert [r.status_code for r in (first, again, on_call, ended, never_seen)] == [200] * 5
    fb_1 = feedback_id(key_identity(OPERATOR_KEY), "chat-1", "fb-1")
    assert first.json() == again.json() == {"id": fb_1, "session_id": "chat-1",
                                            "rollout_id": session_rollout_id("chat-1"), "call_id": None}
    every = await read_events(kafka, kafka.topics.rewards, count=4)
    assert [type(e) for e in every] == [FeedbackEvent] * 4
    feedback = [e for e in every if e.data.session_id == "chat-1"]  # (in order: one session, one partition)
    assert [e.id for e in feedback[:2]] == [fb_1] * 2  # a retry: readers keep one
    assert all(e.rollout_id == session_rollout_id(e.data.session_id) and e.attempt_id is None for e in every)
    assert feedback[0].data.sender == key_identity(OPERATOR_KEY) and OPERATOR_KEY not in feedback[0].data.sender
    assert (feedback[0].data.thumbs, feedback[0].data.user, feedback[0].data.client_id) == ("up", "u-1", "fb-1")
    assert (feedback[2].data.call_id, feedback[2].data.score, feedback[2].data.label) == ("call-9", -0.5, "slow")
    (end,) = await read_events(kafka, kafka.topics.rollouts, count=1)
    assert isinstance(end, SessionEndedEvent) and end.rollout_id == session_rollout_id("chat-1")


@pytest.mark.parametrize("path, body, status, code, names", [
    ("/sessions/s/feedback", {}, 400, "invalid_request", "a score, a label or thumbs"),
    ("/sessions/s/feedback", {"thumbs": True}, 400, "invalid_request", "thumbs"),
    ("/sessions/s/feedback", {"score": "NaN"}, 400, "invalid_request", "score"),
    ("/sessions/s/feedback", {"score": 1e39}, 400, "invalid_request", "outside this gateway's range [-1.0, 1.0]"),
    ("/sessions/s/feedback", {"score": -1.5}, 400, "invalid_request", "outside"),
    ("/sessions/s/feedback", b'{"score": 1e400}', 400, "invalid_json", "infinity"),
    ("/sessions/s/feedback", b'{"score": 1,', 400, "invalid_json", "not valid JSON"),
    ("/sessions/s/feedback", {"score": 1, "rollout_id": "r-1"}, 400, "invalid_request", "rollout_id"),
    ("/sessions/s/feedback", {"score": 1, "user": "u" * 300}, 400, "invalid_request", "user"),
    ("/sessions/s/feedback", [1, 2], 400, "invalid_request", "body"),
    ("/sessions/s/feedback", {"score": 1, "comment": "x" * 70_000}, 413, "body_too_large", "65536 bytes"),
    ("/sessions/s/calls/" + "c" * 300 + "/feedback", {"score": 1}, 400, "invalid_request", "call id"),
    ("/sessions/" + "s" * 300 + "/feedback", {"score": 1}, 400, "invalid_session", "at most 256"),
    ("/sessions/%20/feedback", {"score": 1}, 400, "invalid_session", "blank"),
    ("/sessions/s/end", {"details": {}, "reason": "x"}, 400, "invalid_request", "reason"),
])
async def test_bad_bodies_are_400s_in_the_error_shape_and_nothing_is_recorded(gw, kafka, path, body, status, code,
                                                                              names):
    async with gw.http() as operator:
        response = await (operator.post(path, content=body) if isinstance(body, bytes)
                          else operator.post(path, json=body))
        good = await operator.post("/sessions/s/feedback", json={"score": 1.0})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and names in error["message"], error
    assert good.status_code == 200
    events = await read_events(kafka, kafka.topics.rewards) + await read_events(kafka, kafka.topics.rollouts)
    assert [e.id for e in events] == [good.json()["id"]]  # only the good one


async def test_only_keys_may_post_about_sessions(gw, kafka):
    async with gw.http(token("r1", "a1")) as agent:  # an agent's token is for its own rollout
        forbidden = await agent.post("/sessions/chat-1/feedback", json={"score": 1})
        not_ending = await agent.post("/sessions/chat-1/end")
    async with gw.http(None) as nobody:
        anonymous = await nobody.post("/sessions/chat-1/feedback", json={"score": 1})
    async with gw.http("not-a-key") as stranger:
        wrong = await stranger.post("/sessions/chat-1/feedback", json={"score": 1})
    assert (forbidden.status_code, not_ending.status_code) == (403, 403)
    assert forbidden.json()["error"]["code"] == "session_forbidden"
    assert (anonymous.status_code, wrong.status_code) == (401, 401)
    assert await read_events(kafka, kafka.topics.rewards, timeout=2) == []


async def test_session_calls_are_keyed_by_their_sessions_rollout_id_and_a_key_has_a_default_session(gw, kafka):
    # no upstream answers: each call is a recorded failure, attributed all the same
    named = gw.openai(default_headers={"x-agentstream-session-id": "chat-7"})
    unnamed = gw.openai()
    too_long = gw.openai(default_headers={"x-agentstream-session-id": "s" * 257})
    for client in (named, unnamed):
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(Exception) as refused:
        await too_long.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert getattr(refused.value, "status_code", None) == 400 and "at most 256" in str(refused.value)
    calls = await read_events(kafka, kafka.topics.calls, count=2)
    default = default_session_id(key_identity(OPERATOR_KEY))
    assert {(c.rollout_id, c.attempt_id, c.data.session_id) for c in calls} == {
        (session_rollout_id("chat-7"), None, "chat-7"), (session_rollout_id(default), None, default)}

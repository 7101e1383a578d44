"""Keys with scopes, attacked from a second key: an app key that rates, ends or pre-empts the feedback ids of
another key's sessions, picks session ids to choose its canary arm, sends scores no float32 holds; a read-only
key on the model and feedback routes; an agent posting a reward its grader gives. Each is refused (or lands in
the attacker's own namespace), and the legitimate path beside it still works."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import openai
import orjson
import pytest

from agentstream.controller.attempt import Attempt, Gateway, agent_env
from agentstream.controller.tasks import PlannedRollout
from agentstream.dashboard.app import create_app as dashboard_app
from agentstream.dashboard.settings import DashboardSettings
from agentstream.gateway.service import settings_problem
from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas import FeedbackEvent, RewardEvent, SessionEndedEvent
from agentstream.schemas.events import Release, ReleaseEvent, Task
from agentstream.schemas.releases import in_canary
from agentstream.schemas.sessions import app_session_id, feedback_id, key_identity, session_rollout_id
from agentstream.schemas.tokens import mint_rollout_token, verify_rollout_token
from agentstream.stack.process import free_port
from tests.support.gateway import (
    OPERATOR_KEY,
    TOKEN_SECRET,
    canned_upstream,
    gateway_settings,
    read_events,
    running_gateway,
    token,
)
from tests.support.streams import publish
from tests.support.wait import wait_for_async

APP_A, APP_B, READER = "app-key-a-for-tests", "app-key-b-for-tests", "read-key-for-tests"
A, B = key_identity(APP_A), key_identity(APP_B)
ARM_SECRET = "arm-secret-for-tests"
SHARE_BP = 2500
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gw(kafka):
    settings = gateway_settings(kafka, [f"tiny=http://127.0.0.1:{free_port()}"], app_keys=[APP_A, APP_B],
                                read_keys=[READER])
    async with running_gateway(settings) as running:
        yield running


def refused(response: httpx.Response, status: int, code: str) -> bool:
    error = response.json()["error"]
    return response.status_code == status and error["code"] == code and bool(error["message"])


async def test_an_app_key_rates_and_ends_only_its_own_sessions_and_cannot_pre_empt_a_feedback_id(gw, kafka):
    async with gw.http(APP_A) as a, gw.http(APP_B) as b, gw.http() as operator:
        # B, first: the same session id and feedback id A will use, a rating and an end; all in B's own namespace
        pre_posted = await b.post("/sessions/chat-1/feedback", json={"score": -1, "id": "fb-0001"})
        b_ended = await b.post("/sessions/chat-1/end")
        # B naming A's session by its full id, or A's default session: refused, whatever the route
        by_full_id = await b.post(f"/sessions/{A}:chat-1/feedback", json={"score": -1, "id": "fb-0002"})
        ending_it = await b.post(f"/sessions/{A}:chat-1/end")
        default = await b.post(f"/sessions/default:{A}/feedback", json={"thumbs": "down"})
        # A, the legitimate path: its feedback under the id B took first, the same again (a retry), its end
        mine = await a.post("/sessions/chat-1/feedback", json={"score": 0.5, "id": "fb-0001"})
        retry = await a.post("/sessions/chat-1/feedback", json={"score": 0.5, "id": "fb-0001"})
        ended = await a.post(f"/sessions/{A}:chat-1/end")  # its own full id, as the answers name it
        # an operator acts for every session, A's included, under its own feedback ids
        operator_said = await operator.post(f"/sessions/{A}:chat-1/feedback", json={"thumbs": "up", "id": "fb-0001"})
    with pytest.raises(openai.PermissionDeniedError) as call_as_a:  # B's model call into A's session
        await gw.openai(APP_B, default_headers={"x-agentstream-session-id": f"{A}:chat-1"}).chat.completions.create(
            model="tiny", messages=MESSAGES)
    assert call_as_a.value.code == "key_scope"
    assert all(refused(r, 403, "key_scope") for r in (by_full_id, ending_it, default))

    theirs, ours = app_session_id(B, "chat-1"), app_session_id(A, "chat-1")
    assert [r.status_code for r in (pre_posted, b_ended, mine, retry, ended, operator_said)] == [200] * 6
    assert pre_posted.json()["session_id"] == theirs and pre_posted.json()["rollout_id"] == session_rollout_id(theirs)
    assert mine.json() == retry.json() == {"id": feedback_id(A, ours, "fb-0001"), "session_id": ours,
                                           "rollout_id": session_rollout_id(ours), "call_id": None}
    assert len({pre_posted.json()["id"], mine.json()["id"], operator_said.json()["id"]}) == 3  # scoped by sender

    rewards = await read_events(kafka, kafka.topics.rewards, count=4)
    on_a = {e.id: e for e in rewards if e.rollout_id == session_rollout_id(ours)}  # (readers keep one per id)
    assert isinstance(next(iter(on_a.values())), FeedbackEvent)
    assert sorted((e.data.sender, e.data.score, e.data.thumbs) for e in on_a.values()) == sorted(
        [(A, 0.5, None), (key_identity(OPERATOR_KEY), None, "up")])
    ends = await read_events(kafka, kafka.topics.rollouts, count=2)
    assert all(isinstance(e, SessionEndedEvent) for e in ends)
    assert {(e.rollout_id, e.data.sender) for e in ends} == {(session_rollout_id(theirs), B),
                                                             (session_rollout_id(ours), A)}


async def test_a_feedback_id_sent_again_with_another_body_is_a_409_and_the_first_stands(gw, kafka):
    async with gw.http(APP_A) as a:
        first = await a.post("/sessions/chat-2/calls/call-1/feedback", json={"score": 0.25, "id": "fb-9"})
        edited = await a.post("/sessions/chat-2/calls/call-1/feedback", json={"score": -0.25, "id": "fb-9"})
        elsewhere = await a.post("/sessions/chat-2/feedback", json={"score": 0.25, "id": "fb-9"})  # not about call-1
        again = await a.post("/sessions/chat-2/calls/call-1/feedback", json={"score": 0.25, "id": "fb-9"})
        corrected = await a.post("/sessions/chat-2/calls/call-1/feedback", json={"score": -0.25, "id": "fb-10"})
    assert refused(edited, 409, "feedback_conflict") and refused(elsewhere, 409, "feedback_conflict")
    assert edited.json()["error"]["type"] == "conflict_error" and "new id" in edited.json()["error"]["message"]
    assert (first.status_code, again.status_code, corrected.status_code) == (200, 200, 200)
    assert again.json() == first.json()
    events = await read_events(kafka, kafka.topics.rewards, count=3)
    assert {e.id: e.data.score for e in events} == {first.json()["id"]: 0.25, corrected.json()["id"]: -0.25}


@pytest.mark.parametrize("body, names", [
    ({"score": 1e39}, "outside this gateway's range [-1.0, 1.0]"),  # float32 inf: every advantage of a batch NaN
    ({"score": -1e39}, "outside"),
    ({"score": 1.0000001}, "outside"),
    ({"score": "Infinity"}, "score"),
    ({"score": "NaN"}, "score"),
])
async def test_extreme_scores_are_400s_and_the_range_itself_is_taken(gw, kafka, body, names):
    async with gw.http(APP_A) as a:
        response = await a.post("/sessions/chat-3/feedback", json=body)
        edges = [await a.post("/sessions/chat-3/feedback", json={"score": score}) for score in (-1.0, 1.0)]
    assert refused(response, 400, "invalid_request") and names in response.json()["error"]["message"]
    assert [r.status_code for r in edges] == [200, 200]
    events = await read_events(kafka, kafka.topics.rewards, count=2)
    assert sorted(e.data.score for e in events) == [-1.0, 1.0]


async def test_a_read_only_key_is_refused_on_model_feedback_and_reward_routes_and_an_app_key_on_rollouts(gw, kafka):
    with pytest.raises(openai.PermissionDeniedError) as model_call:
        await gw.openai(READER).chat.completions.create(model="tiny", messages=MESSAGES)
    assert model_call.value.code == "key_scope"
    async with gw.http(READER) as reader, gw.http(APP_A) as app:
        rated = await reader.post("/sessions/chat-4/feedback", json={"score": 1})
        ended = await reader.post("/sessions/chat-4/end")
        rewarded = await reader.post("/rollouts/r1/reward", json={"value": 1})
        models = await reader.get("/v1/models")
        app_reward = await app.post("/rollouts/r1/attempts/a1/reward", json={"value": 1})
        app_models = await app.get("/rollouts/r1/attempts/a1/v1/models")
    assert all(refused(r, 403, "key_scope") for r in (rated, ended, rewarded, models, app_reward, app_models))
    with pytest.raises(openai.PermissionDeniedError):  # an app key naming a rollout in headers
        await gw.openai(APP_A, default_headers={"x-agentstream-rollout-id": "r1"}).chat.completions.create(
            model="tiny", messages=MESSAGES)
    assert await read_events(kafka, kafka.topics.rewards, timeout=2) == []
    assert await read_events(kafka, kafka.topics.calls, timeout=2) == []


async def test_the_dashboard_takes_a_read_only_key():
    settings = DashboardSettings(api_keys=[OPERATOR_KEY], read_keys=[READER])
    transport = httpx.ASGITransport(dashboard_app(settings))  # (no lifespan: /api/session reads no topic)
    async with httpx.AsyncClient(transport=transport, base_url="http://dashboard") as client:
        answers = {key: await client.get("/api/session", headers={"authorization": f"Bearer {key}"})
                   for key in (READER, OPERATOR_KEY, APP_A)}
    assert (answers[READER].status_code, answers[OPERATOR_KEY].status_code) == (200, 200)
    assert answers[APP_A].status_code == 401  # an app key sees its own traffic only, not the log


async def test_an_agent_cannot_reward_an_attempt_its_grader_scores(gw, kafka):
    graded = mint_rollout_token(TOKEN_SECRET, "r-graded", "a1", graded=True)
    async with gw.http(graded) as agent, gw.http(token("r-own", "a1")) as scored_by_itself:
        refused_reward = await agent.post("/rollouts/r-graded/attempts/a1/reward", json={"value": 1})
        finished = await agent.post("/rollouts/r-graded/attempts/a1/finish", json={"exit_code": 0})
        own = await scored_by_itself.post("/rollouts/r-own/reward", json={"value": 1})
        huge = await scored_by_itself.post("/rollouts/r-own/reward", json={"value": 1e39})
        huge_turn = await scored_by_itself.post("/rollouts/r-own/reward", json={"value": 0, "turns": [
            {"turn": 0, "value": -1e39}]})
    assert refused(refused_reward, 403, "reward_from_grader") and "grader" in refused_reward.json()["error"]["message"]
    assert refused(huge, 400, "invalid_request") and refused(huge_turn, 400, "invalid_request")
    assert (finished.status_code, own.status_code) == (200, 200)  # what else the agent posts is taken
    (reward,) = await read_events(kafka, kafka.topics.rewards, count=1)
    assert isinstance(reward, RewardEvent) and (reward.rollout_id, reward.data.value) == ("r-own", 1.0)


@pytest.mark.parametrize("settings, problem", [
    ({"api_keys": ["k"], "app_keys": ["k"]}, "two scopes"),
    ({"app_keys": ["k"], "read_keys": ["k"]}, "two scopes"),
    ({"app_keys": ["k"], "feedback_score_min": 1.0}, "low < high"),
    ({"app_keys": ["k"], "feedback_score_max": float("inf")}, "must be finite"),
    ({"read_keys": ["k"]}, None),  # (it starts; every request with the key is then a 403)
])
def test_a_key_under_two_scopes_or_a_broken_score_range_is_refused_at_start(settings, problem):
    found = settings_problem(GatewaySettings(**settings))
    assert found is None if problem is None else problem in str(found)


@pytest.mark.parametrize("task, graded", [
    (Task(id="t", input="2+2", reward_fn="streams.rewards:exact_match"), True),
    (Task(id="t", input="fix it", metadata={"reward_source": "grader"}), True),
    (Task(id="t", input="say hi"), False),
])
def test_the_controller_marks_the_tokens_of_graded_tasks(tmp_path, task, graded):
    rollout = PlannedRollout("r", task, "g", "train", 0, 0)
    env = agent_env(Gateway("http://gw", TOKEN_SECRET), Attempt(rollout, "a1", 1, None, tmp_path), "task.json", 60)
    assert verify_rollout_token(TOKEN_SECRET, env["OPENAI_API_KEY"]).graded is graded


# --- the canary arm ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[str]:
    """A server that answers every chat completion the same (with the token ids and logprobs vLLM adds)."""
    body = orjson.dumps({
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "tiny", "prompt_token_ids": [1, 2],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop",
                     "token_ids": [7], "logprobs": {"content": [{"token": "a", "logprob": -0.1}]}}]})

    async with canned_upstream(body) as url:
        yield url


@pytest.mark.parametrize("wanted", [True, False], ids=["canary", "stable"])
async def test_a_client_cannot_choose_its_canary_arm_by_choosing_session_ids(kafka, wanted):
    """The attacker knows the scheme and its own key, so it can compute each session's rollout id, and picks
    the ids whose unkeyed bucket puts them on the arm it wants: without the server's secret, what it gets is
    the share's chance; the gateway's arm is exactly the keyed bucket."""
    async with upstream() as stable, upstream() as canary:
        await publish(kafka, [ReleaseEvent(source="test", data=Release(
            model="tiny", action="canary", version=2, uri="/ckpt/2", stable_version=1, stable_uri="/ckpt/1",
            share_bp=SHARE_BP, servers=[canary], started_at=1000))])
        settings = gateway_settings(kafka, [f"tiny={stable}", f"tiny={canary}"], app_keys=[APP_A],
                                    arm_secret=ARM_SECRET, apply_updates=False)
        async with running_gateway(settings) as gw:
            await wait_for_async(lambda: ("tiny", None) in gw.gateway.pool.releases, timeout=30, what="the canary folded")
            rollout = {f"pick-{n}": session_rollout_id(app_session_id(A, f"pick-{n}")) for n in range(2000)}
            picked = [s for s, r in rollout.items() if in_canary(r, SHARE_BP) == wanted][:40]
            assert len(picked) == 40
            for session in picked:
                client = gw.openai(APP_A, default_headers={"x-agentstream-session-id": session})
                await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
            calls = await read_events(kafka, kafka.topics.calls, count=len(picked))
    served = {call.rollout_id: call.data.upstream for call in calls}
    assert len(served) == len(picked)
    # the gateway's arm is the bucket keyed by the secret: whoever holds it (and only they) can predict it
    assert all((served[rollout[s]] == canary) == in_canary(rollout[s], SHARE_BP, ARM_SECRET.encode())
               for s in picked)
    # the attacker's pick lands on the canary at about the share (unkeyed it would be all or nothing)
    on_canary = sum(served[rollout[s]] == canary for s in picked) / len(picked)
    assert 0 < on_canary < 0.6, on_canary

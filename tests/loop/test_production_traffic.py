"""Production traffic end to end: a scripted population of users talks to a real gateway (a process) through
/v1 in sessions and rates them late, across a SIGKILL of the gateway and of the streams worker; the sessions
become trajectories once each, rewards come when the feedback does, per-call feedback lands on its turn, a
rebuild under another reward policy gives the same sequences with new rewards, and bad feedback is a 400."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from openai import AsyncOpenAI

import agentstream.schemas as s
from agentstream.schemas.codec import encode
from agentstream.schemas.sessions import session_rollout_id
from agentstream.streams.trajectory import revision_id as derived_revision
from tests.support.gateway import OPERATOR_KEY, GatewayProcess
from tests.support.logs import cli, read_topic
from tests.support.streams import StreamsWorker, TopicWatch

pytestmark = pytest.mark.vllm

WORKER_ARGS = ("--session-idle-s", "3", "--feedback-window-s", "6")
"""(the tests' worker also has --settle-s 0.2)"""
SESSION = "x-agentstream-session-id"


@dataclass
class User:
    """One person of the population: a conversation of a few turns, each answer appended before the next."""

    session_id: str
    turns: int
    calls: list[str] = field(default_factory=list)
    """the call ids of its turns (the gateway's x-agentstream-call-id)"""

    async def talk(self, gateway: GatewayProcess) -> None:
        messages = [{"role": "user", "content": f"hello from {self.session_id}"}]
        async with AsyncOpenAI(api_key=OPERATOR_KEY, base_url=f"{gateway.url}/v1", max_retries=0,
                               default_headers={SESSION: self.session_id}) as client:
            for turn in range(self.turns):
                raw = await client.chat.completions.with_raw_response.create(
                    model="tiny", messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
                self.calls.append(raw.headers["x-agentstream-call-id"])
                answer = raw.parse().choices[0].message.content or ""
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"and {turn}?"}]

    async def end(self, gateway: GatewayProcess) -> None:
        async with gateway.http() as http:
            response = await http.post(f"/sessions/{self.session_id}/end", json={})
        assert response.status_code == 200, response.text

    async def rate(self, gateway: GatewayProcess, call: int | None = None, **body) -> dict:
        path = f"/sessions/{self.session_id}" + (f"/calls/{self.calls[call]}" if call is not None else "") + "/feedback"
        async with gateway.http() as http:
            response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.json()


BAD_BODIES = [
    ({}, "feedback needs a score, a label or thumbs"),
    ({"thumbs": "sideways"}, "thumbs"),
    ({"score": "high"}, "score"),
    ({"score": 1, "colour": "red"}, "colour"),
    ({"label": ""}, "label"),
    ({"score": 1, "id": "x" * 300}, "id"),
]


def trajectories_by_session(events: list[s.Event]) -> dict[str, list[s.TrajectoryEvent]]:
    found = defaultdict(list)
    for event in events:
        if event.type == "trajectory" and event.data.session_id and not event.data.revision_of:
            found[event.data.session_id].append(event)
    return found


def reward_of(events: list[s.Event], trajectory: s.TrajectoryEvent) -> float | None:
    """The session's reward as a trainer sees it: the latest revision's (later feedback), else its own; every
    reward event naming the trajectory comes with a revision that has its value."""
    revisions = [e for e in events if e.type == "trajectory" and e.data.revision_of == trajectory.id]
    latest = max(revisions, key=lambda e: (e.time, e.id), default=None)
    return latest.data.reward if latest else trajectory.data.reward


def revised_with_each_late_reward(events: list[s.Event]) -> bool:
    """Each reward event naming a trajectory (later feedback) came with that trajectory's revision."""
    later = {derived_revision(e.data.trajectory_id, e.id) for e in events if e.type == "reward" and e.data.trajectory_id}
    revised = {e.id for e in events if e.type == "trajectory" and e.data.revision_of}
    return later == revised


async def test_a_population_of_users_in_sessions_becomes_rewarded_trajectories_across_restarts(
        kafka, vllm_server, tmp_path, monkeypatch):
    gateway = GatewayProcess(kafka, [f"tiny={vllm_server.url}"], tmp_path / "gateway.log").start()
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log", WORKER_ARGS).start()
    liked, disliked, rated_call, idle, rated_late, after = (
        User("u-liked", 3), User("u-disliked", 2), User("u-rated-call", 3), User("u-idle", 2),
        User("u-rated-late", 2), User("u-after-restart", 2))
    try:
        async with TopicWatch(kafka, "trajectories", "rewards", "deadletter") as watch:
            for user in (liked, disliked, rated_call, idle, rated_late):
                await user.talk(gateway)
            await liked.rate(gateway, thumbs="up", user="alice", id="fb-liked")
            await liked.rate(gateway, thumbs="up", user="alice", id="fb-liked")  # a retried post: one feedback
            await liked.end(gateway)
            await disliked.end(gateway)
            await disliked.rate(gateway, thumbs="down", comment="wrong answer")
            await rated_call.rate(gateway, call=1, thumbs="up")
            await rated_call.end(gateway)
            await rated_late.end(gateway)
            async with gateway.http() as http:  # bad bodies: a 400 in the OpenAI error shape each, nothing recorded
                for body, names in BAD_BODIES:
                    response = await http.post(f"/sessions/{liked.session_id}/feedback", json=body)
                    assert response.status_code == 400, (body, response.text)
                    error = response.json()["error"]
                    assert error["type"] == "invalid_request_error" and names in error["message"], (body, error)
                response = await http.post(f"/sessions/{liked.session_id}/feedback", content=b"{not json")
                assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
            await watch.until(lambda events: len(trajectories_by_session(events)) >= 2, timeout=60,
                              what="the first sessions' trajectories")

            # both services die mid-way (the other sessions are still open, waiting, or being settled)
            gateway.kill()
            worker.kill()
            gateway.start()
            worker.start()

            await after.talk(gateway)  # a new conversation after the restart, rated at once
            await after.rate(gateway, score=0.25)
            await after.end(gateway)
            await rated_late.rate(gateway, score=0.5, user="bob")  # after its window: a reward event naming it
            await watch.until(lambda events: idle.session_id in trajectories_by_session(events), timeout=60,
                              what="the idle session's trajectory (ended by --session-idle-s, unrated)")
            await idle.rate(gateway, call=0, thumbs="down")  # days later, as it were: it lands on its first turn

            users = (liked, disliked, rated_call, idle, rated_late, after)

            def done(events: list[s.Event]) -> bool:
                found = trajectories_by_session(events)
                return all(user.session_id in found for user in users) and all(
                    reward_of(events, found[user.session_id][0]) is not None for user in users) and \
                    revised_with_each_late_reward(events)

            events = await watch.until(done, timeout=90, what="every session's trajectory and reward")
            counts = worker.analytics()["assembly"]  # (since the restart: the idle one went unrated in its window)
            assert counts["sessions"] >= 2 and counts["sessions_without_feedback"] >= 1, counts
    finally:
        gateway.kill()
        worker.stop()

    found = trajectories_by_session(events)
    assert set(found) == {user.session_id for user in users}
    for user in users:
        copies = found[user.session_id]
        assert len({encode(copy) for copy in copies}) == 1, f"{user.session_id}: repeats differ"  # once, by id
        trajectory = copies[0]
        assert trajectory.rollout_id == session_rollout_id(user.session_id) and trajectory.attempt_id == "segment-0"
        assert [turn.call_id for turn in trajectory.data.turns] == user.calls  # every turn, in order
        for turn in trajectory.data.turns:  # each turn's span holds its completion, masked as the model's
            sequence = trajectory.data.sequences[turn.sequence]
            span = slice(turn.completion_start, turn.completion_start + len(turn.completion_token_ids))
            assert sequence.token_ids[span] == turn.completion_token_ids and set(sequence.mask[span]) == {1}

    assert revised_with_each_late_reward(events)
    values = {user.session_id: reward_of(events, found[user.session_id][0]) for user in users}
    assert values == {"u-liked": 1.0, "u-disliked": 0.0, "u-rated-call": 1.0, "u-idle": 0.0, "u-rated-late": 0.5,
                      "u-after-restart": 0.25}
    call_rated = found["u-rated-call"][0].data
    assert [turn.reward for turn in call_rated.turns] == [None, 1.0, None]  # the per-call feedback, on its turn
    assert found["u-idle"][0].data.reward_missing and found["u-idle"][0].data.end_reason == "no call for 3 s"
    (late,) = {e.id: e for e in events if e.type == "reward" and e.data.trajectory_id == found["u-idle"][0].id}.values()
    assert [(t.call_id, t.value) for t in late.data.turns] == [(idle.calls[0], 0.0)]
    liked_rewards = {r.event_id for r in found["u-liked"][0].data.rewards}
    assert len(liked_rewards) == 1  # the retried post was one feedback
    assert not [e for e in events if e.type == "deadletter"], [e.data.reason for e in events if e.type == "deadletter"]

    # the log holds the raw feedback: rewarded again under another policy, the same sequences
    result = await cli(kafka, monkeypatch, "replay", "rebuild", "--to-topic", "signed", "--settle-s", "0.2",
                       "--reward-grace-s", "2", *WORKER_ARGS, "--reward-policy", "streams.policies:signed_thumbs",
                       "--state", str(tmp_path / "state.json"))
    assert result.exit_code == 0, result.output
    rebuilt = {e.data.session_id: e for _, e in await read_topic(kafka, "signed")
               if e.data.session_id and not e.data.revision_of}
    assert set(rebuilt) == set(found)
    for session_id, new in rebuilt.items():
        old = found[session_id][0]
        assert new.id == old.id and new.data.sequences == old.data.sequences
        assert [t.call_id for t in new.data.turns] == [t.call_id for t in old.data.turns]
    assert rebuilt["u-disliked"].data.reward == -1.0 and rebuilt["u-liked"].data.reward == 1.0
    assert {r.reward_fn for r in rebuilt["u-liked"].data.rewards} == {"streams.policies:signed_thumbs"}

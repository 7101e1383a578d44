"""Late feedback end to end: a conversation rated only after its feedback window reaches the trainer as a
revision of its trajectory, across a SIGKILL of the streams worker, and is trained on once (a re-delivered
revision, and a later one, do not count it again); a rebuild under the live policy gives the live revisions,
under another the same conversations revised with its rewards; a call recorded without logprobs is kept out of
an importance-weighted update, counted."""

from __future__ import annotations

from pathlib import Path

import agentstream.schemas as s
from agentstream.schemas.sessions import session_rollout_id
from agentstream.streams.trajectory import revision_id
from agentstream.trainer.service import Trainer
from agentstream.trainer.settings import TrainerSettings
from tests.support.logs import cli, read_topic
from tests.support.streams import StreamsWorker, TopicWatch, publish
from tests.support.trainer import IM_END, chat_prompt, ids, trajectory

WORKER_ARGS = ("--session-idle-s", "30", "--feedback-window-s", "2")
"""(the tests' worker also has --settle-s 0.2)"""


class Session:
    """The events a gateway writes for one session, timed now (the live worker's deadlines are wall-clock)."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.rollout_id = session_rollout_id(session_id)

    def call(self, question: str, answer: str, logprobs: bool = True) -> s.CallEvent:
        prompt, completion = chat_prompt(question), ids(answer) + [IM_END]
        time = s.now_ms()
        return s.CallEvent(source="gateway", rollout_id=self.rollout_id, time=time, data=s.Call(
            api="chat.completions", model="tiny", session_id=self.session_id, status=200, started_at=time - 5,
            latency_ms=5.0, request={}, prompt_token_ids=prompt, completion_token_ids=completion,
            logprobs=[-0.5] * len(completion) if logprobs else None, weight_version=0))

    def end(self) -> s.SessionEndedEvent:
        return s.SessionEndedEvent(source="gateway", rollout_id=self.rollout_id, time=s.now_ms(),
                                   data=s.SessionEnded(session_id=self.session_id, sender="key:test"))

    def feedback(self, **values) -> s.FeedbackEvent:
        return s.FeedbackEvent(source="gateway", rollout_id=self.rollout_id, time=s.now_ms(), data=s.Feedback(
            session_id=self.session_id, sender="key:test", **values))


def of_session(events: list[s.Event], session_id: str) -> list[s.TrajectoryEvent]:
    return list({e.id: e for e in events if e.type == "trajectory" and e.data.session_id == session_id}.values())


def settings(kafka, tmp_path: Path, base: Path) -> TrainerSettings:
    """Offline over the trajectories topic to its end now, one session per version, importance-weighted."""
    return TrainerSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                           partitions=kafka.partitions, base_model=base, checkpoint_dir=tmp_path / "ckpt",
                           group_size=1, min_group_size=1, groups_per_batch=1, lr=1e-3, dtype="float32", rollout_is="token",
                           offline_topic=kafka.topics.trajectories)


async def train(config: TrainerSettings) -> tuple[list[str], dict[str, float]]:
    """What a trainer run trained on (its versions' lineage) and dropped (by reason), to the topic's end."""
    trainer = Trainer(config)
    published = await trainer.run()
    dropped: dict[str, float] = {reason: float(n) for reason, n in trainer.dropped.items()}
    for event in published:
        for name, value in event.data.metrics.items():
            if name.endswith("_dropped") and name != "stale_dropped":
                reason = name.removesuffix("_dropped")
                dropped[reason] = dropped.get(reason, 0) + value
    return [i for event in published for i in event.data.lineage], {k: v for k, v in dropped.items() if v}


async def test_late_feedback_is_a_revision_trained_once_across_restarts(kafka, tiny_model_dirs, tmp_path,
                                                                       monkeypatch):
    late, rated, unlogged = Session("chat-late"), Session("chat-rated"), Session("chat-unlogged")
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log", WORKER_ARGS).start()
    try:
        async with TopicWatch(kafka, "trajectories", "rewards", "deadletter") as watch:
            await publish(kafka, [late.call("1+2=", "3"), late.end()])
            await watch.until(lambda events: of_session(events, late.session_id), timeout=60,
                              what="the unrated conversation's trajectory (after its feedback window)")
            (original,) = of_session(watch.events, late.session_id)
            assert original.data.reward is None and original.data.reward_missing

            # the worker dies; what the trajectory was built from comes back from its changelog
            worker.kill()
            worker.start()
            await publish(kafka, [late.feedback(score=1.0)])  # after the window: a revision with its reward
            await watch.until(lambda events: len(of_session(events, late.session_id)) == 2, timeout=60,
                              what="the revision of the late-rated conversation")
            first = of_session(watch.events, late.session_id)[1]
            assert first.data.revision_of == original.id and first.data.reward == 1.0
            assert first.data.sequences == original.data.sequences and first.rollout_id == original.rollout_id
            (reward,) = [e for e in watch.of_type("reward") if e.data.trajectory_id == original.id]
            assert first.data.rewards[-1].event_id == reward.id

            base = tiny_model_dirs[0]
            trained, dropped = await train(settings(kafka, tmp_path, base))
            # (the worker may have published the original again after its restart: the same id, a duplicate)
            dropped.pop("duplicate", None)
            assert trained == [first.id] and dropped == {"no_reward": 1}, (trained, dropped)

            # the revision delivered again (a producer's retry, a worker that died before recording it), then
            # more feedback about the same conversation (a second revision), a call without logprobs, and a
            # conversation rated in its window
            await publish(kafka, [first, late.feedback(thumbs="down"), unlogged.call("2+2=", "4", logprobs=False),
                                  unlogged.feedback(score=1.0), unlogged.end()])
            await publish(kafka, [rated.call("3+3=", "6"), rated.feedback(thumbs="up"), rated.end()])

            def everything(events: list[s.Event]) -> bool:
                return len(of_session(events, late.session_id)) == 3 and all(
                    of_session(events, session.session_id) for session in (rated, unlogged))

            await watch.until(everything, timeout=60, what="the second revision and the other conversations")
            second = of_session(watch.events, late.session_id)[2]
            assert second.data.revision_of == original.id and second.data.reward == 0.0
            (kept,) = of_session(watch.events, rated.session_id)
            (without,) = of_session(watch.events, unlogged.session_id)
            assert [turn.logprobs_missing for turn in without.data.turns] == [True]
            assert [turn.logprobs_missing for turn in kept.data.turns] == [False]
            assert without.data.reward == 1.0

            # a restarted trainer (from its checkpoint): the conversation was trained on, once is enough
            trained, dropped = await train(settings(kafka, tmp_path, base))
            assert trained == [kept.id], trained
            assert dropped.pop("duplicate", 0) >= 1  # the revision delivered again (and any repeat of the worker)
            assert dropped == {"conversation_trained": 1, "logprobs_missing": 1}, dropped
            assert not watch.of_type("deadletter"), [e.data.reason for e in watch.of_type("deadletter")]
            live = [first, second]
    finally:
        worker.stop()

    # the log holds the raw feedback: rebuilt under the live policy, the same revisions, byte for byte
    common = ("--settle-s", "0.2", "--reward-grace-s", "2", *WORKER_ARGS, "--state")
    result = await cli(kafka, monkeypatch, "replay", "rebuild", "--to-topic", "relive", *common,
                       str(tmp_path / "relive.json"))
    assert result.exit_code == 0, result.output
    rebuilt = [e for _, e in await read_topic(kafka, "relive") if e.data.revision_of]
    assert sorted(s.encode(e) for e in rebuilt) == sorted(s.encode(e) for e in live)
    # under another policy: the same conversation revised with that policy's rewards (a thumbs down is -1)
    result = await cli(kafka, monkeypatch, "replay", "rebuild", "--to-topic", "signed", *common,
                       str(tmp_path / "signed.json"), "--reward-policy", "streams.policies:signed_thumbs")
    assert result.exit_code == 0, result.output
    signed = sorted((e for _, e in await read_topic(kafka, "signed") if e.data.revision_of), key=lambda e: e.time)
    assert [e.data.revision_of for e in signed] == [original.id, original.id]
    assert [e.data.reward for e in signed] == [1.0, -1.0]
    assert all(e.data.sequences == original.data.sequences for e in signed)
    assert {r.reward_fn for e in signed for r in e.data.rewards} == {"streams.policies:signed_thumbs"}


async def test_a_revision_that_comes_before_training_takes_the_waiting_ones_place(kafka, tiny_model_dirs, tmp_path):
    """One conversation, one sample in an update: the latest revision read before its batch is trained replaces the
    one waiting (settled as `revised`), in its place in the batch-in-waiting."""
    prompt = chat_prompt("1+2=")

    def conversation(name: str, reward: float, revision_of: str | None = None) -> s.TrajectoryEvent:
        event = trajectory(prompt, ids("3") + [IM_END], reward, name, 0, version=0)
        event.data.group_id = event.data.task_id = None
        event.data.session_id, event.data.revision_of = f"chat-{name}", revision_of
        if revision_of:
            event.id = revision_id(revision_of, f"reward-{reward}")
        return event

    original = conversation("a", 0.0)
    revision = conversation("a", 1.0, revision_of=original.id)
    other = conversation("b", 0.5)
    source = tmp_path / "trajectories.jsonl"
    source.write_bytes(b"".join(s.encode(e) + b"\n" for e in (original, revision, other)))
    config = settings(kafka, tmp_path, tiny_model_dirs[0]).model_copy(update={
        "offline_topic": None, "offline_file": source, "group_size": 2, "rollout_is": "off"})
    trained, dropped = await train(config)
    assert sorted(trained) == sorted([revision.id, other.id]) and dropped == {"revised": 1}, (trained, dropped)


async def test_a_reward_or_score_no_float32_holds_is_deadlettered_and_never_reaches_a_trajectory(kafka, tmp_path):
    """Written to Kafka past the gateway (which refuses them): a score of 1e39 (inf as the trainer's float32, every
    advantage of its batch NaN) and an agent's reward of -1e39 go to the deadletter topic with why; the
    conversation they were about is settled without them, the one beside it rewarded as usual."""
    extreme, fine = Session("chat-extreme"), Session("chat-fine")
    agent_reward = s.RewardEvent(source="gateway", rollout_id="r-extreme", attempt_id="a1",
                                 data=s.Reward(value=0.5, turns=[s.TurnReward(turn=0, value=-1e39)]))
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log", WORKER_ARGS).start()
    try:
        async with TopicWatch(kafka, "trajectories", "deadletter") as watch:
            await publish(kafka, [extreme.call("1+2=", "3"), extreme.feedback(score=1e39), extreme.end(),
                                  fine.call("2+2=", "4"), fine.feedback(score=0.5), fine.end(), agent_reward])
            await watch.until(lambda events: of_session(events, extreme.session_id) and of_session(
                events, fine.session_id) and len(watch.of_type("deadletter")) >= 2, timeout=60,
                what="both conversations' trajectories and two deadletters")
    finally:
        worker.stop()
    (dropped,) = of_session(watch.events, extreme.session_id)
    (rewarded,) = of_session(watch.events, fine.session_id)
    assert dropped.data.reward is None and dropped.data.reward_missing  # no feedback it could use
    assert rewarded.data.reward == 0.5
    reasons = sorted((e.data.reason, s.decode(e.data.value.encode()).type) for e in watch.of_type("deadletter"))
    assert [kind for _, kind in reasons] == ["feedback", "reward"], reasons
    assert all("float32" in reason for reason, _ in reasons)
    assert not [e for e in watch.of_type("trajectory") if e.rollout_id == "r-extreme"]

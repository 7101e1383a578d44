"""`agentstream.eval` against the broker, the streams worker and the controller as real processes: a
rollout the controller gives up is a sample without a reward, counted, and the evaluation still ends."""

from __future__ import annotations

from pathlib import Path

from agentstream.eval import EvalSettings, Evaluator
from tests.support.controller import GATEWAY, SECRET, agent_command, write_tasks
from tests.support.streams import StreamsWorker


async def test_a_rollout_given_up_is_an_unscored_sample_and_the_evaluation_ends(kafka, tmp_path: Path):
    # "fail" exits 1 on every attempt: with one attempt per rollout the controller gives it up and exits 1
    tasks = write_tasks(tmp_path / "validation.jsonl", [{"id": "bad", "input": {"mode": "fail"}},
                                                        {"id": "good", "input": {"mode": "ok"}}])
    settings = EvalSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix, tasks=tasks,
                            agent=agent_command(tmp_path), model="tiny", gateway_url=GATEWAY, token_secret=SECRET,
                            max_attempts=1, out=tmp_path / "eval", settle_timeout_s=60)
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log").start()
    try:
        event = await Evaluator(kafka, settings, say=lambda _: None).evaluate(version=0)
    finally:
        worker.stop()
    assert (event.data.tasks, event.data.samples, event.data.pass_at_1) == (2, 2, 0.0)
    # the good agent finished without a reward (no grader here): unscored too, for its own reason
    assert event.data.unscored == {"failed": 1, "no_reward": 1}
    assert event.data.per_task == {"bad": [None], "good": [None]}


async def test_following_from_a_version_skips_those_before_it_and_measures_each_new_one(kafka):
    """A resumed run's eval (`--from-version`): versions 0-2 served before it started, 2 measured already, so it
    starts at 3: none is yielded until 3 is served, then 3, then 4; without it, the served one (2) comes first."""
    import asyncio

    from agentstream.eval import follow_versions
    from agentstream.schemas.events import PoolUpdate, PoolUpdateEvent, Weights, WeightsEvent
    from agentstream.schemas.kafka import Publisher, ensure_topics, make_producer

    await ensure_topics(kafka)
    producer = make_producer(kafka)
    await producer.start()
    publisher = Publisher(producer, kafka.topics)

    async def served(version: int) -> None:
        await publisher.publish(WeightsEvent(source="test", data=Weights(model="tiny", version=version, uri="/v",
                                                                           step=version)))
        await publisher.publish(PoolUpdateEvent(source="test", data=PoolUpdate(
            model="tiny", version=version, server="http://s", status="ok", pause_ms=1.0, applied_by="test")))

    try:
        for version in (1, 2):
            await served(version)
        fresh = follow_versions(kafka, "tiny")
        assert await asyncio.wait_for(anext(fresh), 60) == 2, "the served version, the history skipped"
        await fresh.aclose()

        resumed = follow_versions(kafka, "tiny", since=3)
        first = asyncio.ensure_future(anext(resumed))
        done, _ = await asyncio.wait({first}, timeout=4.0)  # past the 2 s catch-up: nothing below 3 is yielded
        assert not done, "a version before --from-version was measured"
        await served(3)
        assert await asyncio.wait_for(first, 60) == 3
        await served(4)
        assert await asyncio.wait_for(anext(resumed), 60) == 4
        await resumed.aclose()
    finally:
        await producer.stop()

"""The log itself: idempotent writes, group reads, committed offsets, durability, topic set-up."""

from __future__ import annotations

from pathlib import Path

import agentstream.schemas as s
from agentstream.schemas.kafka import (
    KafkaSettings,
    Publisher,
    ensure_topics,
    make_consumer,
    make_producer,
    partitions_of,
)
from agentstream.schemas.topics import topic_specs


def reward(rollout: str, value: float) -> s.RewardEvent:
    return s.RewardEvent(source="test", rollout_id=rollout, attempt_id="a", data=s.Reward(value=value))


async def publish_all(settings: KafkaSettings, events: list[s.Event]) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        publisher = Publisher(producer, settings.topics)
        for event in events:
            await publisher.publish(event)
    finally:
        await producer.stop()


async def read(settings: KafkaSettings, topic: str, group: str | None, count: int, commit: bool = False):
    consumer = make_consumer(settings, topic, group_id=group)
    await consumer.start()
    got = []
    try:
        while len(got) < count:
            batch = await consumer.getmany(timeout_ms=5000, max_records=count - len(got))
            if not batch:
                break
            for records in batch.values():
                got += [s.decode(r.value) for r in records]
        if commit:
            await consumer.commit()
    finally:
        await consumer.stop()
    return got


async def test_idempotent_producer_and_group_offsets(kafka):
    events = [reward(f"r{i % 5}", i) for i in range(20)]
    await publish_all(kafka, events)

    first = await read(kafka, kafka.topics.rewards, "g1", 12, commit=True)
    rest = await read(kafka, kafka.topics.rewards, "g1", 8)
    assert len(first) == 12 and len(rest) == 8
    assert {e.id for e in first} | {e.id for e in rest} == {e.id for e in events}
    assert not {e.id for e in first} & {e.id for e in rest}, "a restarted consumer re-read committed records"


async def test_records_of_one_rollout_stay_in_order(kafka):
    events = [reward("same-rollout", i) for i in range(30)]
    await publish_all(kafka, events)
    got = await read(kafka, kafka.topics.rewards, None, 30)
    assert [e.data.value for e in got] == list(range(30))


async def test_ensure_topics_is_idempotent_and_reports_mismatch(kafka):
    again = await ensure_topics(kafka)
    assert again.created == [] and again.ok
    assert set(again.existing) == {kafka.topics.name(spec.base) for spec in topic_specs(4)}

    wrong = await ensure_topics(kafka, topic_specs(partitions=6))
    assert not wrong.ok
    assert f"{kafka.topics.calls}: 4 partitions, expected 6" in wrong.mismatches


async def test_ensure_topics_reports_a_replication_factor_other_than_the_one_asked_for(kafka):
    """The topics were made with one replica (one broker); a user who now asks for three is told, per topic, with
    the fix, instead of keeping one replica without a word (a grown cluster: tests/stack/test_kafka_cluster)."""
    report = await ensure_topics(kafka.model_copy(update={"replication_factor": 3}))
    assert report.created == [] and not report.ok
    calls = next(problem for problem in report.mismatches if problem.startswith(f"{kafka.topics.calls}: "))
    assert calls.startswith(f"{kafka.topics.calls}: replication factor 1, expected 3; "), report.mismatches
    assert "kafka-reassign-partitions" in calls and "created again" in calls
    assert len(report.mismatches) == len(report.existing), "one for each topic"


async def test_broker_restart_keeps_every_record(own_broker):
    broker = own_broker
    state = broker.start()
    cmdline = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    assert b"kafka.Kafka" in cmdline and any(b"kafka_2.13" in part or b"jars/*" in part for part in cmdline)
    try:
        settings = KafkaSettings(bootstrap_servers=state.url, topic_prefix="durable.")
        await ensure_topics(settings)
        events = [reward(f"r{i}", i) for i in range(50)]
        await publish_all(settings, events)

        assert broker.stop()
        assert broker.state() is None
        restarted = broker.start()
        assert restarted.url == state.url, "a restarted broker keeps its address"

        got = await read(settings, settings.topics.rewards, None, 50)
        assert sorted(e.id for e in got) == sorted(e.id for e in events)
        end = await _end_offsets(settings, settings.topics.rewards)
        assert sum(end.values()) == 50
    finally:
        broker.stop()


async def _end_offsets(settings: KafkaSettings, topic: str) -> dict[int, int]:
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        offsets = await consumer.end_offsets(await partitions_of(settings, topic))
        return {tp.partition: offset for tp, offset in offsets.items()}
    finally:
        await consumer.stop()

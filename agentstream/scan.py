"""Read a bounded range of a topic: the shared reader behind replay and queries.

A scan assigns every partition itself (no consumer group), seeks to the start of the range, and
stops at its end: the log end as of when the scan began, an offset, or a time. So a scan is
finite and repeatable even while producers keep writing.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from aiokafka import ConsumerRecord, TopicPartition

from schemas.kafka import KafkaSettings, make_consumer, partitions_of


@dataclass(frozen=True)
class Bounds:
    """Where a scan starts and stops. Offsets are per partition; times are UTC ms (record timestamps)."""

    since_ms: int | None = None
    until_ms: int | None = None
    start_offsets: dict[int, int] = field(default_factory=dict)
    """first offset to read, per partition (e.g. where an interrupted replay stopped)"""
    end_offsets: dict[int, int] = field(default_factory=dict)
    """offset to stop before, per partition"""


@dataclass
class ScanProgress:
    total: int
    done: int = 0
    positions: dict[int, int] = field(default_factory=dict)
    """next offset to read, per partition: a resume point"""


async def scan(
    settings: KafkaSettings, topic: str, bounds: Bounds = Bounds(), batch_size: int = 5000,
    on_progress: Callable[[ScanProgress], None] | None = None,
) -> AsyncIterator[list[ConsumerRecord]]:
    """Yield batches of records of `topic` within `bounds`, each partition in offset order.

    `on_progress` is called with each batch before it is yielded: its `positions` are then where a
    scan that resumes after this batch starts.
    """
    partitions = await _partitions(settings, topic)
    consumer = make_consumer(settings, group_id=None, enable_auto_commit=False, max_poll_records=batch_size)
    await consumer.start()
    try:
        consumer.assign(partitions)
        starts, ends = await _range(consumer, partitions, bounds)
        progress = ScanProgress(total=sum(max(0, ends[tp] - starts[tp]) for tp in partitions),
                                positions={tp.partition: starts[tp] for tp in partitions})
        pending = {tp for tp in partitions if starts[tp] < ends[tp]}
        for tp in partitions:
            consumer.seek(tp, starts[tp])
        for tp in set(partitions) - pending:
            consumer.pause(tp)
        while pending:
            fetched = await consumer.getmany(*pending, timeout_ms=1000, max_records=batch_size)
            batch = [r for tp, records in fetched.items() for r in records if r.offset < ends[tp]]
            for tp in list(pending):
                # the position, not the last record: transaction markers occupy offsets too
                position = min(await consumer.position(tp), ends[tp])
                progress.positions[tp.partition] = position
                if position >= ends[tp]:
                    pending.discard(tp)
                    consumer.pause(tp)
            if batch:
                progress.done += len(batch)
                if on_progress:
                    on_progress(progress)
                yield batch
    finally:
        await consumer.stop()


async def resolve(settings: KafkaSettings, topic: str, bounds: Bounds = Bounds()) -> dict[int, tuple[int, int]]:
    """The range `bounds` names now, as offsets: partition → (first, stop before).

    Times and the log's end become fixed offsets, so a scan of them is the same range later on
    (what a resumed replay needs: the log grows meanwhile, and an age like `10m` moves).
    """
    partitions = await _partitions(settings, topic)
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        starts, ends = await _range(consumer, partitions, bounds)
    finally:
        await consumer.stop()
    return {tp.partition: (starts[tp], max(starts[tp], ends[tp])) for tp in partitions}


async def _partitions(settings: KafkaSettings, topic: str) -> list[TopicPartition]:
    partitions = await partitions_of(settings, topic)
    if not partitions:
        raise LookupError(f"topic {topic!r} does not exist on {settings.bootstrap_servers}; "
                          "check the topic prefix (--prefix / AGENTSTREAM_TOPIC_PREFIX)")
    return partitions


async def _range(consumer, partitions: list[TopicPartition], bounds: Bounds):
    first = await consumer.beginning_offsets(partitions)
    last = await consumer.end_offsets(partitions)
    starts = dict(first)
    ends = dict(last)
    if bounds.since_ms is not None:
        found = await consumer.offsets_for_times({tp: bounds.since_ms for tp in partitions})
        starts = {tp: (found[tp].offset if found[tp] else last[tp]) for tp in partitions}
    if bounds.until_ms is not None:
        found = await consumer.offsets_for_times({tp: bounds.until_ms for tp in partitions})
        ends = {tp: (found[tp].offset if found[tp] else last[tp]) for tp in partitions}
    for tp in partitions:
        if tp.partition in bounds.start_offsets:
            starts[tp] = max(starts[tp], bounds.start_offsets[tp.partition])
        if tp.partition in bounds.end_offsets:
            ends[tp] = min(ends[tp], bounds.end_offsets[tp.partition])
    return starts, ends


def parse_time(text: str, now_ms: int | None = None) -> int:
    """UTC ms from epoch milliseconds, an ISO-8601 time, or an age like `10m`, `2h`, `3d`."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    age = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if age:
        seconds = float(age[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[age[2]]
        return int((now_ms if now_ms is not None else time.time() * 1000) - seconds * 1000)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"cannot read time {text!r}: give epoch ms, ISO-8601 (2026-12-02T10:00), "
                         "or an age such as 10m, 2h, 3d") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return int(parsed.timestamp() * 1000)


def parse_offsets(text: str) -> dict[int, int]:
    """`0:100,1:250` → {0: 100, 1: 250}."""
    try:
        pairs = [part.split(":") for part in text.split(",") if part.strip()]
        return {int(partition): int(offset) for partition, offset in pairs}
    except ValueError:
        raise ValueError(f"cannot read offsets {text!r}: write PARTITION:OFFSET pairs, e.g. 0:100,1:250") from None

"""Reading a range of a topic from Kafka with librdkafka (confluent-kafka), in large fetches on a thread: several
times less work per record than aiokafka, which the long-running services keep using. `scan` (schemas/scan.py)
reads the tail of a range here; columnar scans (queries) take the fetches whole (`scan_fetches`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from agentstream.schemas.errors import LogUnavailable
from agentstream.schemas.kafka import KafkaSettings, librdkafka_auth
from agentstream.schemas.ranges import Bounds, Record, ScanProgress

if TYPE_CHECKING:
    from agentstream_native import Fetched
    from confluent_kafka import Consumer, Message

T = TypeVar("T")


def _consumer(settings: KafkaSettings, **extra: Any) -> Consumer:
    from confluent_kafka import Consumer

    return Consumer({
        **librdkafka_auth(settings),
        "group.id": "agentstream-scan",  # never joined nor committed: partitions are assigned
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_committed",
        "enable.partition.eof": True,
        # responses of at most 8 MB: glibc's malloc keeps buffers of up to 32 MB in the process once freed, so
        # librdkafka's next response reuses the memory of the last instead of fresh pages the kernel faults in
        # and zeroes (larger responses are mapped and unmapped each time, a page fault per page they fill)
        "fetch.max.bytes": 8 * 1024 * 1024,
        "max.partition.fetch.bytes": 2 * 1024 * 1024,
        "queued.max.messages.kbytes": 256 * 1024,
        "socket.timeout.ms": 15_000,
        "logger": _quiet,
        **extra,
    })


class _Quiet:
    """librdkafka logs connection hiccups itself; errors that matter surface as exceptions."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        return self.log


_quiet = _Quiet()


def _partitions(consumer: Consumer, settings: KafkaSettings, topic: str) -> list[int]:
    from confluent_kafka import KafkaException

    try:
        metadata = consumer.list_topics(topic, timeout=15)
    except KafkaException as exc:
        raise LogUnavailable(f"cannot reach Kafka at {settings.bootstrap_servers}: {exc}") from None
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise LogUnavailable(f"topic {topic!r} does not exist on {settings.bootstrap_servers}; "
                          "check the topic prefix (--topic-prefix / AGENTSTREAM_TOPIC_PREFIX)")
    return sorted(found.partitions)


def _retrying(call: Callable[[], T], what: str, deadline_s: float = 30.0) -> T:
    """`call()`, again while the broker answers with a passing error (a leader being elected)."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0]
            if time.monotonic() > deadline or not (error.retriable() or error.code() in _PASSING):
                raise LogUnavailable(f"{what}: {error.str()}") from None
        time.sleep(0.2)  # backoff before asking the broker again


def _passing_codes() -> frozenset[int]:
    from confluent_kafka import KafkaError

    return frozenset({KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                      KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT,
                      KafkaError.UNKNOWN_TOPIC_OR_PART})


_PASSING = _passing_codes()


def kafka_range(settings: KafkaSettings, topic: str, bounds: Bounds) -> dict[int, tuple[int, int]]:
    from confluent_kafka import TopicPartition

    consumer = _consumer(settings)
    try:
        partitions = _partitions(consumer, settings, topic)
        marks = {p: _retrying(partial(consumer.get_watermark_offsets, TopicPartition(topic, p), timeout=15,
                                      cached=False), f"offsets of {topic}")
                 for p in partitions}
        starts = {p: low for p, (low, _) in marks.items()}
        ends = {p: high for p, (_, high) in marks.items()}

        def at(ms: int) -> dict[int, int]:
            found = _retrying(lambda: consumer.offsets_for_times([TopicPartition(topic, p, ms) for p in partitions],
                                                                 timeout=15), f"offsets of {topic} by time")
            return {tp.partition: tp.offset if tp.offset >= 0 else ends[tp.partition] for tp in found}

        if bounds.since_ms is not None:
            starts = at(bounds.since_ms)
        if bounds.until_ms is not None:
            ends = at(bounds.until_ms)
    finally:
        consumer.close()
    for p in partitions:
        if p in bounds.start_offsets:
            starts[p] = max(starts[p], bounds.start_offsets[p])
        if p in bounds.end_offsets:
            ends[p] = min(ends[p], bounds.end_offsets[p])
    return {p: (starts[p], max(starts[p], ends[p])) for p in partitions}


async def kafka_records(settings: KafkaSettings, topic: str, ranges: dict[int, tuple[int, int]],
                         batch_size: int) -> AsyncGenerator[tuple[list[Record], dict[int, int]], None]:
    """Batches of records in `ranges` (partition → [first, stop before)) and the positions after each."""
    from confluent_kafka import KafkaError, TopicPartition

    consumer = await asyncio.to_thread(_consumer, settings)
    try:
        consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in ranges.items()])
        ends = {p: end for p, (_, end) in ranges.items()}
        pending = set(ends)
        positions = {p: start for p, (start, _) in ranges.items()}
        while pending:
            # librdkafka's consume returns when it has that many messages or at its timeout: asking for
            # no more than the range still holds ends a short scan when its records are in, not 1 s later
            messages = await asyncio.to_thread(consumer.consume, min(batch_size, _left(ends, positions, pending)), 1.0)
            batch: list[Record] = []
            for m in messages:
                p = m.partition()
                if m.error() is not None:
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        # at the log's end: transaction markers may fill the offsets up to `end`
                        if p in pending and m.offset() >= ends[p]:
                            positions[p] = ends[p]
                            pending.discard(p)
                        continue
                    raise LogUnavailable(f"reading {topic} from {settings.bootstrap_servers}: {m.error().str()}")
                offset = m.offset()
                if p not in pending or offset >= ends[p]:
                    continue
                batch.append(Record(topic, p, offset, m.timestamp()[1], m.key(), m.value()))
                positions[p] = offset + 1
                if offset + 1 >= ends[p]:
                    pending.discard(p)
            done = set(ends) - pending
            if done and pending:
                consumer.pause([TopicPartition(topic, p) for p in done])
            if batch or not pending:
                yield batch, dict(positions)
    finally:
        await asyncio.to_thread(consumer.close)


@dataclass
class Fetch:
    """One fetch of a columnar scan: its messages in range, as librdkafka handed them over."""

    topic: str
    messages: list[Message]
    taken: Fetched
    """their values and places in the log, for the native decoder (`Decoder.decode_fetched`)"""

    def __len__(self) -> int:
        return len(self.messages)

    def records(self) -> list[Record]:
        """The same as `Record`s (what the row-by-row decoding reads, when a record does not fit the models)."""
        return [Record(self.topic, m.partition(), m.offset(), m.timestamp()[1], m.key(), m.value())
                for m in self.messages]


async def scan_fetches(settings: KafkaSettings, topic: str, ranges: dict[int, tuple[int, int]],
                       batch_size: int = 20_000, on_progress: Callable[[ScanProgress], None] | None = None,
                       ) -> AsyncGenerator[Fetch, None]:
    """The messages of `ranges` (partition → [first, stop before), as `plan_scan` resolved them) from Kafka,
    a fetch at a time, each partition in offset order: `scan`'s Kafka part without a `Record` per message.

    The next fetch runs on a thread while the caller handles this one (the native decoder lets go of the GIL)."""
    from agentstream_native import take
    from confluent_kafka import KafkaError, TopicPartition

    progress = ScanProgress(total=sum(end - start for start, end in ranges.values()),
                            positions={p: start for p, (start, _) in ranges.items()})
    ranges = {p: (start, end) for p, (start, end) in ranges.items() if end > start}
    if not ranges:
        return
    consumer = await asyncio.to_thread(_consumer, settings)
    ends = {p: end for p, (_, end) in ranges.items()}
    pending = set(ends)

    def fetch() -> tuple[list[Message], Fetched, list[Message], dict[int, int]]:
        # see `kafka_records`: no more than the range still holds, so a short scan ends when it is in
        messages = consumer.consume(min(batch_size, _left(ends, progress.positions, pending)), 1.0)
        return take(messages, {p: ends[p] for p in pending})

    try:
        consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in ranges.items()])
        while pending:
            kept, taken, errors, positions = await asyncio.to_thread(fetch)
            progress.positions.update(positions)
            for m in errors:
                p = m.partition()
                if m.error().code() != KafkaError._PARTITION_EOF:
                    raise LogUnavailable(f"reading {topic} from {settings.bootstrap_servers}: {m.error().str()}")
                if p in pending and m.offset() >= ends[p]:  # transaction markers may fill the offsets up to `end`
                    progress.positions[p] = ends[p]
            done = {p for p in pending if progress.positions[p] >= ends[p]}
            pending -= done
            if done and pending:
                consumer.pause([TopicPartition(topic, p) for p in done])
            if kept or not pending:
                progress.done += len(kept)
                if on_progress:
                    on_progress(progress)
                yield Fetch(topic, kept, taken)
    finally:
        await asyncio.to_thread(consumer.close)


def _left(ends: dict[int, int], positions: dict[int, int], pending: set[int]) -> int:
    """Offsets still to read in the partitions not done (at least 1): the most records a fetch can bring."""
    return max(1, sum(ends[p] - positions[p] for p in pending))


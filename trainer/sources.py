"""Where trajectories come from: the live topic, a recorded topic range, or a file replay exported.

All three deliver raw records (topic, partition, offset, key, value: aiokafka's `ConsumerRecord` or
`schemas.scan.Record`, which has the same attributes) so that one
training loop decodes, deduplicates and accounts for them the same way. A record's position
(partition, offset) is what the trainer's ledger tracks; for a file, the partition is 0 and the
offset is the line number.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import IO, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition

from agentstream.schemas.kafka import KafkaSettings, make_consumer
from agentstream.schemas.scan import Bounds, Record, resolve, scan
from agentstream.trainer.errors import TrainerError
from agentstream.trainer.settings import TrainerSettings

Offsets = dict[int, int]
SourceRecord = ConsumerRecord | Record
"""a record as a source delivers it: aiokafka's, or the bounded reader's with the same attributes"""


class TrajectorySource(Protocol):
    name: str
    """identifies the source in checkpoints, so a restart resumes the same source where it stopped"""

    async def start(self, resume: Callable[[], Offsets], on_revoked: Callable[[set[int]], None]) -> None:
        """Begin reading; each partition from `resume()[partition]` when the trainer knows a position.
        `on_revoked` is told of partitions this trainer stops reading (consumer group rebalance)."""

    async def poll(self, timeout_s: float) -> list[ConsumerRecord] | list[Record]:
        """The next records, or [] after `timeout_s` without any."""

    @property
    def exhausted(self) -> bool:
        """True once an offline source has delivered its whole range; a live source never ends."""

    async def commit(self, watermarks: Offsets) -> None:
        """Record the positions up to which everything is durably accounted for."""

    async def stop(self) -> None: ...


class LiveSource:
    """The trajectories topic, read in a consumer group; offsets are committed to the group."""

    def __init__(self, settings: KafkaSettings, group: str):
        self.settings = settings
        self.topic = settings.topics.trajectories
        self.group = group
        self.name = f"kafka:{self.topic}"
        self.consumer: AIOKafkaConsumer | None = None

    async def start(self, resume: Callable[[], Offsets], on_revoked: Callable[[set[int]], None]) -> None:
        self.consumer = make_consumer(self.settings, group_id=self.group)
        await self.consumer.start()
        self.consumer.subscribe([self.topic], listener=_Rebalance(self.consumer, resume, on_revoked))

    @property
    def _consumer(self) -> AIOKafkaConsumer:
        if self.consumer is None:
            raise TrainerError(f"{self.name} is read before start()")
        return self.consumer

    async def poll(self, timeout_s: float) -> list[ConsumerRecord]:
        batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=1000)
        return [record for records in batches.values() for record in records]

    @property
    def exhausted(self) -> bool:
        return False

    async def commit(self, watermarks: Offsets) -> None:
        consumer = self._consumer
        offsets = {tp: watermarks[tp.partition] for tp in consumer.assignment() if tp.partition in watermarks}
        if offsets:
            await consumer.commit(offsets)

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no types: its base is Any
    """Seek assigned partitions past what the newest checkpoint accounts for (the group's committed
    offset lags it after a crash between checkpoint and commit)."""

    def __init__(self, consumer: AIOKafkaConsumer, resume: Callable[[], Offsets],
                 on_revoked: Callable[[set[int]], None]):
        self.consumer = consumer
        self.resume = resume
        self.on_revoked = on_revoked

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        if revoked:
            self.on_revoked({tp.partition for tp in revoked})

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        known = self.resume()
        for tp in assigned:
            if tp.partition in known:
                committed = await self.consumer.committed(tp)
                self.consumer.seek(tp, max(committed or 0, known[tp.partition]))


def parse_offsets(spec: str, partitions: list[int]) -> Offsets:
    """'N' → every partition at N; 'P:N,P:N' → those partitions (the others are left out)."""
    spec = spec.strip()
    if not spec:
        return {}
    if ":" not in spec:
        return dict.fromkeys(partitions, int(spec))
    offsets = {}
    for part in spec.split(","):
        partition, _, offset = part.partition(":")
        if int(partition) not in partitions:
            raise TrainerError(f"offset spec {spec!r}: the topic has no partition {partition} (it has {partitions})")
        offsets[int(partition)] = int(offset)
    return offsets


class TopicRangeSource:
    """A recorded range of a topic, read without a consumer group: [from, to) per partition, by the
    one bounded reader (`schemas.scan`)."""

    def __init__(self, settings: KafkaSettings, topic: str, start: str = "", end: str = ""):
        self.settings = settings
        self.topic = topic
        self.start_spec, self.end_spec = start, end
        self.name = f"range:{topic}"
        self.batches: AsyncGenerator[list[Record], None] | None = None
        self.done = False

    async def start(self, resume: Callable[[], Offsets], on_revoked: Callable[[set[int]], None]) -> None:
        log = await resolve(self.settings, self.topic)
        numbers = sorted(log)
        first, last = parse_offsets(self.start_spec, numbers), parse_offsets(self.end_spec, numbers)
        known = resume()
        ranges = {p: (max(first.get(p, start), start, known.get(p, 0)), min(last.get(p, end), end))
                  for p, (start, end) in log.items()}
        self.batches = scan(self.settings, self.topic, Bounds.exactly(ranges, numbers), batch_size=1000)

    async def poll(self, timeout_s: float) -> list[Record]:
        if self.done or self.batches is None:
            return []
        try:
            return await anext(self.batches)
        except StopAsyncIteration:
            self.done = True
            return []

    @property
    def exhausted(self) -> bool:
        return self.done

    async def commit(self, watermarks: Offsets) -> None:
        """Nothing to commit: the checkpoint's ledger is where a replay resumes."""

    async def stop(self) -> None:
        if self.batches is not None:
            await self.batches.aclose()


class FileSource:
    """A JSONL file of encoded trajectory events (one per line), as `agentstream replay` exports them."""

    def __init__(self, path: Path, batch_lines: int = 1000):
        self.path = path.resolve()
        self.name = f"file:{self.path}"
        self.batch_lines = batch_lines
        self.file: IO[bytes] | None = None
        self.line = 0
        self.done = False

    async def start(self, resume: Callable[[], Offsets], on_revoked: Callable[[set[int]], None]) -> None:
        if not self.path.is_file():
            raise TrainerError(f"offline file {self.path} does not exist")
        self.file = file = self.path.open("rb")
        skip = resume().get(0, 0)
        while self.line < skip and file.readline():
            self.line += 1

    async def poll(self, timeout_s: float) -> list[Record]:
        if self.file is None:
            raise TrainerError(f"{self.name} is read before start()")
        records: list[Record] = []
        while len(records) < self.batch_lines and not self.done:
            raw = self.file.readline()
            if not raw:
                self.done = True
                break
            if raw.strip():
                records.append(Record(self.name, 0, self.line, 0, None, raw.rstrip(b"\r\n")))
            self.line += 1
        return records

    @property
    def exhausted(self) -> bool:
        return self.done

    async def commit(self, watermarks: Offsets) -> None:
        """Nothing to commit: the checkpoint's ledger is where a replay resumes."""

    async def stop(self) -> None:
        if self.file is not None:
            self.file.close()


def make_source(settings: TrainerSettings) -> TrajectorySource:
    if settings.offline_file:
        return FileSource(settings.offline_file)
    if settings.offline_topic:
        return TopicRangeSource(settings, settings.offline_topic, settings.offline_from, settings.offline_to)
    return LiveSource(settings, settings.consumer_group)

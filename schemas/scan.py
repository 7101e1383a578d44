"""Read a bounded range of a topic: the one reader behind replay, queries, the archive, the dashboard,
the trainer's recorded ranges, the controller's recovery and pool sync's start at the log's end.

A scan assigns every partition itself (no consumer group), seeks to the start of the range, and
stops at its end: the log end as of when the scan began, an offset, or a time. So a scan is
finite and repeatable even while producers keep writing.

The range is read from Kafka, from the Parquet archive (`agentstream archive`), or both
(`Origin`): the archive for the offsets it holds, Kafka for the tail after them. Offsets are
Kafka's in both, so a range, a resume point and the records in it are the same whichever serves.

Kafka is read with librdkafka (confluent-kafka) in large fetches, on a thread: several times less
work per record than aiokafka, which the long-running services keep using.

Columnar scans (queries) read Kafka with `scan_fetches` instead: each fetch's messages as librdkafka
hands them over, sorted by the native extension in one pass (no `Record` made for each), for its
decoder to read straight into columns.

Interface: `Record`, `Bounds`, `Origin`, `ScanProgress`, `scan`, `Fetch`, `scan_fetches`, `resolve`,
`parse_time`, `parse_offsets`; the archive's file format: `Manifest`, `archive_records`, `archive_table`; `plan_scan`
(which offsets the archive serves, which Kafka).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

import orjson

from agentstream.schemas.durable import write_atomically
from agentstream.schemas.errors import ConfigurationError, LogUnavailable
from agentstream.schemas.kafka import KafkaSettings

if TYPE_CHECKING:  # for the annotations; polars is imported where used, so importing this module stays light
    import polars as pl
    from agentstream_native import Fetched
    from confluent_kafka import Consumer, Message

T = TypeVar("T")
MODES = ("kafka", "archive", "auto")


class Record(NamedTuple):
    """One record of a topic, as Kafka holds it (the attributes of aiokafka's ConsumerRecord)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Bounds:
    """Where a scan starts and stops. Offsets are per partition; times are UTC ms (record timestamps)."""

    since_ms: int | None = None
    until_ms: int | None = None
    start_offsets: dict[int, int] = field(default_factory=dict)
    """first offset to read, per partition (e.g. where an interrupted replay stopped)"""
    end_offsets: dict[int, int] = field(default_factory=dict)
    """offset to stop before, per partition"""

    @classmethod
    def exactly(cls, ranges: dict[int, tuple[int, int]], partitions: Iterable[int]) -> Bounds:
        """These offsets of these partitions (partition → [first, stop before)), nothing of the others."""
        return cls(start_offsets={p: ranges.get(p, (0, 0))[0] for p in partitions},
                   end_offsets={p: ranges.get(p, (0, 0))[1] for p in partitions})


@dataclass(frozen=True)
class Origin:
    """Where records come from: `kafka`, `archive` (only what it holds), or `auto` (the archive, then
    Kafka for the tail; Kafka alone where there is no archive)."""

    mode: Literal["kafka", "archive", "auto"] = "kafka"
    archive: Path | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(f"unknown source {self.mode!r}: use one of {', '.join(MODES)}")
        if self.mode == "archive" and self.archive is None:
            raise ConfigurationError("--source archive needs the archive's folder (--archive DIR or AGENTSTREAM_ARCHIVE)")

    def manifest(self, topic: str) -> Manifest | None:
        if self.mode == "kafka" or self.archive is None:
            return None
        found = Manifest.load(self.archive, topic)
        if found is None and self.mode == "archive":
            raise LogUnavailable(f"the archive {self.archive} holds nothing of {topic!r}; is `agentstream archive` "
                              "running with this prefix and folder? (or use --source kafka)")
        return found


KAFKA = Origin()


@dataclass
class ScanProgress:
    total: int
    done: int = 0
    positions: dict[int, int] = field(default_factory=dict)
    """next offset to read, per partition: a resume point"""


@dataclass
class Plan:
    """A range split by who serves it: the archive the offsets it holds, Kafka the rest."""

    ranges: dict[int, tuple[int, int]]
    manifest: Manifest | None = None
    old: dict[int, tuple[int, int]] = field(default_factory=dict)
    """partition → [first, stop before) read from the archive"""
    tail: dict[int, tuple[int, int]] = field(default_factory=dict)
    """partition → [first, stop before) read from Kafka"""


async def plan_scan(settings: KafkaSettings, topic: str, bounds: Bounds = Bounds(), origin: Origin = KAFKA) -> Plan:
    manifest = origin.manifest(topic)
    ranges = await resolve(settings, topic, bounds, origin, manifest)
    held = manifest.ends if manifest else {}
    split = {p: min(max(start, held.get(p, 0)), end) for p, (start, end) in ranges.items()}
    return Plan(ranges, manifest,
                old={p: (start, split[p]) for p, (start, _) in ranges.items() if split[p] > start},
                tail={p: (split[p], end) for p, (_, end) in ranges.items() if end > split[p]})


async def scan(
    settings: KafkaSettings, topic: str, bounds: Bounds = Bounds(), batch_size: int = 5000,
    on_progress: Callable[[ScanProgress], None] | None = None, origin: Origin = KAFKA,
) -> AsyncGenerator[list[Record], None]:
    """Yield batches of records of `topic` within `bounds`, each partition in offset order.

    `on_progress` is called with each batch before it is yielded: its `positions` are then where a
    scan that resumes after this batch starts.
    """
    plan = await plan_scan(settings, topic, bounds, origin)
    progress = ScanProgress(total=sum(end - start for start, end in plan.ranges.values()),
                            positions={p: start for p, (start, _) in plan.ranges.items()})
    if plan.old and plan.manifest:
        for batch in archive_records(plan.manifest, plan.old, batch_size):
            for record in batch:
                progress.positions[record.partition] = record.offset + 1
            progress.done += len(batch)
            if on_progress:
                on_progress(progress)
            yield batch
            await asyncio.sleep(0)
        progress.positions.update({p: end for p, (_, end) in plan.old.items()})
    if plan.tail:
        async for batch, positions in _kafka_records(settings, topic, plan.tail, batch_size):
            progress.positions.update(positions)
            progress.done += len(batch)
            if on_progress:
                on_progress(progress)
            yield batch


async def resolve(settings: KafkaSettings, topic: str, bounds: Bounds = Bounds(),
                  origin: Origin = KAFKA, manifest: Manifest | None = None) -> dict[int, tuple[int, int]]:
    """The range `bounds` names now, as offsets: partition → (first, stop before).

    Times and the log's end become fixed offsets, so a scan of them is the same range later on
    (what a resumed replay needs: the log grows meanwhile, and an age like `10m` moves).
    """
    manifest = manifest or origin.manifest(topic)
    if origin.mode == "archive" and manifest:  # (the archive mode has one, or `origin.manifest` raised)
        return manifest.range(bounds)
    ranges = await asyncio.to_thread(_kafka_range, settings, topic, bounds)
    if manifest is None:
        return ranges
    # the archive may hold what Kafka's retention has already deleted: it starts the range there
    archived = manifest.range(bounds)
    held = manifest.held()
    out = {}
    for p, (start, end) in ranges.items():
        if p not in held:
            out[p] = (start, end)
            continue
        a_start, a_end = archived[p]
        if bounds.since_ms is not None:  # the first record at or after the time: in the archive if it holds one
            first = a_start if a_start < manifest.ends[p] else start
        else:
            first = min(a_start, start)
        last = a_end if bounds.until_ms is not None and a_end < manifest.ends[p] else end
        out[p] = (first, max(first, last))
    return out


# --- Kafka ---------------------------------------------------------------------------------------


def _consumer(settings: KafkaSettings, **extra: Any) -> Consumer:
    from confluent_kafka import Consumer

    return Consumer({
        "bootstrap.servers": settings.bootstrap_servers,
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


def _kafka_range(settings: KafkaSettings, topic: str, bounds: Bounds) -> dict[int, tuple[int, int]]:
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


async def _kafka_records(settings: KafkaSettings, topic: str, ranges: dict[int, tuple[int, int]],
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
        # see `_kafka_records`: no more than the range still holds, so a short scan ends when it is in
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


# --- the archive's files -------------------------------------------------------------------------

MANIFEST = "_manifest.json"


@dataclass
class Manifest:
    """What the archive holds of one topic: its committed files, and per partition the next offset to
    archive. A file not named here was written by a run killed before its commit: it does not count."""

    folder: Path
    ends: dict[int, int] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    """{"path": relative to the folder, "rows": n, "bytes": n, "offsets": {partition: [first, last]},
    "times": [min, max] record timestamp}"""
    commits: int = 0

    @classmethod
    def load(cls, root: Path, topic: str) -> Manifest | None:
        folder = Path(root) / topic
        path = folder / MANIFEST
        if not path.is_file():
            return None
        try:
            raw = orjson.loads(path.read_bytes())
            return cls(folder, {int(p): e for p, e in raw["ends"].items()}, raw["files"], raw["commits"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise LogUnavailable(f"the archive manifest {path} is unreadable ({exc}); restore it from a backup, "
                              "or move the topic's folder away to archive it again") from None

    def save(self) -> None:
        """Atomically: a temporary file, flushed to disk, renamed over the old manifest."""
        self.folder.mkdir(parents=True, exist_ok=True)
        body = orjson.dumps({"ends": self.ends, "files": self.files, "commits": self.commits},
                            option=orjson.OPT_NON_STR_KEYS)
        write_atomically(self.folder / MANIFEST, lambda tmp: tmp.write_bytes(body))

    def held(self) -> set[int]:
        """the partitions of which the archive holds records"""
        return {int(p) for entry in self.files for p in entry["offsets"]}

    def range(self, bounds: Bounds) -> dict[int, tuple[int, int]]:
        """`bounds` as offsets within what the archive holds (a time: the first offset at or after it)."""
        firsts: dict[int, int] = {}
        for entry in self.files:
            for p, (first, _) in entry["offsets"].items():
                firsts[int(p)] = min(firsts.get(int(p), first), first)
        starts = {p: firsts.get(p, end) for p, end in self.ends.items()}
        ends = dict(self.ends)
        if bounds.since_ms is not None:
            starts = self._offsets_at(bounds.since_ms)
        if bounds.until_ms is not None:
            ends = self._offsets_at(bounds.until_ms)
        for p in self.ends:
            if p in bounds.start_offsets:
                starts[p] = max(starts[p], bounds.start_offsets[p])
            if p in bounds.end_offsets:
                ends[p] = min(ends[p], bounds.end_offsets[p])
        return {p: (starts[p], max(starts[p], ends[p])) for p in self.ends}

    def _offsets_at(self, ms: int) -> dict[int, int]:
        """Per partition, the first offset whose timestamp is at least `ms` (the end if none), as Kafka finds it."""
        import polars as pl

        found = dict(self.ends)
        paths = [self.folder / e["path"] for e in self.files if e["times"][1] >= ms]
        if paths:
            firsts = (pl.scan_parquet(paths).filter(pl.col("kafka_timestamp") >= ms)
                      .group_by("kafka_partition").agg(pl.col("kafka_offset").min()).collect())
            for p, offset in firsts.iter_rows():
                found[p] = min(found.get(p, offset), offset)
        return found


def _files(manifest: Manifest, ranges: dict[int, tuple[int, int]], partition: int | None = None) -> list[Path]:
    """The committed files holding records of `ranges` (of one partition, if given)."""
    paths = []
    for entry in manifest.files:
        for p, (first, last) in entry["offsets"].items():
            start, end = ranges.get(int(p), (0, 0))
            if (partition is None or int(p) == partition) and first < end and last >= start:
                paths.append(manifest.folder / entry["path"])
                break
    return paths


def _in_ranges(ranges: dict[int, tuple[int, int]]) -> pl.Expr:
    import polars as pl

    conditions = [(pl.col("kafka_partition") == p) & pl.col("kafka_offset").is_between(start, end - 1)
                  for p, (start, end) in ranges.items()]
    return pl.any_horizontal(conditions)


def archive_records(manifest: Manifest, ranges: dict[int, tuple[int, int]],
                    batch_size: int) -> Iterator[list[Record]]:
    """The archived records in `ranges`, each partition in offset order, in batches."""
    import polars as pl

    topic = manifest.folder.name
    for p, (start, end) in sorted(ranges.items()):
        paths = _files(manifest, ranges, p)
        if not paths:
            continue
        frame = (pl.scan_parquet(paths, missing_columns="insert", extra_columns="ignore")
                 .filter(_in_ranges({p: (start, end)}))
                 .select("kafka_offset", "kafka_timestamp", "key", "value").sort("kafka_offset").collect())
        for chunk in frame.iter_slices(batch_size):
            yield [Record(topic, p, offset, ts, key, value)
                   for offset, ts, key, value in zip(*(chunk[c].to_list() for c in chunk.columns))]


def archive_table(manifest: Manifest, ranges: dict[int, tuple[int, int]], columns: list[str]) -> pl.DataFrame | None:
    """The archived table rows (decoded when archived) in `ranges`: the columns asked for, readable rows only."""
    import polars as pl

    paths = _files(manifest, ranges)
    if not paths:
        return None
    return (pl.scan_parquet(paths, missing_columns="insert", extra_columns="ignore")
            .filter(_in_ranges(ranges) & pl.col("readable")).select(columns).collect())


# --- parsing the operator's range ----------------------------------------------------------------


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
        raise ConfigurationError(f"cannot read time {text!r}: give epoch ms, ISO-8601 (2026-12-02T10:00), "
                         "or an age such as 10m, 2h, 3d") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def parse_offsets(text: str) -> dict[int, int]:
    """`0:100,1:250` → {0: 100, 1: 250}."""
    try:
        pairs = [part.split(":") for part in text.split(",") if part.strip()]
        return {int(partition): int(offset) for partition, offset in pairs}
    except ValueError:
        raise ConfigurationError(f"cannot read offsets {text!r}: write PARTITION:OFFSET pairs, e.g. 0:100,1:250") from None

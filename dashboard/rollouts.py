"""Rollouts: a filtered list read newest first in growing chunks, and one attempt with all it is made of.

The list never reads the whole range: it resolves the range to offsets, reads the newest records of
each partition, and reads further back (four times as many each round) only until a page of matches
is complete. Rows are complete down to the oldest time every partition has been read to (the
horizon); a page holds only those. The next page starts below a cursor (time, partition, offset).

One attempt is found by its record (partition and offset, which list rows carry) or by rollout id:
the topics are keyed by rollout id, so its partition is known and only that one is read, newest first.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import polars as pl
from aiokafka.partitioner import murmur2

from agentstream.logs.query import load_table
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.errors import ConfigurationError
from agentstream.schemas.events import Event, TrajectoryEvent
from agentstream.schemas.kafka import KafkaSettings, partitions_of
from agentstream.schemas.scan import Bounds, Record, resolve, scan

LIST_COLUMNS = frozenset({
    "id", "rollout_id", "attempt_id", "time", "kafka_partition", "kafka_offset", "kafka_timestamp", "task_id",
    "group_id", "status", "split", "reward", "reward_missing", "weight_version_launch", "model", "finished_at",
    "started_at", "duration_ms", "attempt_number", "epoch", "sample_index", "merge_mismatches", "tenant"})
FIRST_CHUNK = 256
"""records per partition read first; each further round reads four times as many"""

Status = Literal["finished", "failed", "timed_out", "abandoned"]


class FilterError(ConfigurationError):
    """A filter that cannot be applied; its message says what to write instead."""


@dataclass(frozen=True)
class Filters:
    text: str | None = None
    task: str | None = None
    statuses: tuple[Status, ...] = ()
    split: Literal["train", "validation"] | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    version: int | None = None
    where: str | None = None
    """a polars SQL condition over the list's columns, for what the fields above cannot say"""
    tenant: str | None = None
    """the viewer's tenant: its rows only, applied before anything else (`where` included) sees the list"""

    def apply(self, df: pl.DataFrame) -> pl.DataFrame:
        if self.tenant is not None:  # first: the SQL of `where` is given a table of this tenant's rows alone
            df = df.filter((_col(df, "tenant") == self.tenant).fill_null(False))
        conditions = []
        if self.text:
            needle = self.text.lower()
            conditions.append(pl.any_horizontal(
                pl.col(name).cast(pl.String).str.to_lowercase().str.contains(needle, literal=True).fill_null(False)
                for name in ("rollout_id", "attempt_id", "task_id", "group_id") if name in df.columns))
        if self.task:
            conditions.append(_col(df, "task_id").cast(pl.String).str.contains(self.task, literal=True))
        if self.statuses:
            conditions.append(_col(df, "status").is_in(list(self.statuses)))
        if self.split:
            conditions.append(_col(df, "split") == self.split)
        if self.reward_min is not None:
            conditions.append(_col(df, "reward") >= self.reward_min)
        if self.reward_max is not None:
            conditions.append(_col(df, "reward") <= self.reward_max)
        if self.version is not None:
            conditions.append(_col(df, "weight_version_launch") == self.version)
        for condition in conditions:
            df = df.filter(condition.fill_null(False))
        if self.where and _READS_FILES.search(self.where):
            raise FilterError("where: a condition over the list's columns only; polars' read_* table functions "
                              "(files on the server) and subqueries are not allowed")
        if self.where and df.height:
            try:
                # parsed as one SQL expression, never pasted into a query: no UNION, no FROM, no table function
                # (`"read_parquet"(…)` and `read_parquet/**/(…)` slip past any pattern), only this frame's columns
                df = df.filter(pl.sql_expr(self.where))
            except Exception as exc:  # polars reports SQL errors with types of its own
                raise FilterError(f"cannot apply where={self.where!r}: {_first_line(exc)}. Columns: "
                                  f"{', '.join(sorted(LIST_COLUMNS))}; e.g. where=reward > 0.5 AND status = 'finished'") from exc
        return df


_READS_FILES = re.compile(r"\bread_\w+|\bscan_\w+|\bselect\b", re.IGNORECASE)
"""polars SQL's table functions (read_csv('/etc/passwd'), …) and subqueries: a filter reads the list, not the
server's disk (a second guard: the condition is parsed as an expression, which has no FROM)"""


def _col(df: pl.DataFrame, name: str) -> pl.Expr:
    return pl.col(name) if name in df.columns else pl.lit(None)


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


@dataclass(frozen=True)
class Cursor:
    """The last row of a page: the next page holds rows strictly older in (timestamp, partition, offset)."""

    timestamp: int
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.timestamp}:{self.partition}:{self.offset}"

    @classmethod
    def parse(cls, text: str) -> Cursor:
        try:
            timestamp, partition, offset = (int(part) for part in text.split(":"))
        except ValueError:
            raise FilterError(f"cannot read cursor {text!r}: it is TIMESTAMP:PARTITION:OFFSET, as the previous "
                              "page's next_cursor gave it") from None
        return cls(timestamp, partition, offset)


@dataclass
class Page:
    rows: list[dict[str, Any]]
    next_cursor: str | None
    scanned: int
    complete: bool = field(default=True)
    """False when the scan budget ran out before a page of matches was found"""
    frame: pl.DataFrame = field(default_factory=pl.DataFrame)
    """the rows as read (the export's Parquet keeps their types)"""


ORDER = ["kafka_timestamp", "kafka_partition", "kafka_offset"]


async def search(settings: KafkaSettings, filters: Filters, since_ms: int | None, until_ms: int | None,
                 limit: int, cursor: Cursor | None = None, budget: int = 2_000_000,
                 first_chunk: int = FIRST_CHUNK, columns: frozenset[str] | None = LIST_COLUMNS) -> Page:
    """A page of the trajectories `filters` match, newest first, below `cursor`; `columns`: the list's (None: every
    column of the `trajectories` table, as `agentstream sql` has it)."""
    if cursor is not None:
        until_ms = min(until_ms, cursor.timestamp + 1) if until_ms is not None else cursor.timestamp + 1
    ranges = await resolve(settings, settings.topics.trajectories, Bounds(since_ms=since_ms, until_ms=until_ms))
    lows = {p: stop for p, (_, stop) in ranges.items()}  # read so far: [low, stop) per partition
    oldest: dict[int, int] = {}  # per partition, the timestamp of the oldest record read
    matches: list[pl.DataFrame] = []
    chunk, scanned = first_chunk, 0
    while True:
        starts = {p: max(first, lows[p] - chunk) for p, (first, _) in ranges.items()}
        part, _ = await load_table(settings, "trajectories", Bounds(start_offsets=starts, end_offsets=dict(lows)),
                                   columns=columns)
        scanned += part.height
        lows = starts
        if part.height:
            for p, ts in part.group_by("kafka_partition").agg(pl.col("kafka_timestamp").min()).iter_rows():
                oldest[p] = ts
            if cursor is not None:
                part = part.filter(_before(cursor))
            matches.append(filters.apply(part))
        open_ = [p for p, (first, _) in ranges.items() if lows[p] > first]
        found = pl.concat(matches, how="diagonal_relaxed") if matches else pl.DataFrame()
        # records newer than every open partition's oldest read are all read: those rows are final (not those
        # as old: a partition's unread records may share its oldest read timestamp)
        horizon = max((oldest[p] for p in open_ if p in oldest), default=None)
        ready = found.filter(pl.col("kafka_timestamp") > horizon) if horizon is not None and found.height else found
        if ready.height >= limit or not open_ or scanned >= budget:
            break
        chunk *= 4
    frame = ready.sort(ORDER, descending=True).head(limit) if ready.height else pl.DataFrame()
    rows = frame.to_dicts()
    more = len(rows) == limit or bool(open_)
    last = rows[-1] if rows else None
    next_cursor = str(Cursor(last["kafka_timestamp"], last["kafka_partition"], last["kafka_offset"])) \
        if last and more else None
    return Page(rows, next_cursor, scanned, complete=len(rows) >= limit or not open_, frame=frame)


def _before(cursor: Cursor) -> pl.Expr:
    ts, p, o = pl.col("kafka_timestamp"), pl.col("kafka_partition"), pl.col("kafka_offset")
    return (ts < cursor.timestamp) | ((ts == cursor.timestamp) & (
        (p < cursor.partition) | ((p == cursor.partition) & (o < cursor.offset))))


# --- one attempt ---------------------------------------------------------------------------------


def partition_of(rollout_id: str, partitions: int) -> int:
    """The partition the producers' default partitioner puts a rollout's records in (Kafka's murmur2)."""
    hashed: int = murmur2(rollout_id.encode())
    return (hashed & 0x7FFFFFFF) % partitions


def only(partition: int, partitions: int, start: int | None = None, stop: int | None = None,
         since_ms: int | None = None, until_ms: int | None = None) -> Bounds:
    """Bounds that read one partition (every other one ends before it starts)."""
    starts = {partition: start} if start is not None else {}
    ends = {p: 0 for p in range(partitions) if p != partition}
    if stop is not None:
        ends[partition] = stop
    return Bounds(since_ms=since_ms, until_ms=until_ms, start_offsets=starts, end_offsets=ends)


async def find_trajectories(settings: KafkaSettings, rollout_id: str, partition: int | None = None,
                            offset: int | None = None, budget: int = 200_000) -> tuple[list[TrajectoryEvent], int]:
    """The trajectories (one per attempt) of a rollout, newest first, and how many records were read.

    With `offset`, the one record there (what a list row links to). Otherwise the rollout's partition
    is read backwards in growing chunks until its records turn up (then that chunk's are all of them:
    the attempts of a rollout settle close together), or `budget` records were read.
    """
    topic = settings.topics.trajectories
    count = len(await partitions_of(settings, topic))
    if not count:
        raise LookupError(f"topic {topic!r} does not exist on {settings.bootstrap_servers}; check the topic prefix")
    key = rollout_id.encode()
    if partition is not None and offset is not None:
        if not 0 <= partition < count:
            raise FilterError(f"partition {partition} does not exist: {topic} has {count}")
        records = [r async for batch in scan(settings, topic, only(partition, count, offset, offset + 1)) for r in batch]
        return _decoded([r for r in records if r.key == key]), len(records)
    partition = partition_of(rollout_id, count)
    (first, stop), = [(a, b) for p, (a, b) in (await resolve(settings, topic, only(partition, count))).items()
                      if p == partition]
    chunk, read = 1000, 0
    while stop > first and read < budget:
        start = max(first, stop - chunk)
        mine = []
        async for batch in scan(settings, topic, only(partition, count, start, stop)):
            read += len(batch)
            mine += [r for r in batch if r.key == key]
        if mine:
            return _decoded(mine), read
        stop, chunk = start, chunk * 4
    return [], read


def _decoded(records: Iterable[Record]) -> list[TrajectoryEvent]:
    events: list[TrajectoryEvent] = []
    for record in sorted(records, key=lambda r: r.offset, reverse=True):
        try:
            events.append(decode(record.value or b"", TrajectoryEvent))
        except DecodeError:
            continue
    return events


def _time_of(event_id: str) -> int | None:
    """The creation time a UUIDv7 id carries (derived ids carry none)."""
    try:
        parsed = uuid.UUID(event_id)
    except ValueError:
        return None
    return parsed.int >> 80 if parsed.version == 7 else None


async def related(settings: KafkaSettings, trajectory: TrajectoryEvent, record_ms: int | None = None
                  ) -> dict[str, list[Event]]:
    """The rollout's lifecycle events, the attempt's calls and rewards: its partition, its time span only."""
    t = trajectory.data
    times = [ms for ms in (_time_of(i) for i in t.lineage) if ms is not None]
    since = min([*times, t.started_at or t.finished_at, t.finished_at]) - 5_000
    # rewards computed by reward functions come after the trajectory is first written
    until = max([*times, t.finished_at, record_ms or 0]) + 60_000
    key = (trajectory.rollout_id or "").encode()

    async def events_of(base: str) -> list[Event]:
        topic = settings.topics.name(base)
        count = len(await partitions_of(settings, topic))
        events: list[Event] = []
        bounds = only(partition_of(trajectory.rollout_id or "", count), count, since_ms=since, until_ms=until)
        async for batch in scan(settings, topic, bounds):
            for record in batch:
                if record.key == key:
                    try:
                        events.append(decode(record.value or b""))
                    except DecodeError:
                        continue
        return sorted(events, key=lambda e: (e.time, e.id))

    bases = ("rollouts", "calls", "rewards")
    return dict(zip(bases, await asyncio.gather(*(events_of(base) for base in bases))))

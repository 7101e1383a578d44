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

This module plans a range and reads it: `Origin`, `plan_scan` (which offsets the archive serves, which Kafka),
`scan`, `resolve`. Its parts, each a job of its own: what a range is and how an operator writes one
(schemas/ranges.py: `Record`, `Bounds`, `ScanProgress`, `parse_time`, `parse_offsets`), reading Kafka with
librdkafka (schemas/kafka_reader.py: `Fetch`, `scan_fetches`), the archive's files (schemas/archive_files.py:
`Manifest`, `archive_records`, `archive_table`); their names are here too, as the readers import them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentstream.schemas.archive_files import MANIFEST as MANIFEST
from agentstream.schemas.archive_files import Manifest as Manifest
from agentstream.schemas.archive_files import archive_records as archive_records
from agentstream.schemas.archive_files import archive_table as archive_table
from agentstream.schemas.errors import ConfigurationError, LogUnavailable
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.kafka_reader import Fetch as Fetch
from agentstream.schemas.kafka_reader import kafka_range, kafka_records
from agentstream.schemas.kafka_reader import scan_fetches as scan_fetches
from agentstream.schemas.ranges import Bounds as Bounds
from agentstream.schemas.ranges import Record as Record
from agentstream.schemas.ranges import ScanProgress as ScanProgress
from agentstream.schemas.ranges import parse_offsets as parse_offsets
from agentstream.schemas.ranges import parse_time as parse_time

MODES = ("kafka", "archive", "auto")


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
        async for batch, positions in kafka_records(settings, topic, plan.tail, batch_size):
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
    ranges = await asyncio.to_thread(kafka_range, settings, topic, bounds)
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

"""`agentstream archive`: every topic compacted into Parquet files by topic and hour, exactly once.

    ARCHIVE/<topic>/_manifest.json                        what is committed, and where to go on
    ARCHIVE/<topic>/hour=2026-12-03T18/part-00000042.parquet

Each file holds a run of records as their topic's table (the columns `agentstream sql` shows,
decoded once, here) plus the record as Kafka holds it (`key`, `value`, for replay), zstd-compressed.

Exactly once, by the order of the writes: a commit reads the next records of every partition,
writes its files (each to a temporary name, flushed, renamed), and only then replaces the
manifest, which names the files and the next offset of each partition. A process killed at any
point leaves the last manifest as it was: on start, files it does not name are deleted and the
same offsets are read again. Readers only ever open files a manifest names.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import polars as pl

from agentstream.logs.query import TABLES, decode_aligned
from agentstream.schemas.durable import write_atomically
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import MANIFEST, Bounds, Manifest, resolve, scan


@dataclass
class Archiver:
    settings: KafkaSettings
    root: Path
    commit_records: int = 200_000
    """the most records one commit reads (bounds memory; a commit is at least one file per hour it spans)"""
    tables: tuple[str, ...] = TABLES
    say: Callable[[str], None] = print
    archived: dict[str, int] = field(default_factory=dict)
    """records archived by this process, per topic"""
    stopping: bool = False
    """set on SIGTERM: the commit in progress finishes, no other starts"""

    def recover(self, topic: str) -> Manifest:
        """The topic's manifest, with every file it does not name (a killed run's) deleted."""
        manifest = Manifest.load(self.root, topic) or Manifest(self.root / topic)
        named = {manifest.folder / entry["path"] for entry in manifest.files}
        if manifest.folder.is_dir():
            for path in manifest.folder.rglob("*"):
                if path.is_file() and path.name != MANIFEST and path not in named:
                    path.unlink()
        return manifest

    async def cycle(self) -> int:
        """Archive every topic up to its end as of now; return how many records."""
        total = 0
        for table in self.tables:
            topic = self.settings.topics.name(table)
            try:
                ranges = await resolve(self.settings, topic)
            except LookupError:
                continue  # not created yet
            manifest = self.recover(topic)
            while not self.stopping:
                count = await self.commit(manifest, table, ranges)
                total += count
                if not count:
                    break
        return total

    async def commit(self, manifest: Manifest, table: str, ranges: dict[int, tuple[int, int]]) -> int:
        """Read up to `commit_records` after the manifest's positions, write their files, then the manifest."""
        topic = manifest.folder.name
        starts = {p: max(manifest.ends.get(p, start), start) for p, (start, _) in ranges.items()}
        left = {p: end - starts[p] for p, (_, end) in ranges.items() if end > starts[p]}
        if not left:
            return 0
        share = max(1, self.commit_records // len(left))
        ends = {p: starts[p] + min(n, share) for p, n in left.items()}
        bounds = Bounds.exactly({p: (starts[p], end) for p, end in ends.items()}, ranges)
        frames, count = [], 0
        async for batch in scan(self.settings, topic, bounds, batch_size=20_000):
            frame = decode_aligned(batch, table)
            frames.append(frame.with_columns(pl.Series("key", [r.key for r in batch], pl.Binary),
                                             pl.Series("value", [r.value for r in batch], pl.Binary)))
            count += len(batch)
        manifest.commits += 1
        if frames:
            written = await asyncio.to_thread(self._write, manifest, pl.concat(frames))
            manifest.files += written
        manifest.ends.update(ends)  # the scan read each partition up to there (markers may fill the last offsets)
        manifest.save()
        self.archived[topic] = self.archived.get(topic, 0) + count
        return max(count, 1)  # offsets moved on (a range of transaction markers only counts as progress)

    def _write(self, manifest: Manifest, frame: pl.DataFrame) -> list[dict[str, Any]]:
        hours = frame.with_columns(
            pl.from_epoch("kafka_timestamp", time_unit="ms").dt.strftime("hour=%Y-%m-%dT%H").alias("_hour"))
        written = []
        for (hour,), part in hours.partition_by("_hour", as_dict=True, maintain_order=True).items():
            part = part.drop("_hour")
            relative = Path(hour) / f"part-{manifest.commits:08d}.parquet"
            path = manifest.folder / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, partial(_write_parquet, part))
            offsets = part.group_by("kafka_partition").agg(pl.col("kafka_offset").min().alias("first"),
                                                            pl.col("kafka_offset").max().alias("last"))
            written.append({
                "path": str(relative), "rows": part.height, "bytes": path.stat().st_size,
                "value_bytes": int(part["value"].bin.size().sum()),
                "offsets": {str(p): [first, last] for p, first, last in offsets.iter_rows()},
                "times": [cast(int, part["kafka_timestamp"].min()), cast(int, part["kafka_timestamp"].max())],
            })
        return written


async def run(archiver: Archiver, interval_s: float = 10.0, once: bool = False) -> None:
    """Archive continuously (every `interval_s`), or up to the current end (`once`); SIGTERM ends it
    after the commit in progress."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def stopping() -> None:
        archiver.stopping = True
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping)
    while True:
        started = time.monotonic()
        count = await archiver.cycle()
        if count:
            archiver.say(f"archived {count:,} records in {time.monotonic() - started:.1f} s "
                         f"({', '.join(f'{t}: {n:,}' for t, n in archiver.archived.items())} since start)")
        if once or stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except TimeoutError:
            pass


def _write_parquet(part: pl.DataFrame, path: Path) -> None:
    part.write_parquet(path, compression="zstd", statistics=True)

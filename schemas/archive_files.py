"""The Parquet archive's files (`agentstream archive`): the manifest of what it holds of a topic, and reading
a range back from them, as records or as the decoded table."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from agentstream.schemas.durable import write_atomically
from agentstream.schemas.errors import LogUnavailable
from agentstream.schemas.ranges import Bounds, Record

if TYPE_CHECKING:  # polars is imported where used, so importing this module stays light
    import polars as pl


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


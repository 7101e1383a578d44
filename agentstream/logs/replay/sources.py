"""Where a replay's trajectories come from: a trajectories topic as it is, or a rebuild (rebuild.py).

A source yields chunks of items; between two chunks, `position()` is where a replay that has made
the chunks so far durable resumes.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import polars as pl

from agentstream.logs.repeats import Repeats
from agentstream.logs.replay import columnar
from agentstream.logs.replay.columnar import Misfit
from agentstream.logs.replay.selection import Selection, made_by
from agentstream.logs.replay.state import ReplayError, int_keys
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import Call, TrajectoryEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import (
    KAFKA,
    Bounds,
    Fetch,
    Origin,
    Record,
    ScanProgress,
    archive_records,
    plan_scan,
    scan_fetches,
)


@dataclass
class Item:
    trajectory: TrajectoryEvent | None
    """None where no model was made: only its bytes came (from a rebuild's worker process, or a stored
    trajectory read in columns, for a sink that writes bytes), or its rows are the chunk's (`Chunk.rows`)"""
    calls: dict[str, Call] = field(default_factory=dict)
    """the calls of its turns by id, where the source has them (a rebuild does): the dataset's messages"""
    raw: bytes | None = None
    """the event as the topic holds it or a worker encoded it (written as is, not encoded again)"""
    id: str = ""
    key: bytes | None = None
    """the trajectory's id and record key (given with `raw` where there is no `trajectory`)"""

    def __post_init__(self) -> None:
        if self.trajectory is not None:
            self.id, self.key = self.trajectory.id, self.trajectory.key

    @property
    def event(self) -> TrajectoryEvent:
        """its model, where a step needs one (a source makes it wherever such a step runs)"""
        if self.trajectory is None:
            raise ReplayError(f"trajectory {self.id} came as bytes only, where its model is needed")
        return self.trajectory


class Source(Protocol):
    counts: Counter[str]
    """records left out, by reason; and what the source made"""

    def chunks(self) -> AsyncGenerator[list[Item], None]: ...

    def position(self) -> dict[str, Any]: ...

    @property
    def remaining(self) -> int:
        """records of the range left to read when the source started"""

    @property
    def read(self) -> int:
        """records read since the source started"""


DECODING_AHEAD = 2
"""fetches decoded at once, each on a thread of its own, while the next is fetched (as SQL's scans)"""
Decoded = tuple[pl.DataFrame, pl.DataFrame | None]
"""a batch's columns (`columnar.columns`), and its dataset rows where the sink writes rows"""


class Chunk(list[Item]):
    """A chunk of items; `rows`, where the source made them: the dataset rows of its items, in order
    (`columnar.dataset_rows`, for a sink that writes rows)."""

    rows: pl.DataFrame | None = None


class StoredTrajectories:
    """The trajectory events of one topic (the live `trajectories`, or a rebuild's), in a range.

    Read a batch at a time into columns (`columnar`), a batch with a record pydantic would not take as
    it is row by row with pydantic; the selection is applied here (`selects`), after dropping repeats.
    """

    selects = True

    def __init__(self, settings: KafkaSettings, topic: str, ranges: dict[int, tuple[int, int]],
                 position: dict[str, Any] | None, counts: Counter[str], batch_size: int = 5000,
                 origin: Origin = KAFKA, selection: Selection = Selection(), rows: bool = False):
        self.settings = settings
        self.topic = topic
        self.ends = {p: end for p, (_, end) in ranges.items()}
        self.next = int_keys(position["next"]) if position else {p: start for p, (start, _) in ranges.items()}
        self.batch_size = batch_size
        self.origin = origin
        self.selection = selection
        self.rows = rows
        """whether the sink writes dataset rows (then the chunks carry them) rather than the events"""
        self.counts = counts
        self.remaining = sum(max(0, self.ends[p] - self.next[p]) for p in self.ends)
        self.read = 0
        self.repeats = Repeats()

    async def chunks(self) -> AsyncGenerator[list[Item], None]:
        plan = await plan_scan(self.settings, self.topic, Bounds(start_offsets=dict(self.next),
                                                                 end_offsets=dict(self.ends)), self.origin)
        if plan.old and plan.manifest:
            for records in archive_records(plan.manifest, plan.old, self.batch_size):
                chunk = self._chunk(records, self._decode(records))
                self.next.update({record.partition: record.offset + 1 for record in records})
                yield chunk
                await asyncio.sleep(0)
            self.next.update({p: end for p, (_, end) in plan.old.items()})
        if plan.tail:
            async for chunk in self._kafka_chunks(plan.tail):
                yield chunk

    async def _kafka_chunks(self, ranges: dict[int, tuple[int, int]]) -> AsyncIterator[Chunk]:
        """A chunk per fetch, each decoded on a thread while the next is fetched (the native check and
        decoder let go of the GIL); the position after a chunk counts once it is yielded."""
        latest: dict[int, int] = {}

        def progressed(progress: ScanProgress) -> None:
            latest.update(progress.positions)

        ahead: deque[tuple[Fetch, dict[int, int], asyncio.Future[Decoded | None]]] = deque()

        async def take() -> Chunk:
            fetch, positions, decoding = ahead.popleft()
            chunk = self._chunk(fetch, await decoding)
            self.next.update(positions)
            return chunk

        fetches = scan_fetches(self.settings, self.topic, ranges, self.batch_size, on_progress=progressed)
        try:
            async with aclosing(fetches):
                async for fetch in fetches:
                    ahead.append((fetch, dict(latest), asyncio.ensure_future(asyncio.to_thread(self._decode, fetch))))
                    if len(ahead) > DECODING_AHEAD:
                        yield await take()
            while ahead:
                yield await take()
        finally:  # a decoding under way runs on to its end on its thread: none outlives the scan
            await asyncio.gather(*(decoding for _, _, decoding in ahead), return_exceptions=True)

    def _decode(self, batch: list[Record] | Fetch) -> Decoded | None:
        """The batch's columns, and its dataset rows if the sink writes rows; None if a record does not fit."""
        try:
            frame = columnar.columns(batch, self.rows, fields=self.selection.looks_inside)
            return frame, columnar.dataset_rows(frame) if self.rows else None
        except Misfit:
            return None

    def _chunk(self, batch: list[Record] | Fetch, decoded: Decoded | None) -> Chunk:
        self.read += len(batch)
        if decoded is None:
            return self._row_by_row(batch.records() if isinstance(batch, Fetch) else batch)
        frame, rows = decoded
        values = [None] * len(batch) if self.rows else (
            [m.value() for m in batch.messages] if isinstance(batch, Fetch) else [r.value for r in batch])
        # what the selection looks at inside a trajectory (read where it does: `looks_inside`)
        versions = columnar.turn_versions(frame) if self.selection.versions else []
        launches = frame["weight_version_launch"].to_list() if self.selection.versions else []
        started = frame["started_at"].to_list() if self.selection.started_from_ms is not None else None
        chunk, kept = Chunk(), []
        for i, (event_id, rollout_id) in enumerate(zip(frame["id"].to_list(), frame["rollout_id"].to_list())):
            if not self.repeats.first(event_id):
                self.counts["repeats"] += 1
            elif not self.selection.wants_fields(rollout_id, started[i] if started else None,
                                                 partial(_made_by_row, versions, launches, i)):
                self.counts["not_selected"] += 1
            else:
                chunk.append(Item(None, raw=values[i], id=event_id, key=rollout_id.encode() if rollout_id else None))
                kept.append(i)
        if rows is not None:
            chunk.rows = rows.filter(pl.col("index").is_in(kept)).drop("index")
        return chunk

    def _row_by_row(self, records: list[Record]) -> Chunk:
        chunk = Chunk()
        for record in records:
            try:
                trajectory = decode(record.value or b"", expect=TrajectoryEvent)
            except DecodeError:
                self.counts["undecodable"] += 1
                continue
            if not self.repeats.first(trajectory.id):  # a worker that crashed may have published it twice
                self.counts["repeats"] += 1
            elif not self.selection.wants(trajectory):
                self.counts["not_selected"] += 1
            else:
                chunk.append(Item(trajectory, raw=record.value))
        return chunk

    def position(self) -> dict[str, Any]:
        return {"next": dict(self.next)}


def _made_by_row(versions: list[list[int | None]], launches: list[int | None], row: int) -> set[int]:
    """`made_by` of one row of a batch read in columns (asked only when the selection names versions)."""
    return made_by(versions[row], launches[row])

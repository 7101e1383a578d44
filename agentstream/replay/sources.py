"""Where a replay's trajectories come from: a trajectories topic as it is, or a rebuild (rebuild.py).

A source yields chunks of items; between two chunks, `position()` is where a replay that has made
the chunks so far durable resumes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentstream.repeats import Repeats
from schemas.scan import KAFKA, Bounds, Origin, ScanProgress, scan
from agentstream.replay.state import int_keys
from schemas.codec import DecodeError, decode
from schemas.events import Call, TrajectoryEvent
from schemas.kafka import KafkaSettings


@dataclass
class Item:
    trajectory: TrajectoryEvent | None
    """None where only its bytes came (from a rebuild's worker process, for a sink that writes bytes)"""
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


class Source(Protocol):
    counts: Counter[str]
    """records left out, by reason; and what the source made"""

    def chunks(self) -> AsyncIterator[list[Item]]: ...

    def position(self) -> dict[str, Any]: ...

    @property
    def remaining(self) -> int:
        """records of the range left to read when the source started"""

    @property
    def read(self) -> int:
        """records read since the source started"""


class StoredTrajectories:
    """The trajectory events of one topic (the live `trajectories`, or a rebuild's), in a range."""

    def __init__(self, settings: KafkaSettings, topic: str, ranges: dict[int, tuple[int, int]],
                 position: dict[str, Any] | None, counts: Counter[str], batch_size: int = 5000,
                 origin: Origin = KAFKA):
        self.settings = settings
        self.topic = topic
        self.ends = {p: end for p, (_, end) in ranges.items()}
        self.next = int_keys(position["next"]) if position else {p: start for p, (start, _) in ranges.items()}
        self.batch_size = batch_size
        self.origin = origin
        self.counts = counts
        self.remaining = sum(max(0, self.ends[p] - self.next[p]) for p in self.ends)
        self.read = 0
        self.repeats = Repeats()

    async def chunks(self) -> AsyncIterator[list[Item]]:
        def progressed(progress: ScanProgress) -> None:
            self.next.update(progress.positions)

        bounds = Bounds(start_offsets=dict(self.next), end_offsets=dict(self.ends))
        async for batch in scan(self.settings, self.topic, bounds, self.batch_size, on_progress=progressed,
                                     origin=self.origin):
            self.read += len(batch)
            items = []
            for record in batch:
                try:
                    trajectory = decode(record.value, expect=TrajectoryEvent)
                except DecodeError:
                    self.counts["undecodable"] += 1
                    continue
                if self.repeats.first(trajectory.id):  # a worker that crashed may have published it twice
                    items.append(Item(trajectory, raw=record.value))
                else:
                    self.counts["repeats"] += 1
            yield items

    def position(self) -> dict[str, Any]:
        return {"next": dict(self.next)}

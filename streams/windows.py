"""Tumbling windows of analytics aggregates, in tables written a batch at a time.

The assembly worker adds the calls it reads and the trajectories it emits (no second consumer of
the calls topic, no second decoding) and writes each window changed in a batch once, at its end:
Faust's windowed tables write one changelog record per window per event. A window is keyed
`model|weight version|partition|start` (start in seconds, a multiple of the size) and written to
its partition's changelog partition; windows older than `history` sizes are dropped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import faust

from agentstream.schemas.events import Call, Trajectory
from agentstream.streams import analytics
from agentstream.streams.analytics import Aggregate
from agentstream.streams.tables import StateTable, registered

V = TypeVar("V")
UNACKNOWLEDGED_MAX = 2000
"""window writes on their way to the broker before the worker waits for them"""


def group_key(model: str | None, version: int | None, partition: int) -> str:
    return f"{model or ''}|{'' if version is None else version}|{partition}"


def wrote_it(trajectory: Trajectory) -> int | None:
    """The weight version a trajectory is credited to: the oldest that generated one of its turns."""
    versions = [turn.weight_version for turn in trajectory.turns if turn.weight_version is not None]
    return min(versions) if versions else None


class Windows:
    """One table per window size; aggregates changed since the last `flush`, and since the last `published`."""

    def __init__(self, app: faust.App, sizes: list[int], history: int, partitions: int):
        self.history = history
        self.tables = {size: registered(app, StateTable(app, name=f"windows-{size}s", partitions=partitions,
                                                        on_recover=self._recovered))
                       for size in sizes}
        self._dirty: dict[tuple[int, str], int] = {}
        """(size, window key) → its partition: written at the next flush"""
        self._unpublished: set[tuple[int, str]] = set()
        self._starts: dict[int, dict[float, set[str]]] = {size: defaultdict(set) for size in sizes}
        """size → window start → its window keys: the old ones are dropped without a scan"""

    async def _recovered(self) -> None:
        for size, table in self.tables.items():
            self._starts[size].clear()
            for key in list(table.data):
                self._starts[size][float(key.rpartition("|")[2])].add(key)

    def add_call(self, call: Call, partition: int, timestamp_s: float) -> None:
        self._add(group_key(call.model, call.weight_version, partition), partition, timestamp_s, analytics.add_call,
                  call)

    def add_trajectory(self, trajectory: Trajectory, partition: int, timestamp_s: float) -> None:
        self._add(group_key(trajectory.model, wrote_it(trajectory), partition), partition, timestamp_s,
                  analytics.add_trajectory, trajectory)

    def _add(self, group: str, partition: int, timestamp_s: float, add: Callable[[Aggregate, V], Aggregate],
             value: V) -> None:
        for size, table in self.tables.items():
            start = math.floor(timestamp_s / size) * size
            key = f"{group}|{start:g}"
            table.data[key] = add(table.data.get(key, {}), value)
            self._starts[size][start].add(key)
            self._dirty[(size, key)] = partition

    async def flush(self) -> None:
        """Write the windows changed since the last flush; drop those past the history."""
        dirty, self._dirty = self._dirty, {}
        for (size, key), partition in dirty.items():
            if key in self.tables[size].data:
                await self.tables[size].write(partition, key, self.tables[size].data[key])
        self._unpublished.update(dirty)
        for size, starts in self._starts.items():
            if starts:
                oldest = max(starts) - size * self.history
                for start in [start for start in starts if start <= oldest]:
                    for key in starts.pop(start):
                        await self.tables[size].drop(int(key.rsplit("|", 2)[1]), key)
        for table in self.tables.values():
            if table.unacknowledged > UNACKNOWLEDGED_MAX:  # bounded: the producer's buffer is not the history
                await table.written()

    def unpublished(self) -> list[tuple[int, str, Aggregate]]:
        """(size, window key, aggregate) of the windows written since the last call."""
        pending, self._unpublished = self._unpublished, set()
        return [(size, key, self.tables[size].data[key]) for size, key in pending if key in self.tables[size].data]

    def view(self) -> dict[str, list[dict[str, Any]]]:
        """Per size, the local windows, newest first: per window and (model, weight version), partitions merged."""
        return {str(size): _merged(table.data, size) for size, table in self.tables.items()}


def parse(key: str) -> tuple[str, str, str, float]:
    """(model, weight version, partition, start in seconds) of a window key."""
    model, version, partition, start = key.split("|")
    return model, version, partition, float(start)


def _merged(data: Mapping[str, Aggregate], size: int) -> list[dict[str, Any]]:
    merged: dict[tuple[float, str, str], list[Aggregate]] = {}
    for key, value in list(data.items()):
        model, version, _partition, start = parse(key)
        merged.setdefault((start, model, version), []).append(value)
    rows = [{"window_start": int(start * 1000), "window_s": size, "model": model or None,
             "weight_version": int(version) if version else None, **analytics.summary(analytics.merge(values))}
            for (start, model, version), values in merged.items()]
    return sorted(rows, key=lambda row: (-row["window_start"], row["model"] or "", row["weight_version"] or -1))

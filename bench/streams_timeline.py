"""The streams worker's timeline, probed from outside the product: what the worker did when, as JSON lines.

    python bench/streams_timeline.py FILE ARGS…    runs `python -m agentstream.streams ARGS…` with the probe on

`bench.streams_assembly --timeline DIR` runs its workers so. The probe wraps the worker's methods
before the module runs (as tests/support/faults.py injects its faults), so the product carries no hook.

Marks (wall time `t`, seconds): `take` (records taken from the inbox), `batch` (a batch end: its
records, whether the timer ended it, and how long settling and the state's write took), `emit` (the
attempts settled, and how long the decisions' acks, building and sending, and the trajectories' acks
took), `gc` (a collector pass: generation, milliseconds), `commit` (Faust's offset commit,
milliseconds) and `stall` (the event loop late for a short sleep).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import runpy
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import orjson

STALL_PROBE_S = 0.005
STALL_MIN_S = 0.020
"""a sleep of STALL_PROBE_S that returned this much late is marked"""

P = ParamSpec("P")
R = TypeVar("R")


class Timeline:
    def __init__(self, path: str):
        self.path = path
        self.marks: list[dict[str, Any]] = []
        self.spent: dict[str, float] = {}
        """seconds spent in each timed method since its enclosing mark began"""
        self._gc_began = 0.0
        gc.callbacks.append(self._on_gc)

    def mark(self, kind: str, **fields: Any) -> None:
        self.marks.append({"t": time.time(), "kind": kind, **fields})

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - began

    def taken(self, *names: str) -> dict[str, float]:
        """The milliseconds spent in each of `names` since they were last taken."""
        return {name: self.spent.pop(name, 0.0) * 1000 for name in names}

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.mark("gc", generation=info["generation"], ms=(time.perf_counter() - self._gc_began) * 1000,
                      collected=info["collected"])

    def write(self) -> None:
        """Append the marks so far to the file."""
        if self.marks:
            marks, self.marks = self.marks, []
            with open(self.path, "ab") as out:
                out.writelines(orjson.dumps(mark, option=orjson.OPT_NON_STR_KEYS) + b"\n" for mark in marks)

    async def watch_loop(self) -> None:
        """Mark the event loop's stalls (a short sleep returning late), and write the marks every second."""
        written = time.monotonic()
        while True:
            began = time.monotonic()
            await asyncio.sleep(STALL_PROBE_S)
            now = time.monotonic()
            if now - began - STALL_PROBE_S >= STALL_MIN_S:
                self.mark("stall", ms=(now - began - STALL_PROBE_S) * 1000)
            if now - written >= 1.0:
                self.write()
                written = now


def timing(timeline: Timeline, name: str, method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    @functools.wraps(method)
    async def timed(*args: P.args, **kwargs: P.kwargs) -> R:
        with timeline.timed(name):
            return await method(*args, **kwargs)

    return timed


def probe(timeline: Timeline) -> None:
    """Wrap the worker's and its transport's methods to mark the timeline."""
    from agentstream.streams.transport import Consumer, Inbox
    from agentstream.streams.worker import AssemblyWorker

    take, commit, on_started = Inbox.take, Consumer.commit, AssemblyWorker.on_started
    end_batch, emit, record = AssemblyWorker._end_batch, AssemblyWorker._emit, AssemblyWorker._record
    for name in ("_settle", "_flush", "_decide", "_publish_settled"):
        setattr(AssemblyWorker, name, timing(timeline, name, getattr(AssemblyWorker, name)))

    def taking(self: Inbox) -> Any:
        records = take(self)
        timeline.mark("take", n=len(records))
        return records

    async def ending_batch(self: AssemblyWorker, partitions: Iterable[int] = ()) -> None:
        records, timeline.spent = self.batched, {}
        partitions = list(partitions)
        await end_batch(self, partitions)
        spent = timeline.taken("_settle", "_flush")
        timeline.mark("batch", n=records, timer=bool(partitions), settle_ms=spent["_settle"],
                      flush_ms=spent["_flush"])

    async def emitting(self: AssemblyWorker, settled: Any) -> None:
        began = time.perf_counter()
        await emit(self, settled)
        spent = timeline.taken("_decide", "_publish_settled", "_record")
        whole = (time.perf_counter() - began) * 1000
        timeline.mark("emit", settled=len(settled), decided_ms=spent["_decide"], build_ms=spent["_publish_settled"],
                      acked_ms=whole - sum(spent.values()))

    def recording(self: AssemblyWorker, settled: Any) -> None:
        with timeline.timed("_record"):
            record(self, settled)

    async def committing(self: Consumer, *args: Any, **kwargs: Any) -> bool:
        began = time.perf_counter()
        try:
            return await commit(self, *args, **kwargs)
        finally:
            timeline.mark("commit", ms=(time.perf_counter() - began) * 1000)

    async def started(self: AssemblyWorker) -> None:
        await on_started(self)
        self.add_future(timeline.watch_loop())

    for cls, name, wrapper in ((Inbox, "take", taking), (Consumer, "commit", committing),
                               (AssemblyWorker, "on_started", started), (AssemblyWorker, "_end_batch", ending_batch),
                               (AssemblyWorker, "_emit", emitting), (AssemblyWorker, "_record", recording)):
        setattr(cls, name, wrapper)


def command(path: str, *args: str) -> list[str]:
    """The command line running `python -m agentstream.streams args` with the probe writing to `path`."""
    return [sys.executable, __file__, path, *args]


def main() -> None:
    path, *args = sys.argv[1:]
    sys.path[0] = os.getcwd()  # as `python -m` has it (the tree to measure), not this file's folder
    probe(Timeline(path))
    sys.argv = ["agentstream.streams", *args]
    runpy.run_module("agentstream.streams", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

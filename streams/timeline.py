"""A probe for the bench: what the worker did when, as JSON lines in the file `AGENTSTREAM_STREAMS_TIMELINE`
names (`bench.streams_assembly --timeline DIR`). Unset, every mark is one attribute test.

Marks (wall time `t`, seconds): `take` (records taken from the inbox), `batch` (a batch end: its
records, the attempts it settled, and how long settling, the decisions' acks, the trajectories'
acks and the state's write took), `gc` (a collector pass: generation, milliseconds), `commit`
(Faust's offset commit, milliseconds) and `stall` (the event loop late for a short sleep).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any

import orjson

STALL_PROBE_S = 0.005
STALL_MIN_S = 0.020
"""a sleep of STALL_PROBE_S that returned this much late is marked"""


class Timeline:
    def __init__(self, path: str | None):
        self.path = path
        self.marks: list[dict[str, Any]] = []
        self._gc_began = 0.0
        if path:
            gc.callbacks.append(self._on_gc)

    def mark(self, kind: str, **fields: Any) -> None:
        if self.path:
            self.marks.append({"t": time.time(), "kind": kind, **fields})

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.mark("gc", generation=info["generation"], ms=(time.perf_counter() - self._gc_began) * 1000,
                      collected=info["collected"])

    def write(self) -> None:
        """Append the marks so far to the file."""
        if self.path and self.marks:
            marks, self.marks = self.marks, []
            with open(self.path, "ab") as out:
                out.writelines(orjson.dumps(mark, option=orjson.OPT_NON_STR_KEYS) + b"\n" for mark in marks)

    async def watch_loop(self) -> None:
        """Mark the event loop's stalls (a short sleep returning late), and write the marks every second."""
        if not self.path:
            return
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


TIMELINE = Timeline(os.environ.get("AGENTSTREAM_STREAMS_TIMELINE"))

"""The pass over the streams worker's state that extends its due index (streams/assembly.py `look_ahead`): what it
holds the event loop, read from RocksDB, at once (the pass before) and a slice at a time (`SLICE` states, each
resumed after the last key read: `disk.ordered_keys`), in the same run.

`--states` settled sessions' states (each as a worker keeps it for late feedback: one conversation of three calls
held by their offsets, folded in-process) are written to `--partitions` databases of the disk store's options
(`--state-memory-mb`); then the pass reads each key's state by key (a bloom filter a database) and decodes it, as
the worker's table does, at once and in slices.

Then what replaced the pass: each state's due key (`assembly.due_key`, `--due-soon` of them due within the hour,
the rest in 30 days), and the index rebuilt as a recovery rebuilds it (`Assembly.restart`, run to its end): the
keys due by the horizon read, no state.

    uv run python -m bench.due_pass [--states 200000] [--partitions 4] [--state-memory-mb 64] [--slice 1000]
        [--due-soon 1000]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import rocksdict

from agentstream.schemas.codec import encode
from agentstream.streams.assembly import SLICE, Assembly, Timing, due_key
from agentstream.streams.disk import BoundedOptions, Budget, ordered_keys
from bench.report import Report
from bench.streams_state import conversation

PREFIX = b'"r:'
NOT_A_KEY = b"__offset__"


def kept_state() -> dict[str, Any]:
    """A settled session's state as a worker keeps it for --session-retention-s (its calls by offset)."""
    assembly = Assembly({}, {}, Timing())
    events = conversation(0, 1_700_000_000_000, 8)
    for offset, event in enumerate(events):
        assembly.add(event, encode(event), 0, offset)
    assembly.settle_due(events[-1].time + 3_600_000)
    (state,) = assembly.rollouts.values()
    return state


def fill(dbs: list[rocksdict.Rdict], states: int) -> int:
    """`states` copies of a kept state under keys of their own, spread over the databases; the bytes of one."""
    value = orjson.dumps(kept_state())
    for i in range(states):
        dbs[i % len(dbs)].put(orjson.dumps(f"r:session-{i:09d}"), value)
    for db in dbs:
        db.flush()
    return len(value)


def read(dbs: list[rocksdict.Rdict], keys: list[bytes]) -> int:
    """Each key's state read by key and decoded (as the table reads it); the earliest due among them."""
    first = 1 << 62
    for key in keys:
        value = next(found for db in dbs if (found := db.get(key)) is not None)
        first = min(first, orjson.loads(value)["due"])
    return first


def at_once(dbs: list[rocksdict.Rdict]) -> tuple[float, float]:
    """(wall, CPU) seconds of the pass at once."""
    began, cpu = time.perf_counter(), time.process_time()
    read(dbs, list(ordered_keys(dbs, PREFIX, None, {}, NOT_A_KEY)))
    return time.perf_counter() - began, time.process_time() - cpu


def in_slices(dbs: list[rocksdict.Rdict], limit: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each slice of a pass: the next `limit` keys after the last one read, their states."""
    took, after = [], None
    while True:
        began, cpu = time.perf_counter(), time.process_time()
        keys = list(itertools.islice(ordered_keys(dbs, PREFIX, after, {}, NOT_A_KEY), limit))
        read(dbs, keys)
        took.append((time.perf_counter() - began, time.process_time() - cpu))
        if len(keys) < limit:
            return took
        after = keys[-1]


class StoredKeys:
    """The due keys of the databases, as the worker's table lists them (`tables.DueKeys`); a rebuild writes none."""

    def __init__(self, dbs: list[rocksdict.Rdict]):
        self.dbs = dbs

    def put(self, partition: int, key: str) -> None:
        raise AssertionError("a rebuild from due keys writes none")

    drop = put

    def keys_from(self, after: str | None) -> Iterator[str]:
        start = None if after is None else orjson.dumps("d:" + after)
        for key in ordered_keys(self.dbs, b'"d:', start, {}, NOT_A_KEY):
            yield orjson.loads(key)[2:]


def key_all(dbs: list[rocksdict.Rdict], states: int, soon: int, now: int) -> None:
    """A due key for each state: the first `soon` due within the hour after `now`, the others in 30 days."""
    for i in range(states):
        due = now + (600_000 if i < soon else 30 * 24 * 3_600_000)
        dbs[i % len(dbs)].put(orjson.dumps("d:" + due_key(i % len(dbs), due, f"session-{i:09d}")), b"1")
    for db in dbs:
        db.flush()


def by_keys(dbs: list[rocksdict.Rdict], now: int) -> tuple[float, float, int, int]:
    """(wall, CPU) seconds of the index's rebuild from the due keys, the keys it read and the rollouts it indexed."""
    assembly = Assembly({}, {}, Timing(), horizon_ms=3_600_000, due_keys=StoredKeys(dbs))
    read = assembly.counts["due_index_keys_read"]
    began, cpu = time.perf_counter(), time.process_time()
    assembly.reindex(now)
    took = time.perf_counter() - began, time.process_time() - cpu
    return *took, assembly.counts["due_index_keys_read"] - read, assembly.indexed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--state-memory-mb", type=int, default=64)
    parser.add_argument("--slice", type=int, default=SLICE)
    parser.add_argument("--due-soon", type=int, default=1_000, help="states due within the hour (the open work)")
    args = parser.parse_args()
    options = BoundedOptions(Budget(args.state_memory_mb))
    with tempfile.TemporaryDirectory() as folder:
        dbs = [options.open(Path(folder) / f"assembly-{n}.db") for n in range(args.partitions)]
        size = fill(dbs, args.states)
        at_once_figures = at_once(dbs)
        slices = in_slices(dbs, args.slice)
        now = 1_700_000_000_000
        key_all(dbs, args.states, args.due_soon, now)
        keyed = by_keys(dbs, now)
    report = Report("due_pass")
    (whole, whole_cpu), walls, cpus = at_once_figures, [w for w, _ in slices], [c for _, c in slices]
    report.add(f"{args.states:,} states of {size:,} B in {args.partitions} databases: the pass at once (the loop held; "
               "wall, CPU)", f"{whole:.2f} s, {whole_cpu:.2f} s ({whole_cpu / args.states * 1e6:.1f} µs a state)")
    report.add(f"in slices of {args.slice:,}: a slice (the loop held), CPU median / max",
               f"{statistics.median(cpus) * 1000:.1f} / {max(cpus) * 1000:.1f} ms ({len(slices)} slices)",
               whole_cpu / max(cpus))
    report.add("in slices: a slice, wall median / max (with the machine's load)",
               f"{statistics.median(walls) * 1000:.1f} / {max(walls) * 1000:.1f} ms", whole / max(walls))
    report.add("in slices: the pass's CPU, all slices", f"{sum(cpus):.2f} s", sum(cpus) / whole_cpu)
    report.add(f"a recovery's rebuild of the index, the pass at once → from the due keys ({args.due_soon:,} due within "
               f"the hour): wall, CPU; states read; keys read", f"{whole:.2f} s, {whole_cpu:.2f} s → {keyed[0] * 1000:.1f} "
               f"ms, {keyed[1] * 1000:.1f} ms; {args.states:,} → 0; {keyed[2]:,} ({keyed[3]:,} indexed)",
               whole_cpu / max(keyed[1], 1e-6))
    report.details = {"states": args.states, "state_bytes": size, "at_once_s": [whole, whole_cpu],
                      "slices_s": slices, "by_keys": keyed}
    report.print("ratio: the pass at once / the longest slice; the slices' sum / the pass at once")

if __name__ == "__main__":
    main()

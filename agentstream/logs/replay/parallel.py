"""A rebuild spread over worker processes, by partition: `replay rebuild --jobs N`.

The raw topics are co-partitioned by rollout id, so each partition folds on its own (rebuild.py
keeps an `Assembly` per partition already). The partitions are dealt out to N processes; each
scans and folds its own with a `Rebuild` of them and sends what it makes through a pipe; this
process writes it to the sink. Within a partition the order is the one-process order, and the
output topic is keyed by rollout id as the one process keys it, so every output partition gets the same records in
the same order; only how partitions interleave differs, as between two runs of the live worker.

Resuming: a worker sends its `Rebuild.position()` (read positions and its partitions' open
attempts) every checkpoint interval and with its last chunk, and the items it sent since its
last position are held here until the next one covers them. (Its settled rollouts it appends to
its partitions' files itself, settled.py; the position says their lengths.) So the merged position always
matches what was handed to the sink, and it is the one-process position (a state written with
`--jobs 2` resumes with `--jobs 1` and back). The workers' counts come with their positions.

Workers reading Kafka alone fork from a fork server (multiprocessing's "forkserver"): a fresh
interpreter, started as the replay begins (`start_fork_server`), that imports this module and nothing
else runs in.
Forking this process instead would copy its libraries' threads' locks as they are: a worker forked
while the sink's librdkafka producer (or another client) runs can hang for good in its own
consumer's `close()`. Starting each worker afresh would import pydantic, the event models and
librdkafka again in every worker; the fork server imports them once, while this process plans the
range. The workers make their own Kafka consumers and event loop.
Workers that may read the Parquet archive start afresh: polars' thread pool does not survive a
fork (a forked worker can hang in its first read once this process has used polars), so a rebuild
that reads the archive runs in one process unless `--jobs` asks for more.
Into a topic, each worker writes its trajectories itself, with a librdkafka producer of its own
(`TopicShare`), keyed by rollout id as the one process writes them: nothing of them goes through
this process. Before it sends a position, the worker flushes its producer (every trajectory the
position covers delivered, or the error raised), and sends the sink's position with it; this
process saves a state only from positions so covered, with the topic's ends those flushes reached.
A run killed between a worker's write and the state's leaves trajectories past those ends, which a
resume reads back and does not write again (sinks.py: at most a repeat, never a loss). Into a
JSONL file a worker encodes the trajectories and sends the bytes (pickling the models would cost
more than encoding them); for datasets it sends the models.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import orjson

from agentstream.logs.replay.rebuild import RAW, REASONS_KEPT, Fold, Rebuild
from agentstream.logs.replay.sinks import TopicShare, TopicSink
from agentstream.logs.replay.sources import Item
from agentstream.logs.replay.state import ReplayError, int_keys
from agentstream.schemas import collector
from agentstream.schemas.codec import encode
from agentstream.schemas.errors import AgentstreamError
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import Origin

SET_COUNTS = ("open", "open_ended")
"""counts a rebuild sets at the range's close rather than adds to"""


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def reads_archive(settings: KafkaSettings, origin: Origin) -> bool:
    """Whether a rebuild may read the Parquet archive (then its workers cannot be forked: see above)."""
    return any(origin.manifest(settings.topics.name(t)) is not None for t in RAW)


def deal(partitions: list[int], jobs: int) -> list[list[int]]:
    """The partitions dealt round-robin to at most `jobs` workers (none gets none)."""
    return [part for part in (partitions[i::jobs] for i in range(max(1, jobs))) if part]


@dataclass
class Part:
    """What one worker folds, and how (everything a `Rebuild` of its partitions takes)."""

    partitions: list[int]
    settings: KafkaSettings
    ranges: dict[str, dict[int, tuple[int, int]]]
    position: dict[str, Any] | None
    fold: Fold
    interval_s: float
    """the least time between two positions sent (0: with every chunk)"""
    as_bytes: bool
    """send trajectories encoded (the sink writes bytes) rather than as models with their calls"""
    share: TopicShare | None = None
    """write the trajectories to this topic (sending none): the sink is a topic"""


def _only(ranges: dict[str, dict[int, tuple[int, int]]], position: dict[str, Any] | None,
          partitions: list[int]) -> tuple[dict[str, dict[int, tuple[int, int]]], dict[str, Any] | None]:
    """The range and position of a worker: its partitions as they are, the others empty (read to their end).

    (`scan` reads every partition of a topic it is not told to stop at, and skips the empty ranges.)
    """
    keep = set(partitions)
    ranges = {t: {p: r if p in keep else (r[1], r[1]) for p, r in ranges[t].items()} for t in RAW}
    if position is None:
        return ranges, None
    return ranges, {
        "next": {t: {p: n if p in keep else ranges[t][p][1] for p, n in int_keys(position["next"][t]).items()}
                 for t in RAW},
        "assembly": {p: a for p, a in int_keys(position["assembly"]).items() if p in keep},
        "settled": {p: n for p, n in int_keys(position.get("settled", {})).items() if p in keep},
        "reasons": []}


class ParallelRebuild:
    """The `Rebuild` source's interface (chunks, position, counts, read, remaining, reasons), by N processes.

    Its chunks are selected already (`selects`): a worker keeps what the selection wants, counting the rest.
    """

    selects = True

    def __init__(self, settings: KafkaSettings, ranges: dict[str, dict[int, tuple[int, int]]],
                 position: dict[str, Any] | None, fold: Fold, counts: Counter[str], *, jobs: int,
                 as_bytes: bool = True, checkpoint_s: float = 5.0, output: TopicSink | None = None):
        self.counts = counts
        self.closing_ms = fold.closing_ms
        partitions = sorted(ranges["rollouts"])
        groups = deal(partitions, jobs)
        self.output = output
        """the topic the workers write to themselves (None: they send what they make here)"""
        share = output.share(len(groups)) if output is not None else None
        self.parts = [Part(group, settings, *_only(ranges, position, group), fold, checkpoint_s, as_bytes, share)
                      for group in groups]
        if position:
            self.next = {t: int_keys(position["next"][t]) for t in RAW}
            self.assembly: dict[int, Any] = dict(int_keys(position["assembly"]))
            self.settled: dict[int, int] = int_keys(position.get("settled", {}))
        else:
            self.next = {t: {p: start for p, (start, _) in ranges[t].items()} for t in RAW}
            self.assembly, self.settled = {}, {}
        ends = {t: {p: end for p, (_, end) in ranges[t].items()} for t in RAW}
        self.remaining = sum(max(0, ends[t][p] - self.next[t][p]) for t in RAW for p in partitions)
        self.saved_reasons: list[str] = list(position.get("reasons", [])) if position else []
        self.worker_reasons: list[list[str]] = [[] for _ in self.parts]
        self.open_reasons: list[str] = []
        """why attempts are open at the close (last, as one process says it)"""
        self.reads = [0] * len(self.parts)
        self.applied: list[dict[str, int]] = [{} for _ in self.parts]
        """each worker's counts as far as its last position covers (added to `counts` already)"""
        self.open: list[tuple[int, int, int | None] | None] = [None for _ in self.parts]
        """each worker's open attempts at the close: (open, of which ended, when the last of those is due)"""

    @property
    def read(self) -> int:
        return sum(self.reads)

    @property
    def reasons(self) -> list[str]:
        merged = list(self.saved_reasons)
        for reasons in self.worker_reasons:
            merged += [r for r in reasons if r not in merged][:max(0, REASONS_KEPT - len(merged))]
        return merged + [r for r in self.open_reasons if r not in merged]

    def position(self) -> dict[str, Any]:
        """The one-process position: the workers' last positions merged (their open attempts as sent, in JSON)."""
        return {"next": {t: dict(self.next[t]) for t in RAW}, "assembly": dict(self.assembly),
                "settled": dict(self.settled), "reasons": self.reasons}

    # --- running the workers -----------------------------------------------------------------

    async def chunks(self) -> AsyncGenerator[list[Item], None]:
        part = self.parts[0]
        processes, readers = _start(self.parts, fork=not reads_archive(part.settings, part.fold.origin))
        pending = {asyncio.ensure_future(asyncio.to_thread(_receive, readers[i])): i for i in range(len(self.parts))}
        held: list[list[Item]] = [[] for _ in self.parts]
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                out: list[Item] = []
                for future in done:
                    index = pending.pop(future)
                    message = future.result()
                    if message is None:
                        raise ReplayError(f"the rebuild worker of partitions {self.parts[index].partitions} died "
                                          f"(exit code {processes[index].end(5)}); run the same command again to "
                                          "resume, or pass --jobs 1 to rebuild in one process")
                    kind, body = message
                    if kind == "error":
                        raise body
                    items, read, covered = body
                    self.reads[index] = read
                    held[index] += [Item(None, raw=raw, id=id_, key=key) for raw, id_, key in items] \
                        if self.parts[index].as_bytes else items
                    if covered is not None:
                        self._cover(index, covered)
                        out += held[index]
                        held[index] = []
                    if kind == "chunk":
                        pending[asyncio.ensure_future(asyncio.to_thread(_receive, readers[index]))] = index
                self._update_open()
                yield out
        finally:
            for future in pending:
                future.cancel()
            for process in processes:
                process.end(0)
            for reader in readers:
                reader.close()

    def _cover(self, index: int, covered: dict[str, Any]) -> None:
        """A worker's position and counts, as of the items it sent (or wrote to the topic and flushed) so far."""
        mine = self.parts[index].partitions
        if self.output is not None:
            self.output.covered(index, covered["sink"])
        for t in RAW:
            self.next[t].update({p: covered["next"][t][p] for p in mine})
        self.assembly.update({p: orjson.Fragment(covered["assembly"][p]) for p in mine})
        self.settled.update({p: covered["settled"][p] for p in mine})
        self.worker_reasons[index] = covered["reasons"]
        counts = covered["counts"]
        for key, value in counts.items():
            if key not in SET_COUNTS:
                self.counts[key] += value - self.applied[index].get(key, 0)
        self.applied[index] = counts
        if covered["open"] is not None:
            self.open[index] = covered["open"]

    def _update_open(self) -> None:
        """The workers' open attempts at the close, added up (as one process counts them)."""
        reported = [found for found in self.open if found is not None]
        if not reported:
            return
        self.counts["open"] = sum(opened for opened, _, _ in reported)
        self.counts["open_ended"] = sum(ended for _, ended, _ in reported)
        dues = [due for _, _, due in reported if due is not None]
        if dues:
            Rebuild.add_open_reason(self.open_reasons, self.counts["open_ended"], max(dues), self.closing_ms)


class _Process:
    """A worker, forked by the fork server (multiprocessing) or started afresh (subprocess): ended the same way."""

    def __init__(self, handle: BaseProcess | subprocess.Popen[bytes]):
        self.handle = handle

    def end(self, wait_s: float) -> int | None:
        """Its exit code, killing it if it has not exited within `wait_s`."""
        handle = self.handle
        if isinstance(handle, subprocess.Popen):
            try:
                return handle.wait(wait_s)
            except subprocess.TimeoutExpired:
                handle.kill()
                return handle.wait()
        handle.join(wait_s)
        if handle.is_alive():
            handle.kill()
            handle.join()
        return handle.exitcode


def _start(parts: list[Part], fork: bool) -> tuple[list[_Process], list[Connection]]:
    """A worker per part, and the pipe each sends through.

    A fresh one is a new interpreter running this module (not multiprocessing's spawn, which would
    run the caller's main module again in it), told its part through its stdin."""
    processes: list[_Process] = []
    readers: list[Connection] = []
    if fork:
        context = _fork_server()
        for part in parts:
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=_work, args=(writer, part, None, dict(os.environ)),
                                      name=f"rebuild-{'-'.join(map(str, part.partitions))}", daemon=True)
            process.start()
            writer.close()  # the worker's end: closed here, so its exit reads as the end of the pipe
            processes.append(_Process(process))
            readers.append(reader)
        return processes, readers
    for part in parts:
        fresh = subprocess.Popen([sys.executable, "-c", f"from {__name__} import serve; serve()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert fresh.stdin is not None and fresh.stdout is not None  # (both PIPE)
        fresh.stdin.write(pickle.dumps((part, os.getpid())))
        fresh.stdin.close()
        readers.append(Connection(os.dup(fresh.stdout.fileno()), writable=False))
        fresh.stdout.close()
        processes.append(_Process(fresh))
    return processes, readers


def start_fork_server() -> None:
    """Have the fork server start importing now, if it is not running: a rebuild calls this as it begins, so
    that the server's imports (the models, confluent_kafka, this package) overlap the plan
    and the output's setup; the workers cannot fork before they are done."""
    _fork_server()
    multiprocessing.forkserver.ensure_running()


def _fork_server() -> multiprocessing.context.ForkServerContext:
    """The context whose workers fork from the fork server (see the module's docstring)."""
    context = multiprocessing.get_context("forkserver")
    # what the server imports once, before it forks any worker (once it runs, it keeps what it imported).
    # Each worker still imports the command's main script as `__mp_main__` (multiprocessing's way; its
    # "__main__" preload is never given the script's path): `agentstream`'s imports only agentstream.cli,
    # and a script of a user's that calls `replay` with more than one job needs the `if __name__ ==
    # "__main__":` guard, as any program using multiprocessing's fork server or spawn
    context.set_forkserver_preload([__name__])
    return context


def _receive(reader: Connection) -> tuple[str, Any] | None:
    """The worker's next message (unpickled here, off the event loop), or None: it ended without one."""
    try:
        body = reader.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        message: tuple[str, Any] = pickle.loads(body)
    except Exception as exc:
        return "error", RuntimeError(f"a rebuild worker sent what cannot be read back ({exc})")
    return message


# --- in the worker process -------------------------------------------------------------------


def _work(writer: Connection, part: Part, parent: int | None, environ: dict[str, str] | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the workers
    _die_with(parent)
    if environ is not None:
        _take_environment(environ)
    # a worker is a process of its own, forked from a fresh interpreter with the default thresholds (a young
    # collection every 700 allocations), which would scan the fold's many short-lived objects over and over
    collector.relax()
    try:
        asyncio.run(_fold(writer, part))
    except BaseException as exc:
        error = exc if isinstance(exc, AgentstreamError) else RuntimeError(  # (those say the fix themselves)
            f"the rebuild worker of partitions {part.partitions} failed:\n{traceback.format_exc()}")
        try:
            writer.send_bytes(pickle.dumps(("error", error)))
        except Exception:
            writer.send_bytes(pickle.dumps(("error", RuntimeError(str(error)))))
        os._exit(1)
    writer.close()


def _take_environment(environ: dict[str, str]) -> None:
    """The one place a worker writes its environment: a worker forked by the fork server has the server's
    environment from when the server started, and multiprocessing has no `env=` for its processes (it
    carries the working directory and sys.path over, not this). A reward function may read the
    environment, so the worker takes the rebuild's, as it is now."""
    os.environ.clear()
    os.environ.update(environ)


def _die_with(parent: int | None) -> None:
    """SIGKILL this worker when its parent dies (a replay killed mid-run leaves none behind; Linux).

    A worker forked by the fork server (`parent` None) is that server's child: the server ends when
    the replay's process does, and so the worker."""
    parent = os.getppid() if parent is None else parent
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


async def _fold(writer: Connection, part: Part) -> None:
    counts: Counter[str] = Counter()
    rebuild = Rebuild(part.settings, part.ranges, part.position, part.fold, counts, partitions=part.partitions)
    rebuild.explain_open = False
    sink = None
    if part.share is not None:
        sink = TopicSink(part.settings, part.share.base, part.share.partitions)
        sink.resume(part.share)
    interval, last = part.interval_s, time.monotonic()
    try:
        async for chunk in rebuild.chunks():
            chosen: list[Any] = [item for item in chunk if part.fold.selection.wants(item.event)]
            counts["not_selected"] += len(chunk) - len(chosen)
            if sink is not None:
                await sink.write(chosen)
                chosen = []
            elif part.as_bytes:  # (tuples: a third of the pickling of `Item`s)
                chosen = [(encode(item.trajectory), item.trajectory.id, item.trajectory.key) for item in chosen]
            covered = None
            if time.monotonic() - last >= interval:  # between chunks, as the one-process replay checkpoints
                begun = time.monotonic()
                covered = await _covered(rebuild, counts, part.partitions, sink)
                # a large state (many open attempts) is sent less often
                interval = max(part.interval_s, 9 * (time.monotonic() - begun)) if part.interval_s else 0
                last = time.monotonic()
            _send(writer, "chunk", (chosen, rebuild.read, covered))
        _send(writer, "end", ([], rebuild.read, await _covered(rebuild, counts, part.partitions, sink)))
    finally:
        if sink is not None:
            await sink.close()


async def _covered(rebuild: Rebuild, counts: Counter[str], partitions: list[int],
                   sink: TopicSink | None) -> dict[str, Any]:
    """The position and counts as of the chunks sent so far; each partition's open attempts as JSON; and where
    the worker writes to the topic itself, that sink's position once everything written so far is delivered."""
    written = await sink.commit() if sink is not None else None
    position = rebuild.position()
    return {"next": position["next"], "reasons": position["reasons"], "counts": dict(counts), "sink": written,
            "assembly": {p: orjson.dumps(state) for p, state in position["assembly"].items() if p in partitions},
            "settled": position["settled"],
            "open": (counts["open"], counts["open_ended"], rebuild.open_due) if "open" in counts else None}


def _send(writer: Connection, kind: str, body: Any) -> None:
    writer.send_bytes(pickle.dumps((kind, body), protocol=pickle.HIGHEST_PROTOCOL))


def serve() -> None:
    """A worker started afresh (see `_start`): its part from stdin, frames to stdout."""
    part, parent = pickle.load(sys.stdin.buffer)
    frames = os.dup(1)
    os.dup2(2, 1)  # whatever prints goes to stderr: stdout carries the frames
    _work(Connection(frames, readable=False), part, parent)

"""A replay: a range of the log, through a source and a selection, into a sink, resumable.

    source (a trajectories topic, or a rebuild from the raw topics) ─▶ selection ─▶ sink

The first run pins the range as offsets and saves a state file. From then on, every checkpoint
makes the sink's output durable and then saves the source's position with it, so a run killed at
any point (SIGKILL included) is resumed by running the same command again, and the range ends up
in the output exactly once.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agentstream.logs.replay import settled
from agentstream.logs.replay.parallel import ParallelRebuild, default_jobs, reads_archive, start_fork_server
from agentstream.logs.replay.rebuild import RAW, Fold, Rebuild, RebuildSpec
from agentstream.logs.replay.selection import Selection
from agentstream.logs.replay.sinks import JsonlSink, ParquetSink, Sink, TopicSink
from agentstream.logs.replay.sources import Item, Source, StoredTrajectories
from agentstream.logs.replay.state import ReplayError, ReplayState, int_keys
from agentstream.schemas import collector
from agentstream.schemas.ids import now_ms
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import KAFKA, Bounds, Origin, parse_offsets, parse_time, resolve
from agentstream.streams import rewards

SINKS = ("topic", "events", "chat", "parquet")
"""topic: trajectory events to a new topic; events: the same, as JSONL (the trainer's offline file);
chat: dataset rows as JSONL; parquet: dataset rows as Parquet"""


@dataclass(frozen=True)
class RangeSpec:
    """The range as the operator wrote it (ages like `10m` are resolved once, at the first run)."""

    since: str | None = None
    until: str | None = None
    from_offsets: str | None = None
    to_offsets: str | None = None


@dataclass(frozen=True)
class Job:
    source: str
    """"raw" (rebuild from rollouts, calls and rewards) or the base name of a trajectories topic"""
    sink: str
    target: str
    """the output topic's base name (sink "topic") or the output file"""
    range: RangeSpec = RangeSpec()
    rollouts: frozenset[str] = frozenset()
    versions: frozenset[int] = frozenset()
    rebuild: RebuildSpec = field(default_factory=RebuildSpec)

    @property
    def raw(self) -> bool:
        return self.source == "raw"

    def signature(self) -> dict[str, Any]:
        """What must not change between a run and its resume, as JSON would give it back."""
        body = asdict(self)
        body["rollouts"], body["versions"] = sorted(self.rollouts), sorted(self.versions)
        if not self.raw:
            del body["rebuild"]
        signature: dict[str, Any] = orjson.loads(orjson.dumps(body))
        return signature

    def check(self) -> None:
        if self.sink not in SINKS:
            raise ReplayError(f"unknown output {self.sink!r}: use one of {', '.join(SINKS)}")
        if self.sink == "topic" and not self.raw:
            raise ReplayError("a rebuild into a topic reads the raw events: use --from raw")
        if self.rebuild.reward_fn and not self.raw:
            raise ReplayError(f"a new reward function rescores the raw events, not the stored trajectories of "
                              f"{self.source!r}: use --from raw")
        if self.raw and (self.range.from_offsets or self.range.to_offsets):
            raise ReplayError("offsets name positions in one topic, and a rebuild reads three (rollouts, calls, "
                              "rewards): bound it by time (--since/--until), or select --rollouts/--versions")
        for name in filter(None, (self.rebuild.reward_fn, self.raw and self.rebuild.reward_policy)):
            try:
                rewards.load(str(name))
            except rewards.RewardError as exc:
                raise ReplayError(str(exc)) from None


@dataclass
class Options:
    """How to run, none of which changes the output."""

    state: Path
    restart: bool = False
    checkpoint_s: float = 5.0
    """the least time between checkpoints (more where saving the state takes long); 0: after every chunk"""
    batch_size: int = 5000
    origin: Origin = KAFKA
    """where the range is read from: Kafka, the Parquet archive, or both (the same records either way)"""
    jobs: int = 0
    """processes a rebuild folds in, each taking some of the partitions (parallel.py); 0: one per core, or one
    where the range left is small (`SMALL_RANGE`) or read from the archive"""


@dataclass
class Progress:
    remaining: int
    """records of the range this run reads"""
    read: int = 0
    written: int = 0
    """trajectories in the output, over every run"""


@dataclass
class Summary:
    written: int
    counts: dict[str, int]
    reasons: list[str] = field(default_factory=list)
    resumed: bool = False
    already_done: bool = False
    read: int = 0
    seconds: float = 0.0


def default_state(settings: KafkaSettings, job: Job) -> Path:
    if job.sink == "topic":
        return Path("runs") / "replay" / f"{settings.topics.name(job.target)}.state.json"
    return Path(f"{job.target}.replay-state.json")


async def replay(settings: KafkaSettings, job: Job, options: Options,
                 on_progress: Callable[[Progress], None] | None = None) -> Summary:
    job.check()
    started = time.monotonic()
    state = _resume_state(job, options)
    resumed = state is not None and state.source is not None
    if state is None:
        state = await _plan(settings, job, options.origin)
    if job.raw and not state.done and _jobs(settings, options, state) > 1 \
            and not reads_archive(settings, options.origin):
        start_fork_server()  # (its imports overlap the sink's setup)
    sink = _sink(settings, job, state)
    if state.done:
        if isinstance(sink, ParquetSink):
            sink.cleanup()
        shutil.rmtree(settled.folder(options.state), ignore_errors=True)  # (left where a run died just after)
        return Summary(state.sink.get("written", 0), state.counts, already_done=True)
    if not state.sink:
        if options.restart:
            sink.discard()
        state.sink = await sink.create()
        state.save(options.state)  # the pinned range, before any output
    counts = Counter(state.counts)
    with collector.relaxed():  # a rebuild decodes and builds objects by the thousand
        try:
            await sink.open(state.sink)
            source = _source(settings, job, state, counts, options, sink)
            await Copy(state, source, sink, counts, options).run(_selection(job, state), on_progress)
        finally:
            await sink.close()
    if isinstance(sink, ParquetSink):
        sink.cleanup()
    return Summary(sink.written, dict(counts), list(getattr(source, "reasons", [])), resumed=resumed,
                   read=source.read, seconds=time.monotonic() - started)


def _resume_state(job: Job, options: Options) -> ReplayState | None:
    """The saved state of this replay, unless `--restart`; a state of another replay is refused."""
    state = ReplayState.load(options.state) if not options.restart else None
    if state is not None and state.job != job.signature():
        changed = sorted(k for k in set(state.job) | set(job.signature()) if state.job.get(k) != job.signature().get(k))
        raise ReplayError(f"the resume state {options.state} belongs to another replay (it differs in: "
                          f"{', '.join(changed)}); run that one again to finish it, pass --state elsewhere, "
                          "or --restart to start over")
    return state


@dataclass
class Copy:
    """A run's loop: the source's chunks, the selected records to the sink, a checkpoint now and then."""

    state: ReplayState
    source: Source
    sink: Sink
    counts: Counter[str]
    options: Options

    async def run(self, selection: Selection, on_progress: Callable[[Progress], None] | None) -> None:
        source, sink, options = self.source, self.sink, self.options
        progress = Progress(remaining=source.remaining, written=sink.written)
        pause = options.checkpoint_s
        last = time.monotonic()
        # closed here whatever ends the loop: a rebuild's scans, workers and paused collector end with it, not
        # once the event loop gets round to finalizing the suspended generator
        async with aclosing(source.chunks()) as chunks:
            async for items in chunks:
                await sink.write(self.selected(items, selection))
                progress.read, progress.written = source.read, sink.written
                if on_progress:
                    on_progress(progress)
                if time.monotonic() - last >= pause:
                    # a rebuild's state holds the open attempts (the settled ones are in files of their own:
                    # settled.py): where it is large, checkpoint less often, at most a tenth of the time
                    took = await self.checkpoint()
                    pause = max(options.checkpoint_s, 9 * took) if options.checkpoint_s else 0
                    last = time.monotonic()
        await self.checkpoint()
        await sink.finish()
        self.state.done, self.state.source = True, None  # a finished replay needs no position: keep the file small
        self.state.save(options.state)
        shutil.rmtree(settled.folder(options.state), ignore_errors=True)  # (a rebuild's settled rollouts)

    def selected(self, items: list[Item], selection: Selection) -> list[Item]:
        if getattr(self.source, "selects", False):  # (its workers did, and counted what they left out)
            return items
        chosen = [item for item in items if selection.wants(item.event)]
        self.counts["not_selected"] += len(items) - len(chosen)
        return chosen

    async def checkpoint(self) -> float:
        """Output first, then the state; returns how long it took."""
        begun = time.monotonic()
        self.state.sink = await self.sink.commit()
        self.state.source, self.state.counts = self.source.position(), dict(self.counts)
        self.state.save(self.options.state)
        return time.monotonic() - begun


async def _plan(settings: KafkaSettings, job: Job, origin: Origin = KAFKA) -> ReplayState:
    """Resolve the range to offsets, now, once."""
    now = now_ms()
    r = job.range
    try:
        since = parse_time(r.since, now) if r.since else None
        until = parse_time(r.until, now) if r.until else None
        bounds = Bounds(since_ms=since, until_ms=until,
                        start_offsets=parse_offsets(r.from_offsets) if r.from_offsets else {},
                        end_offsets=parse_offsets(r.to_offsets) if r.to_offsets else {})
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    try:
        if not job.raw:
            ranges = {job.source: await resolve(settings, settings.topics.name(job.source), bounds, origin)}
            return ReplayState(job.signature(), ranges)
        # an attempt running across `since` began earlier: read its beginning too, leave it out (Selection)
        read_from = since - job.rebuild.lookback_ms if since is not None else None
        # the three at once: each waits on the broker for metadata and offsets
        found = await asyncio.gather(*(resolve(settings, settings.topics.name(t), Bounds(since_ms=read_from,
                                                                                         until_ms=until), origin)
                                       for t in RAW))
        ranges = dict(zip(RAW, found))
    except LookupError as exc:
        raise ReplayError(str(exc)) from None
    counts = {t: len(parts) for t, parts in ranges.items()}
    if len(set(counts.values())) > 1:
        raise ReplayError(f"the raw topics have different partition counts ({counts}): a rollout's events are not "
                          "in one partition, so they cannot be joined; recreate the topics with one count")
    closing = min(until, now) if until is not None else now
    return ReplayState(job.signature(), ranges, plan={"closing_ms": closing, "started_from_ms": since})


def _selection(job: Job, state: ReplayState) -> Selection:
    return Selection(job.rollouts, job.versions, state.plan.get("started_from_ms"))


def _sink(settings: KafkaSettings, job: Job, state: ReplayState) -> Sink:
    if job.sink == "topic":
        return TopicSink(settings, job.target, len(state.ranges["rollouts"]))
    path = Path(job.target)
    if job.sink == "parquet":
        return ParquetSink(path)
    return JsonlSink.events(path) if job.sink == "events" else JsonlSink.chat(path)


SMALL_RANGE = 25_000
"""raw records left to read below which a rebuild folds in one process unless `--jobs` says otherwise: below it,
the fork server's start and a second set of scans cost more than a second core gains"""


def _jobs(settings: KafkaSettings, options: Options, state: ReplayState) -> int:
    """The processes a rebuild folds in: `--jobs`, else one per core; one where it may read the archive (its
    workers cannot fork from the fork server, and a fresh one imports everything again: asked for only) or where
    the range left is small."""
    if options.jobs:
        return options.jobs
    return 1 if reads_archive(settings, options.origin) or _left(state) < SMALL_RANGE else default_jobs()


def _left(state: ReplayState) -> int:
    """The raw records a rebuild has left to read."""
    position = {t: int_keys(state.source["next"][t]) for t in RAW} if state.source else None
    return sum(end - (position[t].get(p, start) if position else start)
               for t in RAW for p, (start, end) in state.ranges[t].items())


def _source(settings: KafkaSettings, job: Job, state: ReplayState, counts: Counter[str], options: Options,
            sink: Sink) -> Source:
    if not job.raw:
        return StoredTrajectories(settings, settings.topics.name(job.source), state.ranges[job.source], state.source,
                                  counts, options.batch_size, options.origin, selection=_selection(job, state),
                                  rows=job.sink in ("chat", "parquet"))
    jobs = _jobs(settings, options, state)
    if jobs < 0:
        raise ReplayError(f"--jobs {options.jobs}: give a number of processes (1 or more), or 0 for one per core")
    fold = Fold(job.rebuild, state.plan["closing_ms"], _selection(job, state), settled.folder(options.state),
                with_calls=job.sink in ("chat", "parquet"), batch_size=options.batch_size, origin=options.origin)
    if jobs > 1 and len(state.ranges["rollouts"]) > 1:
        # into a topic, the workers write it themselves (parallel.py)
        return ParallelRebuild(settings, state.ranges, state.source, fold, counts, jobs=jobs,
                               checkpoint_s=options.checkpoint_s, as_bytes=job.sink in ("topic", "events"),
                               output=sink if isinstance(sink, TopicSink) else None)
    return Rebuild(settings, state.ranges, state.source, fold, counts)

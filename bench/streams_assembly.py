"""Streams assembly: events per second one worker assembles, and the delay from a rollout's finish
event to its trajectory (p50, p99).

Against a real broker (a throwaway local one, or KAFKA_BOOTSTRAP_SERVERS) and a real
`python -m agentstream.streams worker` process, on a fresh topic prefix, in one run:

1. Throughput. N rollouts (queued, two calls with prompts of a few hundred tokens, reward,
   finished; event times an hour ago, as when a worker catches up after a restart) are published
   before the worker starts. The worker's rate is its events over the time from the first event it
   handled (the timestamp of its first table changelog record) to its last trajectory (that
   record's timestamp); the time from spawning the process is reported too. Baselines, same run:
   a plain consumer (`schemas.kafka.make_consumer`) reading and decoding the same three topics
   end to end, and the fold alone, in-process (`Assembly` over dicts: decode, add, settle,
   record), an upper bound.
2. Latency. With the worker caught up, rollouts are published live at a steady rate by a load
   generator process of its own (`bench.live_load`: librdkafka, a rollout's events produced at its
   time without waiting for acks; a few percent of a core at 5,000 events/s); for each rollout, the
   time from the broker's ack of its finish event reaching the generator to its trajectory being
   read by the generator's consumer, and that minus the worker's `--settle-s`, which it waits after
   a finish by design. Baseline, at the same time, on the same broker, producer and consumer: one
   record produced and consumed. The CPU shares of the worker and the generator are reported.

Each worker gets a broker of its own, fresh (unless `--one-broker`, or KAFKA_BOOTSTRAP_SERVERS),
warmed up first by `--warm-up-s` of the live load with a throwaway worker reading it (a fresh
broker's JVM costs about twice the CPU in its first seconds under load, and again when a worker's
requests first come).
With `--baseline REV` the worker of commit REV (its tree checked out by `git archive` into a
temporary folder, run with this environment) goes through both phases first, on a prefix of its
own, with the same events: before and after, in the same run. Events are written in the schema
version that worker reads (a version 1 worker gets them without the fields version 2 added).

    uv run python -m bench.streams_assembly [--rollouts 1500] [--rate 20] [--seconds 25] [--settle-s 1]
                                            [--baseline REV] [--one-broker]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import agentstream.schemas as s
from agentstream.schemas.codec import decode, encode
from agentstream.schemas.kafka import KafkaSettings, ensure_topics, make_consumer, make_producer, partitions_of
from agentstream.schemas.topics import TopicSpec, topic_specs
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import free_port, spawn, stop_pid, tail
from agentstream.streams.assembly import Assembly, Timing
from agentstream.streams.settings import StreamsSettings
from agentstream.streams.worker import ASSEMBLED
from bench import streams_timeline
from bench.report import Report
from samples.rollouts import COMPLETION, EVENTS_PER_ROLLOUT, FOLLOW_UP, PROMPT, history

console = Console()
ROOT = Path(__file__).parent.parent
PING = "bench-ping"


# --- helpers --------------------------------------------------------------------------------------

@contextlib.contextmanager
def kafka_broker(workdir: Path) -> Iterator[tuple[str, int | None]]:
    """(bootstrap servers, the broker's process id when it is this machine's and ours)."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"], None
        return
    broker = LocalKafka(workdir, default_port=None)
    with console.status("Starting Kafka…"):
        state = broker.start(say=lambda message: None)
    try:
        yield state.url, state.pid
    finally:
        broker.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class CpuWatch:
    """Samples of a process's scheduler times (Linux): when, seconds on a CPU, seconds runnable but
    waiting for one; whatever else passes, it was blocked (on the network: acks, fetches) or idle."""

    def __init__(self, pid: int):
        self.pid = pid
        self.samples: list[tuple[float, float, float]] = []

    def sample(self) -> None:
        run = wait = 0
        try:
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    on_cpu, queued, _ = (task / "schedstat").read_text().split()
                    run, wait = run + int(on_cpu), wait + int(queued)
        except OSError:
            return  # not Linux, or the process is gone
        self.samples.append((time.time(), run / 1e9, wait / 1e9))

    def between(self, start: float, end: float) -> dict | None:
        """Shares of the wall time from `start` to `end` (the nearest samples) and CPU seconds."""
        if len(self.samples) < 2:
            return None
        first = min(self.samples, key=lambda sample: abs(sample[0] - start))
        last = min(self.samples, key=lambda sample: abs(sample[0] - end))
        wall = last[0] - first[0]
        if wall <= 0:
            return None
        run, wait = last[1] - first[1], last[2] - first[2]
        return {"wall_s": wall, "cpu_s": run, "on_cpu": run / wall, "waiting_for_cpu": wait / wall,
                "blocked_or_idle": max(0.0, 1 - (run + wait) / wall)}


def cpu_pressure() -> float | None:
    """The share of the last 10 s in which some task waited for a CPU (Linux PSI), or None."""
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[1].removeprefix("avg10=")) / 100
    except (OSError, IndexError, ValueError):
        return None


def progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


async def assigned_consumer(kafka: KafkaSettings, topics: list[str], at_end: bool):
    """A consumer without a group, assigned every partition of `topics`, at their beginning or end."""
    consumer = make_consumer(kafka, group_id=None)
    await consumer.start()
    partitions = [tp for topic in topics for tp in await partitions_of(kafka, topic)]
    consumer.assign(partitions)
    if at_end:
        await consumer.seek_to_end(*partitions)
        for tp in partitions:  # resolve the positions now, not at the first fetch
            await consumer.position(tp)
    else:
        await consumer.seek_to_beginning(*partitions)
    return consumer, partitions


# --- baselines ------------------------------------------------------------------------------------

async def read_and_decode(kafka: KafkaSettings) -> tuple[int, float]:
    """(events, seconds): a plain consumer reading and decoding the assembled topics to their end."""
    consumer, partitions = await assigned_consumer(kafka, [kafka.topics.name(base) for base in ASSEMBLED], False)
    try:
        ends = await consumer.end_offsets(partitions)
        left = {tp for tp in partitions if ends[tp] > 0}
        count = 0
        began = time.perf_counter()
        while left:
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                for record in records:
                    decode(record.value)
                count += len(records)
                if records and records[-1].offset + 1 >= ends[tp]:
                    left.discard(tp)
        return count, time.perf_counter() - began
    finally:
        await consumer.stop()


def fold(raws: list[bytes], timing: Timing, decoded: list[s.Event] | None = None) -> tuple[float, int]:
    """(seconds, trajectories): the assembly alone over dicts; `decoded` skips decoding."""
    assembly = Assembly({}, {}, timing, "bench")
    began = time.perf_counter()
    latest = 0
    for n, raw in enumerate(raws):
        event = decoded[n] if decoded else decode(raw)
        assembly.add(event, raw, 0)
        latest = max(latest, event.time)
    trajectories = 0
    for rollout_id in assembly.due(latest + timing.settle_ms):
        settled = assembly.settle(rollout_id, latest + timing.settle_ms)
        assembly.record(settled)
        trajectories += len(settled.trajectories)
    return time.perf_counter() - began, trajectories


# --- the worker -----------------------------------------------------------------------------------

class Worker:
    """`python -m agentstream.streams worker` as a process of its own."""

    def __init__(self, kafka: KafkaSettings, workdir: Path, settle_s: float, tick_s: float, root: Path = ROOT,
                 timeline: Path | None = None):
        self.settings = StreamsSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                                        settle_s=settle_s, tick_s=tick_s)
        self.port = free_port()
        self.root = root
        self.log = workdir / f"worker-{kafka.topic_prefix.rstrip('.')}.log"
        args = ["worker", "--bootstrap-servers", kafka.bootstrap_servers,
                "--topic-prefix", kafka.topic_prefix, "--web-port", str(self.port),
                "--data-dir", str(workdir / f"streams-{kafka.topic_prefix.rstrip('.')}"), "--settle-s", str(settle_s), "--tick-s", str(tick_s),
                "--log-level", "warning"]
        self.timeline = timeline
        """where the worker's probe (bench/streams_timeline.py) writes, when asked for"""
        self.cmd = (streams_timeline.command(str(timeline), *args) if timeline
                    else [sys.executable, "-m", "agentstream.streams", *args])
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = spawn(self.cmd, self.log, cwd=self.root)

    def check(self) -> None:
        if self.process.poll() is not None:
            raise SystemExit(f"the streams worker exited ({self.process.returncode}); "
                             f"log ({self.log}):\n{tail(self.log)}")

    def analytics(self) -> dict | None:
        try:
            response = httpx.get(f"http://127.0.0.1:{self.port}/analytics", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def stop(self) -> None:
        if self.process is not None:
            stop_pid(self.process.pid, grace=30)

    @property
    def changelog(self) -> str:
        """The topic of the table every handled event writes to (its record times say when each was handled)."""
        return f"{self.settings.group_id}-assembly-changelog"


async def first_timestamp(kafka: KafkaSettings, topic: str) -> int:
    """The smallest record timestamp (ms) in `topic`."""
    consumer, partitions = await assigned_consumer(kafka, [topic], False)
    try:
        ends = await consumer.end_offsets(partitions)
        first = []
        for tp in partitions:
            if ends[tp]:
                record = (await consumer.getmany(tp, timeout_ms=5000, max_records=1)).get(tp)
                first += [record[0].timestamp] if record else []
        return min(first)
    finally:
        await consumer.stop()


async def catch_up(kafka: KafkaSettings, worker: Worker, rollouts: int, timeout: float) -> dict:
    """Start the worker on the published history; times until every rollout has its trajectory."""
    consumer, _ = await assigned_consumer(kafka, [kafka.topics.trajectories], False)
    seen: dict[str, int] = {}
    copies = 0
    try:
        with progress() as bar:
            task = bar.add_task("worker catching up: trajectories", total=rollouts)
            spawned = time.time()
            worker.start()
            watch = CpuWatch(worker.process.pid)
            deadline = time.monotonic() + timeout
            while len(seen) < rollouts:
                worker.check()
                if time.monotonic() > deadline:
                    raise SystemExit(f"{len(seen)}/{rollouts} trajectories after {timeout:.0f} s; log: {worker.log}")
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    for record in records:
                        copies += 1
                        seen.setdefault(record.key.decode(), record.timestamp)
                bar.update(task, completed=len(seen))
                watch.sample()
            done = time.time()
    finally:
        await consumer.stop()
    first_handled = await first_timestamp(kafka, worker.changelog)
    last_trajectory = max(seen.values())
    return {"spawned": spawned, "done": done, "first_handled_ms": first_handled, "last_trajectory_ms": last_trajectory,
            "processing_s": (last_trajectory - first_handled) / 1000, "from_spawn_s": done - spawned,
            "startup_s": first_handled / 1000 - spawned, "trajectory_records": copies,
            "worker_cpu": watch.between(first_handled / 1000, last_trajectory / 1000)}


# --- latency --------------------------------------------------------------------------------------

def live_load(kafka: KafkaSettings, args: argparse.Namespace, out: Path, log: Path, schema_version: int,
              seconds: float, wait_s: float) -> subprocess.Popen:
    """`bench.live_load` started: live rollouts at `args.rate`/s on `kafka`'s topics for `seconds`."""
    cmd = [sys.executable, "-m", "bench.live_load", "--bootstrap-servers", kafka.bootstrap_servers,
           "--topic-prefix", kafka.topic_prefix, "--ping-topic", kafka.topics.name(PING),
           "--schema-version", str(schema_version), "--rate", str(args.rate), "--seconds", str(seconds),
           "--ping-rate", str(args.ping_rate), "--wait-s", str(wait_s), "--out", str(out)]
    return spawn(cmd, log, cwd=ROOT)


async def warm_up(bootstrap: str, args: argparse.Namespace, workdir: Path) -> None:
    """The live load on throwaway topics of a fresh broker, with a throwaway worker (this tree's)
    reading them: a broker's first seconds under load cost it about twice the CPU of later ones (the
    JVM compiling; measured 0.65 → 0.24-0.29 of a core at 5,000 events/s with the load alone), which
    would land on the worker measured first; and the worker's own requests (its group, changelog
    batches, trajectories) take the broker's compiler another 20-30 s (0.18-0.26 of a core in the
    first 20 s of a worker's live load after a warm-up without one), unless a worker was there."""
    kafka = await fresh_topics(bootstrap)
    name = kafka.topic_prefix.rstrip(".")
    worker = Worker(kafka, workdir, args.settle_s, args.tick_s) if not args.warm_up_without_worker else None
    generator = live_load(kafka, args, workdir / f"warm-{name}.json", workdir / f"warm-{name}.log",
                          s.SCHEMA_VERSION, args.warm_up_s, 0)
    try:
        if worker:
            worker.start()
        with console.status(f"warming the broker up: the live load for {args.warm_up_s:g} s"
                            f"{', a worker reading it' if worker else ', no worker'}…"):
            while generator.poll() is None:
                await asyncio.sleep(0.25)
    finally:
        if worker:
            worker.stop()


async def live_delays(kafka: KafkaSettings, worker: Worker, args: argparse.Namespace, workdir: Path,
                      schema_version: int, broker_pid: int | None) -> dict:
    """Live rollouts at `args.rate`/s for `args.seconds`, and pings at `args.ping_rate`/s, from a load
    generator process of its own (`bench.live_load`); delays in seconds, CPU of the worker and of the
    generator while publishing."""
    out = workdir / f"live-{kafka.topic_prefix.rstrip('.')}.json"
    log = workdir / f"live-{kafka.topic_prefix.rstrip('.')}.log"
    generator = live_load(kafka, args, out, log, schema_version, args.seconds, args.settle_s + 30)
    watches = CpuWatch(worker.process.pid), CpuWatch(generator.pid), CpuWatch(broker_pid or -1)
    try:
        with console.status(f"live rollouts at {args.rate:g}/s for {args.seconds:g} s (bench.live_load)…"):
            while generator.poll() is None:
                worker.check()
                for watch in watches:
                    watch.sample()
                await asyncio.sleep(0.25)
    finally:
        if generator.poll() is None:
            stop_pid(generator.pid, grace=5)
    if generator.returncode != 0 or not out.exists():
        raise SystemExit(f"the load generator failed ({generator.returncode}); log ({log}):\n{tail(log)}")
    live = orjson.loads(out.read_bytes())
    if worker.timeline:  # beside the worker's timeline: when each finish was acked and its trajectory read
        shutil.copy(out, worker.timeline.with_name(worker.timeline.stem.replace("worker-", "live-") + ".json"))
    if live["failures"]:
        raise SystemExit(f"the load generator's deliveries failed: {live['failures']}")
    acked, read = live["acked"], live["read"]
    missing = [rid for rid in acked if rid not in read]
    if missing:
        raise SystemExit(f"{len(missing)}/{len(acked)} live trajectories not read (none came for "
                         f"{args.settle_s + 30:g} s); log: {worker.log}")
    order = sorted(acked, key=acked.get)
    began, ended = live["publishing"]
    drained = max(at for at, _ in read.values())  # every event published was handled by then
    handled = {name: watch.between(began, drained) for name, watch in zip(("worker", "broker"), watches[::2])}
    return {"cpu_per_event_s": {name: cpu and cpu["cpu_s"] / (EVENTS_PER_ROLLOUT * live["produced"])
                                for name, cpu in handled.items()},
            "generator_cpu_per_event_s": live["cpu_s"] / (EVENTS_PER_ROLLOUT * live["produced"]),
            "delays": [read[rid][0] - acked[rid] for rid in order],
            "written": [read[rid][1] / 1000 - acked[rid] for rid in order],
            "round_trips": live["round_trips"], "worker_cpu": watches[0].between(began, ended),
            "generator_cpu": watches[1].between(began, ended), "broker_cpu": watches[2].between(began, ended), "generator_lag_p99_s": live["lag_p99_s"],
            "generator_own_cpu_share": live["cpu_share"], "events_per_s": EVENTS_PER_ROLLOUT * live["produced"]
            / (ended - began), "window": (began, drained), "produced_events": EVENTS_PER_ROLLOUT * live["produced"],
            "generator_requests": live.get("requests")}


# --- the run --------------------------------------------------------------------------------------

def written_for(version: int) -> Callable[[s.Event], bytes]:
    """How events are encoded for a worker that reads schema `version` (this one's, or 1)."""
    if version >= s.SCHEMA_VERSION:
        return encode

    def as_version_1(event: s.Event) -> bytes:
        obj = orjson.loads(encode(event))
        obj["schema_version"] = version
        obj["data"].pop("retry_count", None)  # added in version 2
        return orjson.dumps(obj)

    return as_version_1


def checkout(rev: str, into: Path) -> tuple[Path, int]:
    """The tree of commit `rev` in `into` (git archive), and the schema version its code reads."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    version = re.search(r"^SCHEMA_VERSION = (\d+)", (into / "schemas" / "events.py").read_text(), re.MULTILINE)
    return into, int(version.group(1))


async def fresh_topics(bootstrap: str, partitions: int | None = None) -> KafkaSettings:
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench-streams-{uuid.uuid4().hex[:8]}.")
    report = await ensure_topics(kafka, [*topic_specs(kafka.partitions),
                                         TopicSpec(PING, 1, retention_ms=3_600_000, key="none")])
    assert report.ok, report.mismatches
    return kafka


async def measure_worker(args: argparse.Namespace, workdir: Path, kafka: KafkaSettings, events: list[s.Event],
                         root: Path, version: int, label: str, broker_pid: int | None) -> dict:
    """One worker (this tree's, or a baseline's, reading schema `version`) through both phases, on
    topics of its own."""
    written = written_for(version)
    with console.status(f"[{label}] publishing {len(events)} events…"):
        producer = make_producer(kafka, linger_ms=20)
        await producer.start()
        try:
            await asyncio.gather(*[await producer.send(kafka.topics.name(event.topic), written(event), key=event.key)
                                   for event in events])
        finally:
            await producer.stop()
    with console.status(f"[{label}] baseline: a plain consumer reading and decoding the three topics…"):
        read, read_s = await read_and_decode(kafka)
    assert read == len(events), (read, len(events))
    out: dict = {"consumer_events_per_s": read / read_s}
    timeline = args.timeline / f"worker-{label.split(':')[0]}.jsonl" if args.timeline else None
    worker = Worker(kafka, workdir, args.settle_s, args.tick_s, root, timeline)
    try:
        caught = await catch_up(kafka, worker, args.rollouts, timeout=args.timeout)
        out["catch_up"] = caught
        out["worker_events_per_s"] = len(events) / caught["processing_s"]
        out["worker_events_per_s_from_spawn"] = len(events) / caught["from_spawn_s"]
        console.print(f"[{label}] worker: {out['worker_events_per_s']:,.0f} events/s over {caught['processing_s']:.1f} s "
                      f"(first event handled {caught['startup_s']:.1f} s after spawning); plain consumer "
                      f"{out['consumer_events_per_s']:,.0f} events/s")
        view = worker.analytics() or {}
        out["worker_counts"] = view.get("assembly", {})
        await asyncio.sleep(1.0)  # let the worker's commit and its last settling pass
        live = await live_delays(kafka, worker, args, workdir, version, broker_pid)
    finally:
        with console.status(f"[{label}] stopping the worker…"):
            worker.stop()
    delays, written_at, trips = live["delays"], live["written"], live["round_trips"]
    out["latency"] = {
        "rollouts": len(delays), "rate_per_s": args.rate, "seconds": args.seconds,
        "delay_p50_s": percentile(delays, 0.5), "delay_p99_s": percentile(delays, 0.99),
        "delay_max_s": max(delays),
        "over_settle_p50_s": percentile(delays, 0.5) - args.settle_s,
        "over_settle_p99_s": percentile(delays, 0.99) - args.settle_s,
        "written_p50_s": percentile(written_at, 0.5), "written_p99_s": percentile(written_at, 0.99),
        "ping_count": len(trips), "ping_p50_s": percentile(trips, 0.5), "ping_p99_s": percentile(trips, 0.99),
    }
    third = max(1, len(delays) // 3)
    out["latency"].update({
        "first_third_p50_s": statistics.median(delays[:third]), "last_third_p50_s": statistics.median(delays[-third:]),
        "worker_cpu": live["worker_cpu"], "generator_cpu": live["generator_cpu"], "broker_cpu": live["broker_cpu"],
        "generator_own_cpu_share": live["generator_own_cpu_share"], "generator_lag_p99_s": live["generator_lag_p99_s"],
        "events_per_s": live["events_per_s"], "cpu_per_event_s": live["cpu_per_event_s"],
        "generator_cpu_per_event_s": live["generator_cpu_per_event_s"],
        "window": live["window"], "produced_events": live["produced_events"],
        "generator_requests": live["generator_requests"]})
    console.print(f"[{label}] finish → trajectory p50 {out['latency']['delay_p50_s'] * 1000:,.0f} ms, "
                  f"p99 {out['latency']['delay_p99_s'] * 1000:,.0f} ms at {args.rate:g} rollouts/s")
    return out


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    timing = Timing(settle_ms=int(args.settle_s * 1000))
    results: dict = {"rollouts": args.rollouts, "events": args.rollouts * EVENTS_PER_ROLLOUT,
                     "settle_s": args.settle_s, "tick_s": args.tick_s, "cpus": os.cpu_count(),
                     "baseline_rev": args.baseline,
                     "load_before": os.getloadavg()[0], "cpu_pressure_before": cpu_pressure(),
                     "tokens": {"prompt": PROMPT, "completion": COMPLETION, "follow_up": FOLLOW_UP}}
    events = history(args.rollouts, "r")
    raws = [encode(event) for event in events]
    results["event_bytes_mean"] = statistics.fmean(len(raw) for raw in raws)

    with console.status("The fold in-process…"):
        fold_s, made = fold(raws, timing)
        assert made == args.rollouts, made
        decoded = [decode(raw) for raw in raws]
        fold_bare_s, _ = fold(raws, timing, decoded)
    results["fold_events_per_s"] = len(raws) / fold_s
    results["fold_without_decode_events_per_s"] = len(raws) / fold_bare_s
    console.print(f"fold (decode, add, settle, record): {len(raws) / fold_s:,.0f} events/s; "
                  f"without decoding {len(raws) / fold_bare_s:,.0f} events/s")

    runs = [("after", ROOT, s.SCHEMA_VERSION, "after: this tree")]
    if args.baseline:
        tree, version = checkout(args.baseline, workdir / "baseline")
        runs.insert(len(runs) if args.baseline_second else 0, ("before", tree, version, f"before: {args.baseline}"))
    with contextlib.ExitStack() as stack:
        shared = stack.enter_context(kafka_broker(workdir / "kafka")) if args.one_broker else None
        for key, root, version, label in runs:
            # a broker of its own per worker (unless --one-broker): the second worker does not share one with
            # the first's topics, changelog and log segments
            with contextlib.nullcontext(shared) if shared else kafka_broker(workdir / f"kafka-{key}") as (bootstrap, pid):
                if args.warm_up_s and (not shared or key == runs[0][0]):
                    await warm_up(bootstrap, args, workdir)
                kafka = await fresh_topics(bootstrap)
                results["partitions"] = kafka.partitions
                results[key] = await measure_worker(args, workdir, kafka, events, root, version, label, pid)
    results["load_after"] = os.getloadavg()[0]
    results["cpu_pressure_after"] = cpu_pressure()
    return results


def shares(cpu: dict | None) -> str:
    if not cpu:
        return "n/a (no /proc)"
    return (f"{cpu['on_cpu']:.0%} on a CPU, {cpu['waiting_for_cpu']:.0%} waiting for one, "
            f"{cpu['blocked_or_idle']:.0%} blocked/idle")


def show(results: dict) -> None:
    report = Report("streams_assembly")
    ms = lambda value: f"{value * 1000:,.0f} ms"  # noqa: E731
    after, before = results["after"], results.get("before")
    base = after["consumer_events_per_s"]
    runs = [("before", before), ("after", after)] if before else [("after", after)]
    report.add(f"baseline: plain consumer reads + decodes the 3 topics ({results['events']} events)",
               f"{base:,.0f} events/s", 1.0)
    report.add("fold in-process: decode + add + settle + record (upper bound)",
               f"{results['fold_events_per_s']:,.0f} events/s", results["fold_events_per_s"] / base)
    bare = results["fold_without_decode_events_per_s"]
    report.add("fold in-process, events already decoded", f"{bare:,.0f} events/s", bare / base)
    for label, run in runs:
        caught, rate = run["catch_up"], run["worker_events_per_s"]
        consumer = run["consumer_events_per_s"]  # each run's own, on its own topics
        report.add(f"{label}: worker assembles {results['rollouts']} rollouts (first event handled → last "
                   f"trajectory); ratio vs. its run's plain consumer ({consumer:,.0f}/s)",
                   f"{rate:,.0f} events/s ({caught['processing_s']:.1f} s)", rate / consumer)
        report.add(f"{label}: the same vs. the fold in-process", f"{rate:,.0f} events/s",
                   rate / results["fold_events_per_s"])
        report.add(f"{label}: worker, from spawning the process (start-up included)",
                   f"{run['worker_events_per_s_from_spawn']:,.0f} events/s ({caught['from_spawn_s']:.1f} s)",
                   run["worker_events_per_s_from_spawn"] / consumer)
        cpu = caught["worker_cpu"]
        if cpu:
            per_event = cpu["cpu_s"] / results["events"]
            report.add(f"{label}: worker CPU per event (whole process; {shares(cpu)})",
                       f"{per_event * 1000:.3f} ms = {1 / per_event:,.0f} events/s on a core of its own",
                       1 / per_event / consumer)
        lat = run["latency"]
        report.add(f"{label}: produce (acked) → consume one record, p50 / p99 ({lat['ping_count']} records)",
                   f"{ms(lat['ping_p50_s'])} / {ms(lat['ping_p99_s'])}")
        report.add(f"{label}: finish acked → trajectory read, p50 ({lat['rollouts']} rollouts at "
                   f"{lat['rate_per_s']:g}/s = {lat['rate_per_s'] * EVENTS_PER_ROLLOUT:g} events/s)",
                   ms(lat["delay_p50_s"]), lat["delay_p50_s"] / lat["ping_p50_s"])
        report.add(f"{label}: finish acked → trajectory read, p99", ms(lat["delay_p99_s"]),
                   lat["delay_p99_s"] / lat["ping_p99_s"])
        report.add(f"{label}:   minus --settle-s {results['settle_s']:g}, p50 / p99",
                   f"{ms(lat['over_settle_p50_s'])} / {ms(lat['over_settle_p99_s'])}")
        report.add(f"{label}: delay p50, first third / last third of the rollouts (growing: it fell behind)",
                   f"{ms(lat['first_third_p50_s'])} / {ms(lat['last_third_p50_s'])}")
        if lat["worker_cpu"]:
            report.add(f"{label}: worker while live", shares(lat["worker_cpu"]))
        per_event = {**lat["cpu_per_event_s"], "generator": lat["generator_cpu_per_event_s"]}
        if None not in per_event.values():
            cores = {name: cpu * lat["rate_per_s"] * EVENTS_PER_ROLLOUT for name, cpu in per_event.items()}
            report.add(f"{label}: CPU per live event (first publish → last trajectory read; cores that takes at "
                       f"{lat['rate_per_s'] * EVENTS_PER_ROLLOUT:,.0f} events/s)",
                       ", ".join(f"{name} {cpu * 1000:.3f} ms ({cores[name]:.2f})" for name, cpu in per_event.items())
                       + f"; {sum(cores.values()):.2f} cores of {os.cpu_count()}")
        if lat["broker_cpu"]:
            report.add(f"{label}: the broker while live", shares(lat["broker_cpu"]))
        if lat["generator_cpu"]:
            report.add(f"{label}: load generator while live ({lat['events_per_s']:,.0f} events/s produced, "
                       f"p99 {ms(lat['generator_lag_p99_s'])} behind its schedule)", shares(lat["generator_cpu"]))
    if before:
        report.add("after / before: events per second while catching up", "",
                   after["worker_events_per_s"] / before["worker_events_per_s"])
        cpus = before["catch_up"]["worker_cpu"], after["catch_up"]["worker_cpu"]
        if all(cpus):
            report.add("before / after: CPU per event", "", cpus[0]["cpu_s"] / cpus[1]["cpu_s"])
        report.add("before / after: finish → trajectory p99 over --settle-s", "",
                   before["latency"]["over_settle_p99_s"] / max(after["latency"]["over_settle_p99_s"], 1e-3))
    report.details = results
    pressure = results["cpu_pressure_before"], results["cpu_pressure_after"]
    report.print("ratio: events/s vs. the plain consumer (or the fold); delays vs. the produce → consume round trip "
                 f"(same run). Load average {results['load_before']:.1f} → {results['load_after']:.1f} on "
                 f"{results['cpus']} CPUs"
                 + (f", CPU pressure {pressure[0]:.0%} → {pressure[1]:.0%}" if None not in pressure else "")
                 + "; Kafka, the worker and this client share them.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1500, help="rollouts published before the worker starts")
    parser.add_argument("--rate", type=float, default=20.0, help="live rollouts per second in the latency phase")
    parser.add_argument("--seconds", type=float, default=25.0, help="length of the latency phase")
    parser.add_argument("--ping-rate", type=float, default=10.0, help="baseline round trips per second meanwhile")
    parser.add_argument("--settle-s", type=float, default=1.0, help="the worker's --settle-s (its default)")
    parser.add_argument("--tick-s", type=float, default=StreamsSettings.model_fields["tick_s"].default,
                        help="the worker's --tick-s (its default): how often it looks for attempts due to settle")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up catching up after this long")
    parser.add_argument("--baseline", metavar="REV", help="also measure the worker of this commit, first (before)")
    parser.add_argument("--baseline-second", action="store_true",
                        help="measure the baseline's worker second, not first (to tell order from code)")
    parser.add_argument("--warm-up-s", type=float, default=15.0,
                        help="the live load on a fresh broker before its worker is measured (0: none)")
    parser.add_argument("--warm-up-without-worker", action="store_true",
                        help="warm the broker up with the live load alone (as before: the broker's JIT then "
                        "compiles the worker's requests while it is measured)")
    parser.add_argument("--one-broker", action="store_true",
                        help="both workers on one broker (the second then shares it with the first's topics)")
    parser.add_argument("--timeline", type=Path, metavar="DIR",
                        help="write each worker's timeline (bench/streams_timeline.py) and the live load's times here")
    args = parser.parse_args(argv)
    if args.timeline:
        args.timeline.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    show(results)


if __name__ == "__main__":
    main()

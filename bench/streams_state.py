"""The streams worker's state against days of sessions: its memory and its recovery after kill -9, with the
table in memory (`--store memory`) and on disk (`--store rocksdb`), and settled conversations keeping their
calls whole (`--session-calls whole`, the old layout, the baseline) or their offsets in the calls topic
(`offsets`), the four in the same run.

For each `--days` D, the log gets D days of synthetic sessions (`--sessions-per-day`, each three calls of
about `--call-kb` KiB (prompt and completion token ids, logprobs), feedback about the last one, the
client's end; every `--late-every`-th also feedback two hours later, a revision), timed over the D days
before now: what a worker holds for revisions under the default 30-day `--session-retention-s`. Then each
worker (an app id of its own, so a changelog of its own) reads it all (every session settles into a
trajectory, every revision is made: with offsets, from calls read back from the log); once its state is
written, its resident memory is read, it is killed -9 and started again, and the time until its table is
recovered (from the spawn: the process's start too) and its resident memory then (and its peak, VmHWM; of it the
anonymous pages and the files') are read, then its RSS every 0.5 s for 10 s more (the max: its first fetches, the
source records it reads again among them, come after the recovery) and the source records it read again.

The due index (when each rollout is next due, in Python: streams/assembly.py) is measured beside, in-process: the
same sessions folded over dicts, then the index rebuilt as after a restart, by tracemalloc, with every rollout in
it (the old index) and with `--due-horizon-s` (what is due within it); and the time of one pass over the state.
`--index-only` measures that alone (no broker).

The bound: a disk-store worker's RSS after the restart is at most `--state-memory-mb` over the Python baseline,
the RSS after a restart of the same worker over an empty log (measured first, in the same run), whatever the
days. With `--baseline REV` the disk-store workers of commit REV (its tree by `git archive`) are measured too,
on the same log: before → after, as ratios. Each `--env NAME=VALUE[,NAME=VALUE]` measures the disk-store workers
once more with those variables in their environment (an allocator's setting, read at the process's start), the
Python baseline too: each against its own baseline, and against the workers without it, as ratios.

    uv run python -m bench.streams_state [--days 1 3 10 30] [--sessions-per-day 100] [--call-kb 8]
        [--late-every 10] [--state-memory-mb 64] [--stores memory rocksdb] [--layouts whole offsets]
        [--baseline REV] [--env MALLOC_ARENA_MAX=2 ...] [--index-only] [--due-horizon-s 3600]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import httpx
import orjson
from rich.console import Console

import agentstream.schemas as s
from agentstream.schemas.kafka import KafkaSettings, make_producer
from agentstream.schemas.sessions import session_rollout_id
from agentstream.stack.process import free_port, spawn, tail
from agentstream.streams.assembly import Assembly, Timing
from bench.report import Report
from bench.streams_assembly import ROOT, checkout, fresh_topics, kafka_broker

console = Console()
DAY_MS = 24 * 3600 * 1000
MIB = 1024 * 1024
WATCH_S, SAMPLE_S = 10.0, 0.5
"""after the restart's recovery, its RSS sampled every SAMPLE_S for WATCH_S: the max (the first fetches come then)"""
BEFORE = "-before"
"""the label of the runs of the --baseline commit's workers (in names, app ids and topic names)"""
STORES = ("memory", "rocksdb")
LAYOUTS = ("whole", "offsets")
"""--session-calls: a settled conversation's calls kept whole in the state (the old layout), or their offsets"""


def conversation(i: int, start: int, call_kb: int, late: bool = False) -> list[s.Event]:
    """A session of three calls (~`call_kb` KiB each), feedback about the last, and the client's end; `late`: a
    score two hours later too (a revision of its trajectory)."""
    session_id = f"chat-{i}"
    ids = dict(rollout_id=session_rollout_id(session_id), source="bench")
    prompt = [(i + n) % 50_000 for n in range(call_kb * 1024 // 8)]  # ~6 bytes a token id in JSON, 8 with logprobs
    calls = []
    for turn in range(3):
        completion = [(i * 7 + turn + n) % 50_000 for n in range(64)]
        calls.append(s.CallEvent(time=start + turn * 60_000, **ids, data=s.Call(
            api="chat.completions", model="tiny", status=200, started_at=start + turn * 60_000 - 500,
            latency_ms=500.0, request={}, response={"choices": [{"index": 0, "message": {"content": "ok"}}]},
            prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-0.5] * len(completion),
            weight_version=0, session_id=session_id)))
    feedback = s.FeedbackEvent(**ids, time=start + 200_000, data=s.Feedback(
        session_id=session_id, call_id=calls[-1].id, sender="key:bench", thumbs="up"))
    end = s.SessionEndedEvent(**ids, time=start + 210_000, data=s.SessionEnded(session_id=session_id,
                                                                               sender="key:bench"))
    later = [s.FeedbackEvent(**ids, time=start + 2 * 3_600_000, data=s.Feedback(
        session_id=session_id, sender="key:bench", score=0.5))] if late else []
    return [*calls, feedback, end, *later]


def sessions(days: int, per_day: int, call_kb: int, late_every: int) -> list[s.Event]:
    """`days` × `per_day` sessions, evenly over the `days` days before now (the last ending three hours ago);
    every `late_every`-th with feedback two hours after it ended."""
    count = days * per_day
    first = s.now_ms() - days * DAY_MS
    step = (days * DAY_MS - 3 * 3_600_000) // count
    return [event for i in range(count)
            for event in conversation(i, first + i * step, call_kb, late=late_every > 0 and i % late_every == 0)]


async def publish(kafka: KafkaSettings, events: list[s.Event]) -> int:
    producer = make_producer(kafka, linger_ms=20, request_timeout_ms=120_000)  # (a loaded machine: not 10 s)
    await producer.start()
    size = 0
    try:
        pending = []
        for event in events:
            raw = s.encode(event)
            size += len(raw)
            pending.append(await producer.send(kafka.topics.name(event.topic), raw, key=event.key))
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return size


class Worker:
    """A streams worker with one store, its own app id and state folder: started, killed, started again."""

    def __init__(self, kafka: KafkaSettings, workdir: Path, store: str, layout: str, memory_mb: int,
                 root: Path = ROOT, label: str = "", env: dict[str, str] | None = None):
        self.port = free_port()
        self.root = root
        self.env = env or {}
        name = f"{store}-{layout}{label}"
        self.log = workdir / f"{name}.log"
        self.data_dir = workdir / name
        self.cmd = [sys.executable, "-m", "agentstream.streams", "worker", "--bootstrap-servers", kafka.bootstrap_servers,
                    "--topic-prefix", kafka.topic_prefix, "--app-id", f"state-{name}",
                    "--web-port", str(self.port), "--data-dir", str(self.data_dir), "--store", store,
                    "--session-calls", layout, "--state-memory-mb", str(memory_mb), "--settle-s", "1",
                    "--log-level", "warning"]
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> float:
        self.process = spawn(self.cmd, self.log, env=self.env, cwd=self.root)
        return time.monotonic()

    def view(self) -> dict | None:
        try:
            response = httpx.get(f"http://127.0.0.1:{self.port}/analytics", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def until(self, condition, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:  # (exited: its /proc stays, a zombie)
                raise SystemExit(f"the {what}: the worker exited; log ({self.log}):\n{tail(self.log)}")
            view = self.view()
            if view is not None and condition(view):
                return view
            time.sleep(0.2)
        raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}; log: {self.log}")

    def memory(self) -> dict[str, int]:
        """Resident memory now and its peak (VmRSS, VmHWM), and of it the anonymous pages (the heap, malloc's and
        Python's) and the files' (the libraries' code), bytes."""
        status = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines())
        return {name: int(status[field].split()[0]) * 1024
                for name, field in (("rss", "VmRSS"), ("peak", "VmHWM"), ("anon", "RssAnon"), ("file", "RssFile"))}

    def anonymous_maps(self) -> dict[str, int]:
        """The anonymous pages by where they are (smaps): the main arena's `[heap]` (glibc's malloc of the main
        thread), and the other anonymous maps (other threads' arenas, large blocks malloc maps on their own,
        Python's arenas, stacks), bytes; and how many of those maps hold pages."""
        heap = other = maps = 0
        name = ""
        for line in Path(f"/proc/{self.pid}/smaps").read_text().splitlines():
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a map's header: range perms offset dev inode [path]
                name = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "Rss:" and (rss := int(fields[1]) * 1024):
                if name == "[heap]":
                    heap += rss
                elif name == "":
                    other += rss
                    maps += 1
        return {"heap": heap, "other_anon": other, "anon_maps": maps}

    def kill(self) -> None:
        """kill -9"""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def disk_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.data_dir.rglob("*") if path.is_file())


def settled_all(count: int, revisions: int):
    def check(view: dict) -> bool:
        state, counts = view["state"], view["assembly"]
        return (counts.get("sessions", 0) >= count and counts.get("revisions", 0) >= revisions
                and state["unwritten_changes"] == 0
                and state.get("held_changes", 0) == 0)
    return check


def recovered(view: dict) -> bool:
    return view["state"]["recoveries"] > 0 and bool(view["assembly"]["partitions"])


def measure(kafka: KafkaSettings, workdir: Path, store: str, layout: str, count: int, revisions: int,
            memory_mb: int, root: Path = ROOT, label: str = "", env: dict[str, str] | None = None) -> dict:
    worker = Worker(kafka, workdir, store, layout, memory_mb, root, label, env)
    began = worker.start()
    try:
        read = worker.until(settled_all(count, revisions), timeout=1800, what=f"{count} sessions settled ({store})")
        read_s = time.monotonic() - began
        holding = worker.memory()
        worker.kill()
        began = worker.start()
        view = worker.until(recovered, timeout=1800, what=f"the table recovered ({store})")
        recovery_s = time.monotonic() - began
        after = worker.memory()
        maps = worker.anonymous_maps()
        # then its first fetches (source records read again come now: after the recovery, not in it), sampled
        settled = max(sample(worker, SAMPLE_S) for _ in range(int(WATCH_S / SAMPLE_S)))
        view = worker.view() or view
        return {"read_s": read_s, "calls_read_back": read["state"]["calls_read_back"],
                "rss_holding": holding["rss"], "peak_holding": holding["peak"],
                "recovery_s": recovery_s, "rss_recovered": after["rss"], "peak_recovering": after["peak"],
                "anon_recovered": after["anon"], "file_recovered": after["file"], "rss_settled_max": settled,
                "heap_recovered": maps["heap"], "other_anon_recovered": maps["other_anon"],
                "anon_maps_recovered": maps["anon_maps"],
                "peak_settled": worker.memory()["peak"],
                "restored_records": view["state"].get("restored_records"), "disk_bytes": worker.disk_bytes(),
                "state_memory_bytes": view["state"].get("memory_bytes"), "rocksdb": view["state"].get("rocksdb"),
                "due_indexed": view["assembly"].get("due_indexed"),
                "recovery": view["state"].get("recovery"),  # (what the index's rebuild read; absent before due keys)
                # source records read again after the restart (the consumer group's commits behind the table's
                # positions): fetched, then skipped; what the allocator keeps of them is in the RSS after it
                "redelivered": view["assembly"].get("redelivered", 0)}
    finally:
        worker.kill()


def sample(worker: Worker, every: float) -> int:
    """The worker's RSS `every` seconds from now (a sampling period: what is measured is the time it runs)."""
    time.sleep(every)
    return worker.memory()["rss"]


class Stored(dict):
    """Rollouts as the worker's table gives them: each key a string of its own, read from its database (the index
    holds it; in a dict the index would share the dict's)."""

    def items(self):
        return ((orjson.loads(orjson.dumps(key)), value) for key, value in super().items())


def due_index(days: int, per_day: int, late_every: int, horizon_s: float) -> dict[str, float]:
    """The due index after a restart over `days` days of sessions (calls of 1 KiB: the index does not see them),
    folded in-process over dicts: its bytes by tracemalloc with every rollout in it and with the horizon, and the
    seconds of one pass over the state (what the worker does once a horizon)."""
    events = sorted(sessions(days, per_day, 1, late_every), key=lambda event: (event.time, event.id))
    timing = Timing(settle_ms=1000)
    folded = Assembly({}, {}, timing)
    for event in events:
        folded.settle_due(event.time - 1)
        folded.add(event, s.encode(event), 0)
    now = s.now_ms()
    folded.settle_due(now)
    figures: dict[str, float] = {"rollouts": len(folded.rollouts)}
    stored = Stored(folded.rollouts)
    for name, horizon_ms in (("every", None), ("horizon", int(horizon_s * 1000))):
        tracemalloc.start()
        index = Assembly(stored, folded.events, timing, horizon_ms=horizon_ms)
        index.reindex(now)
        figures[f"{name}_bytes"] = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        figures[f"{name}_indexed"] = index.indexed()
        began = time.perf_counter()
        index.reindex(now)
        figures[f"{name}_pass_s"] = time.perf_counter() - began
    return figures


def add_due_index(report: Report, days: int, figures: dict[str, float], horizon_s: float) -> None:
    every, bounded = figures["every_bytes"], figures["horizon_bytes"]
    report.add(f"{days} d ({figures['rollouts']:,.0f} sessions held): the due index after a restart, every rollout → "
               f"those due within --due-horizon-s {horizon_s:g} (tracemalloc; entries)",
               f"{every / 1024:,.1f} → {bounded / 1024:,.1f} KiB ({figures['every_indexed']:,.0f} → "
               f"{figures['horizon_indexed']:,.0f})", every / max(1, bounded))
    report.add(f"{days} d: one pass over the state (dicts; the worker: once a horizon)",
               f"{figures['horizon_pass_s'] * 1000:,.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=int, nargs="+", default=[1, 3, 10, 30])
    parser.add_argument("--sessions-per-day", type=int, default=100)
    parser.add_argument("--call-kb", type=int, default=8)
    parser.add_argument("--late-every", type=int, default=10, help="every N-th session gets feedback after it "
                        "settled (a revision); 0: none")
    parser.add_argument("--state-memory-mb", type=int, default=64)
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--baseline", metavar="REV", help="also measure the disk-store workers of this commit (before)")
    parser.add_argument("--env", nargs="+", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="also measure the disk-store workers with these variables in their environment (each one "
                        "a variant, with a Python baseline of its own)")
    parser.add_argument("--due-horizon-s", type=float, default=3600.0, help="the due index's horizon to measure")
    parser.add_argument("--index-only", action="store_true", help="measure the due index alone (in-process)")
    args = parser.parse_args()
    report = Report("streams_state", details={**vars(args), "runs": {}, "due_index": {}})
    for days in args.days:
        figures = report.details["due_index"][days] = due_index(days, args.sessions_per_day, args.late_every,
                                                                args.due_horizon_s)
        console.print(f"{days} days, the due index: {figures}")
        add_due_index(report, days, figures, args.due_horizon_s)
    if args.index_only:
        report.print("ratio: the first figure / the second, same run")
        return
    with tempfile.TemporaryDirectory() as folder, kafka_broker(Path(folder) / "kafka") as (bootstrap, _):
        # the label of a run's name → the tree its worker runs and the variables added to its environment
        trees: dict[str, tuple[Path, dict[str, str]]] = {"": (ROOT, {})}
        if args.baseline:
            trees[BEFORE] = (checkout(args.baseline, Path(folder) / "baseline")[0], {})
        variants = {f"-env{number}": environment(text) for number, text in enumerate(args.env, 1)}
        trees.update((label, (ROOT, env)) for label, env in variants.items())
        python = {label: python_baseline(bootstrap, Path(folder) / f"empty{label}", args.state_memory_mb, env, label)
                  for label, env in [("", {}), *variants.items()]}
        report.details["python_baseline"] = python[""]
        report.details["environments"] = {label: env for label, env in variants.items()}
        for label, figures in python.items():
            report.add(f"Python baseline{label and ' ' + args.env[int(label[4:]) - 1]}: RSS after a restart over an "
                       "empty log (rocksdb)", f"{figures['rss_recovered'] / MIB:,.1f} MiB; the bound: + "
                       f"{args.state_memory_mb} MiB")
        for days in args.days:
            kafka = asyncio.run(fresh_topics(bootstrap))
            events = sessions(days, args.sessions_per_day, args.call_kb, args.late_every)
            with console.status(f"{days} days: publishing {len(events):,} events…"):
                size = asyncio.run(publish(kafka, events))
            count = days * args.sessions_per_day
            revisions = -(-count // args.late_every) if args.late_every else 0
            runs = {}
            for store in args.stores:
                for layout in args.layouts:
                    for label, (root, env) in trees.items() if store == "rocksdb" else [("", (ROOT, {}))]:
                        workdir = Path(folder) / f"{days}d"
                        workdir.mkdir(exist_ok=True)
                        name = f"{store}/{layout}{label}"
                        with console.status(f"{days} days: the {name} worker…"):
                            runs[name] = measure(kafka, workdir, store, layout, count, revisions, args.state_memory_mb,
                                                 root, label, env)
                        console.print(f"{days} days, {name}: {runs[name]}")
            report.details["runs"][days] = {"events": len(events), "log_bytes": size, **runs}
            add_figures(report, days, count, size, runs)
            add_bound(report, days, runs, python[""]["rss_recovered"], args.state_memory_mb, args.baseline)
            add_recovery_reads(report, days, count, runs, args.baseline)
            for label, text in zip(variants, args.env):
                add_variant(report, days, runs, python, label, text, args.state_memory_mb)
    report.print("ratio: the first figure / the second, same run (whole: calls kept in the state, the old layout)")


def environment(text: str) -> dict[str, str]:
    """`NAME=VALUE[,NAME=VALUE]` as a mapping."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--env {text!r}: NAME=VALUE[,NAME=VALUE] expected")
    return dict(pairs)


def python_baseline(bootstrap: str, empty: Path, memory_mb: int, env: dict[str, str], label: str) -> dict:
    """A disk-store worker restarted over an empty log, with `env` in its environment."""
    empty.mkdir()
    with console.status(f"the Python baseline{label}: a disk-store worker over an empty log…"):
        figures = measure(asyncio.run(fresh_topics(bootstrap)), empty, "rocksdb", "offsets", 0, 0, memory_mb,
                          env=env)
    console.print(f"the Python baseline{label} {env}: {figures}")
    return figures


def add_variant(report: Report, days: int, runs: dict[str, dict], python: dict[str, dict], label: str, text: str,
                memory_mb: int) -> None:
    """The disk-store workers with the variables `text` in their environment: over their own Python baseline, and
    against the workers without them (same log, same run)."""
    for layout in LAYOUTS:
        plain, varied = runs.get(f"rocksdb/{layout}"), runs.get(f"rocksdb/{layout}{label}")
        if plain is None or varied is None:
            continue
        over = {name: (run["rss_recovered"] - python[key]["rss_recovered"]) / MIB
                for name, run, key in (("plain", plain, ""), ("varied", varied, label))}
        report.add(f"{days} d, rocksdb/{layout}: RSS after the restart over its Python baseline, without → with {text} "
                   f"({'within' if over['varied'] <= memory_mb else 'OVER'} {memory_mb} MiB)",
                   f"{over['plain']:+,.1f} → {over['varied']:+,.1f} MiB")
        report.add(f"{days} d, rocksdb/{layout}: RSS after the restart, without → with {text}",
                   f"{plain['rss_recovered'] / MIB:,.1f} → {varied['rss_recovered'] / MIB:,.1f} MiB",
                   plain["rss_recovered"] / varied["rss_recovered"])
        report.add(f"{days} d, rocksdb/{layout}: of it the main arena's heap / other anonymous maps, without → with "
                   f"{text}", f"{plain['heap_recovered'] / MIB:,.1f} / {plain['other_anon_recovered'] / MIB:,.1f} → "
                   f"{varied['heap_recovered'] / MIB:,.1f} / {varied['other_anon_recovered'] / MIB:,.1f} MiB")


def add_bound(report: Report, days: int, runs: dict[str, dict], python_rss: int, memory_mb: int,
              baseline: str | None) -> None:
    """Each disk-store worker's RSS after the restart over the Python baseline, against the budget; with a
    baseline commit, its worker's → this tree's."""
    for layout in LAYOUTS:
        after = runs.get(f"rocksdb/{layout}")
        if after is None:
            continue
        over = (after["rss_recovered"] - python_rss) / MIB
        within = "within" if over <= memory_mb else "OVER"
        report.add(f"{days} d, rocksdb/{layout}: RSS after the restart over the Python baseline ({within} "
                   f"{memory_mb} MiB); {after['disk_bytes'] / MIB:,.1f} MiB on disk", f"{over:+,.1f} MiB")
        settled = (after["rss_settled_max"] - python_rss) / MIB
        report.add(f"{days} d, rocksdb/{layout}: RSS over the Python baseline, the max over the {WATCH_S:g} s after "
                   f"the recovery ({'within' if settled <= memory_mb else 'OVER'} {memory_mb} MiB); records read again",
                   f"{settled:+,.1f} MiB; {after['redelivered']}")
        before = runs.get(f"rocksdb/{layout}{BEFORE}")
        if before is not None:
            report.add(f"{days} d, rocksdb/{layout}: RSS, the max over the {WATCH_S:g} s after the recovery, {baseline} → "
                       "this tree; records read again", f"{before['rss_settled_max'] / MIB:,.1f} → "
                       f"{after['rss_settled_max'] / MIB:,.1f} MiB; {before['redelivered']} → {after['redelivered']}",
                       before["rss_settled_max"] / after["rss_settled_max"])
            report.add(f"{days} d, rocksdb/{layout}: RSS after the restart, {baseline} → this tree",
                       f"{before['rss_recovered'] / MIB:,.0f} → {after['rss_recovered'] / MIB:,.0f} MiB (over the "
                       f"baseline: {(before['rss_recovered'] - python_rss) / MIB:+,.1f} → {over:+,.1f})",
                       before["rss_recovered"] / after["rss_recovered"])
            report.add(f"{days} d, rocksdb/{layout}: recovery after kill -9, {baseline} → this tree",
                       f"{before['recovery_s']:.1f} → {after['recovery_s']:.1f} s",
                       before["recovery_s"] / after["recovery_s"])


def add_recovery_reads(report: Report, days: int, count: int, runs: dict[str, dict], baseline: str | None) -> None:
    """What the recovery's rebuild of the due index read: states (a worker before the due keys passes over every
    one: `count` sessions held) and due keys."""
    for name, run in runs.items():
        if name.startswith("rocksdb/") and (recovery := run.get("recovery")):
            before = f"{baseline}: every state, {count:,} (the pass) → " if f"{name}{BEFORE}" in runs else ""
            report.add(f"{days} d, {name}: states read by the index's rebuild at the recovery; due keys read",
                       f"{before}{recovery['states_read']:,}; {recovery['due_keys_read']:,}")


def add_figures(report: Report, days: int, count: int, size: int, runs: dict[str, dict]) -> None:
    if not all(f"{store}/{layout}" in runs for store in STORES for layout in LAYOUTS):
        return  # (the store and layout comparisons need all four)
    mb = MIB
    old, new = runs["memory/whole"], runs["rocksdb/offsets"]
    report.add(f"{days} d ({count:,} sessions, {size / mb:,.0f} MiB of events): recovery after kill -9 (spawn → "
               "table recovered), memory/whole → rocksdb/offsets", f"{old['recovery_s']:.1f} → "
               f"{new['recovery_s']:.1f} s", old["recovery_s"] / new["recovery_s"])
    for store in STORES:
        whole, offsets = runs[f"{store}/whole"], runs[f"{store}/offsets"]
        report.add(f"{days} d, {store}: RSS after the restart, whole → offsets",
                   f"{whole['rss_recovered'] / mb:,.0f} → {offsets['rss_recovered'] / mb:,.0f} MiB",
                   whole["rss_recovered"] / offsets["rss_recovered"])
        report.add(f"{days} d, {store}: peak RSS recovering, whole → offsets",
                   f"{whole['peak_recovering'] / mb:,.0f} → {offsets['peak_recovering'] / mb:,.0f} MiB",
                   whole["peak_recovering"] / offsets["peak_recovering"])
        report.add(f"{days} d, {store}: reading the log (spawn → every session settled), whole → offsets; calls "
                   "read back", f"{whole['read_s']:.1f} → {offsets['read_s']:.1f} s; {offsets['calls_read_back']}",
                   whole["read_s"] / offsets["read_s"])
    whole, offsets = runs["rocksdb/whole"], runs["rocksdb/offsets"]
    report.add(f"{days} d, rocksdb: on disk, whole → offsets", f"{whole['disk_bytes'] / mb:,.1f} → "
               f"{offsets['disk_bytes'] / mb:,.1f} MiB", whole["disk_bytes"] / max(1, offsets["disk_bytes"]))
    report.add(f"{days} d, rocksdb/offsets: RSS after the restart, of it the databases' memory (the budget's)",
               f"{offsets['rss_recovered'] / mb:,.0f} MiB, {(offsets['state_memory_bytes'] or 0) / mb:,.1f} MiB")


if __name__ == "__main__":
    main()

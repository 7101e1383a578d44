"""The local broker's share of the live load: its CPU per live event and per request, by thread, for
broker configurations alternating in one run (A, B, A, B, …), each on a fresh broker of its own.

Each round, per configuration: a fresh `LocalKafka` with that configuration's JVM options and
properties, warmed up as `bench.streams_assembly` does (`--warm-up-s` of the live load with a
throwaway worker reading it, unless `--warm-up-without-worker`), then this tree's worker through `bench.streams_assembly`'s two phases (a short catch-up of
`--rollouts`, then the live load of `bench.live_load` at `--rate` rollouts/s for `--seconds`).
Over the live window (first publish → last trajectory read) it reads, besides that bench's figures
(the worker's and the broker's CPU per live event, finish → trajectory over settle, the ping):

* the broker's CPU by thread (its threads' scheduler times from /proc, named from `jcmd
  Thread.print`, numbers folded into `*`), and by kind (JIT compiler, GC, request threads, other);
  its share of system time and its threads' context switches per request,
* the broker's requests by type, its bytes in and out, and its GC collections, from its JMX
  counters (`bench/KafkaCounts.java`, run by `java`; sampled every second).

A configuration is a string of tokens: a token starting with `-` is a JVM option (one naming a
collector, `-XX:+Use…GC`, replaces the default's), a `key=value` token a broker property after the
defaults (a later key wins). "" is the broker as `agentstream stack up` starts it. (A configuration
starting with `-` is given as `--config=…`.)

    python -m bench.broker_share --config="-XX:+UseG1GC num.io.threads=8" --config "" \\
                                 [--rounds 2] [--rate 1000] [--seconds 20] [--warm-up-s 25] [--rollouts 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import agentstream.schemas as s
from agentstream.stack.kafka import JVM_OPTIONS, LocalKafka
from agentstream.streams.settings import StreamsSettings
from bench.streams_assembly import (
    ROOT,
    console,
    fresh_topics,
    measure_worker,
    warm_up,
)
from samples.rollouts import EVENTS_PER_ROLLOUT, history

COUNTS_TOOL = Path(__file__).with_name("KafkaCounts.java")
USER, SYSTEM, SWITCHES = -1, -2, -3
"""keys of a sample's totals beside its threads' ids"""
GC_FLAG = re.compile(r"-XX:\+Use\w+GC$")


def broker(config: str, data_dir: Path) -> LocalKafka:
    """A `LocalKafka` with `config`'s JVM options and properties."""
    tokens = config.split()
    options = [token for token in tokens if token.startswith("-")]
    defaults = [o for o in JVM_OPTIONS if not (GC_FLAG.match(o) and any(GC_FLAG.match(t) for t in options))]
    properties = tuple(token for token in tokens if not token.startswith("-"))
    assert all("=" in p for p in properties), properties
    return LocalKafka(data_dir, default_port=None, jvm_options=(*defaults, *options), extra_properties=properties)


def thread_names(pid: int) -> dict[int, str]:
    """The broker's native thread ids → Java thread names, numbers folded (`…-handler-*`)."""
    dump = subprocess.run(["jcmd", str(pid), "Thread.print"], capture_output=True, text=True).stdout
    return {int(nid, 16): re.sub(r"\d+", "*", name)
            for name, nid in re.findall(r'^"([^"]+)".*? nid=0x([0-9a-f]+)', dump, re.MULTILINE)}


class Sampler(threading.Thread):
    """Every `interval` s: the CPU seconds of each of the broker's threads, and its JMX counters."""

    def __init__(self, pid: int, interval: float = 1.0):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.threads: list[tuple[float, dict[int, float]]] = []
        self.counts: list[tuple[float, dict[str, float]]] = []
        self.stopping = threading.Event()
        self.tool = subprocess.Popen(["java", str(COUNTS_TOOL), str(pid)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.tool.stdout.readline()  # attached

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            self.threads.append((time.time(), self.thread_cpu()))
            self.tool.stdin.write("\n")
            self.tool.stdin.flush()
            self.counts.append((time.time(), json.loads(self.tool.stdout.readline())))

    def thread_cpu(self) -> dict[int, float]:
        """CPU seconds per thread; and under keys -1, -2, -3: the process's user and system seconds and
        its threads' context switches (each a thread giving up its CPU, mostly to wait)."""
        cpu, switches = {}, 0
        for task in Path(f"/proc/{self.pid}/task").iterdir():
            try:
                cpu[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
                status = (task / "status").read_text()
                switches += sum(int(n) for n in re.findall(r"ctxt_switches:\s+(\d+)", status))
            except (OSError, ValueError):
                pass
        with open(f"/proc/{self.pid}/stat") as stat:
            user, system = stat.read().rsplit(")", 1)[1].split()[11:13]
        tick = os.sysconf("SC_CLK_TCK")
        return {**cpu, USER: int(user) / tick, SYSTEM: int(system) / tick, SWITCHES: switches}

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.tool.stdin.close()
        self.tool.wait(10)

    def timeline(self, names: dict[int, str]) -> list[tuple[float, dict[str, float]]]:
        """Per sample: the cores each thread group took since the one before (those above 0.02)."""
        out = []
        for (t0, before), (t1, after) in zip(self.threads, self.threads[1:]):
            groups: dict[str, float] = defaultdict(float)
            for tid, cpu in after.items():
                if tid > 0:
                    groups[names.get(tid, f"? {tid}")] += (cpu - before.get(tid, cpu)) / (t1 - t0)
            out.append((t1, {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v > 0.02}))
        return out

    def between(self, start: float, end: float, names: dict[int, str]) -> dict:
        """Per thread group: CPU seconds; per counter: its increase; and the wall between the samples."""
        nearest = lambda samples, at: min(samples, key=lambda sample: abs(sample[0] - at))  # noqa: E731
        (t0, first), (t1, last) = nearest(self.threads, start), nearest(self.threads, end)
        groups: dict[str, float] = defaultdict(float)
        for tid, cpu in last.items():
            if tid > 0:
                groups[names.get(tid, f"? {tid}")] += cpu - first.get(tid, 0.0)
        totals = {name: last[key] - first[key] for name, key in
                  (("user_s", USER), ("system_s", SYSTEM), ("context_switches", SWITCHES))}
        (c0, before), (c1, after) = nearest(self.counts, start), nearest(self.counts, end)
        return {"wall_s": t1 - t0, "threads": dict(sorted(groups.items(), key=lambda kv: -kv[1])), **totals,
                "counts_wall_s": c1 - c0, "counts": {k: v - before.get(k, 0) for k, v in after.items()}}


async def one(args: argparse.Namespace, config: str, workdir: Path, events: list[s.Event], label: str) -> dict:
    """One fresh broker of `config`, warmed up; this tree's worker through both phases on it."""
    kafka = broker(config, workdir / "kafka")
    with console.status(f"[{label}] starting Kafka…"):
        state = kafka.start(say=lambda message: None)
    try:
        sampler = Sampler(state.pid)
        sampler.start()
        try:
            began = time.time()
            await warm_up(state.url, args, workdir)
            warm = (began + args.warm_up_s / 2, time.time() - 0.5)  # its second half
            topics = await fresh_topics(state.url)
            result = await measure_worker(args, workdir, topics, events, ROOT, s.SCHEMA_VERSION, label, state.pid)
        finally:
            sampler.stop()
        names = thread_names(state.pid)  # after the windows: jcmd costs the broker CPU
        result["broker"] = sampler.between(*result["latency"]["window"], names)
        result["warm_up"] = sampler.between(*warm, names)
        result["timeline"] = [(round(at - began, 1), cores) for at, cores in sampler.timeline(names)]
        result["began"] = began
        return result
    finally:
        kafka.stop()


def summary(config: str, result: dict, rate: float) -> dict:
    """The figures of one broker's run, per live event and per second."""
    lat, broker_ = result["latency"], result["broker"]
    produced, wall = lat["produced_events"], broker_["wall_s"]
    counts = broker_["counts"]
    requests = {k.split(".")[1]: v for k, v in counts.items() if k.startswith("RequestMetrics.")}
    broker_cpu = sum(broker_["threads"].values())
    return {
        "config": config, "events": produced,
        "broker_ms_per_event": lat["cpu_per_event_s"]["broker"] * 1000,
        "worker_ms_per_event": lat["cpu_per_event_s"]["worker"] * 1000,
        "over_settle_p50_ms": lat["over_settle_p50_s"] * 1000, "over_settle_p99_ms": lat["over_settle_p99_s"] * 1000,
        "ping_p99_ms": lat["ping_p99_s"] * 1000,
        "broker_cores_by_thread": {k: round(v / wall, 3) for k, v in list(broker_["threads"].items())[:14]},
        "broker_ms_per_event_by_kind": by_kind(broker_["threads"], produced),
        "requests_per_s": {k: round(v / broker_["counts_wall_s"], 1) for k, v in
                           sorted(requests.items(), key=lambda kv: -kv[1]) if v},
        "broker_ms_per_request": broker_cpu * 1000 / max(1, sum(requests.values())),
        "requests_per_event": sum(requests.values()) / produced,
        "system_share": broker_["system_s"] / max(1e-9, broker_["user_s"] + broker_["system_s"]),
        "context_switches_per_request": broker_["context_switches"] / max(1, sum(requests.values())),
        "generator_requests_per_event": {k: v / produced for k, v in (lat["generator_requests"] or {}).items()},
        "bytes_in_per_event": counts.get("BrokerTopicMetrics.BytesInPerSec.Count", 0) / produced,
        "bytes_out_per_event": counts.get("BrokerTopicMetrics.BytesOutPerSec.Count", 0) / produced,
        "gc": {k.split(".")[1] + " " + k.split(".")[2].removeprefix("Collection"): v
               for k, v in counts.items() if k.startswith("GarbageCollector.") and v},
        "rate_events_per_s": rate * EVENTS_PER_ROLLOUT,
        "warm_up": warming(result["warm_up"]), "timeline": result["timeline"],
        "live_window": [round(at - result["began"], 1) for at in lat["window"]],
    }


KINDS = {"compiler (JIT)": ("C* CompilerThread",), "GC": ("G* ", "GC Thread", "VM Thread"),
         "requests": ("data-plane-kafka-request-handler", "data-plane-kafka-network-thread")}


def by_kind(threads: dict[str, float], events: int) -> dict[str, float]:
    """The broker's CPU per live event (ms) of its JIT compiler, its GC, its request threads and the rest."""
    out: dict[str, float] = defaultdict(float)
    for name, cpu in threads.items():
        kind = next((kind for kind, starts in KINDS.items() if name.startswith(starts)), "other")
        out[kind] += cpu * 1000 / events
    return {kind: round(ms, 4) for kind, ms in out.items()}


def warming(window: dict) -> dict:
    """The broker in the warm-up's second half: cores by thread, requests per second."""
    wall = window["wall_s"]
    return {"cores": round(sum(window["threads"].values()) / wall, 3),
            "cores_by_thread": {k: round(v / wall, 3) for k, v in list(window["threads"].items())[:6]},
            "requests_per_s": {k.split(".")[1]: round(v / window["counts_wall_s"], 1)
                               for k, v in window["counts"].items() if k.startswith("RequestMetrics.") and v}}


def show(rows: list[dict]) -> None:
    for row in rows:
        console.print(f"\n[bold]{row['config'] or '(as shipped)'}[/bold] round {row['round']}: broker "
                      f"{row['broker_ms_per_event']:.3f} ms/event, {row['broker_ms_per_request']:.3f} ms/request; worker "
                      f"{row['worker_ms_per_event']:.3f} ms/event; over settle p50/p99 {row['over_settle_p50_ms']:,.0f} / "
                      f"{row['over_settle_p99_ms']:,.0f} ms; ping p99 {row['ping_p99_ms']:,.0f} ms; bytes in/out per event "
                      f"{row['bytes_in_per_event']:,.0f} / {row['bytes_out_per_event']:,.0f}")
        console.print(f"  requests/s {row['requests_per_s']}; per live event {row['requests_per_event']:.3f}, the "
                      f"generator's {row['generator_requests_per_event']}")
        console.print(f"  cores by thread {row['broker_cores_by_thread']}")
        console.print(f"  ms per live event by kind {row['broker_ms_per_event_by_kind']}; system time "
                      f"{row['system_share']:.0%} of its CPU; {row['context_switches_per_request']:.1f} context "
                      f"switches per request")
        console.print(f"  gc {row['gc']}")
        console.print(f"  the warm-up's second half: {row['warm_up']}")
    configs = list(dict.fromkeys(row["config"] for row in rows))
    console.print("\nmeans over rounds (broker ms/event, worker ms/event, p99 over settle ms, ping p99 ms):")
    for config in configs:
        mine = [row for row in rows if row["config"] == config]
        mean = lambda key, mine=mine: sum(row[key] for row in mine) / len(mine)  # noqa: E731
        console.print(f"  {config or '(as shipped)'}: {mean('broker_ms_per_event'):.3f}, {mean('worker_ms_per_event'):.3f}, "
                      f"{mean('over_settle_p99_ms'):,.0f}, {mean('ping_p99_ms'):,.0f}")


async def run(args: argparse.Namespace) -> list[dict]:
    events = history(args.rollouts, "r")
    rows = []
    for round_ in range(args.rounds):
        for n, config in enumerate(args.config):
            with tempfile.TemporaryDirectory(prefix="bench-broker-") as tmp:
                label = f"{'ABCDEFGH'[n]}{round_ + 1}"
                result = await one(args, config, Path(tmp), events, label)
            rows.append({**summary(config, result, args.rate), "round": round_ + 1, "load": os.getloadavg()[0]})
            console.print(f"[{label}] broker {rows[-1]['broker_ms_per_event']:.3f} ms per live event, load "
                          f"{rows[-1]['load']:.1f}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", required=True, help="a broker configuration (repeat)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=300, help="published before the worker starts")
    parser.add_argument("--rate", type=float, default=1000.0, help="live rollouts per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ping-rate", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--tick-s", type=float, default=StreamsSettings.model_fields["tick_s"].default)
    parser.add_argument("--warm-up-s", type=float, default=25.0)
    parser.add_argument("--warm-up-without-worker", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = asyncio.run(run(args))
    show(rows)
    console.print(f"\nload average {load_before:.1f} → {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Reading stored events: `replay export --from` a trajectories topic, and `agentstream top`.

    uv run python -m bench.export [--trajectories 20000] [--metrics 200000] [--baseline REV [--rounds 2]]

Against a throwaway local broker: N stored trajectories (as `bench.replay`'s rollouts assemble: two
turns of a few hundred token ids, ~8 KB each) in a `trajectories` topic, and M metrics events in a
`metrics` topic. Each round, a count-only scan of the topic just before, then each tree's export
(events JSONL, chat JSONL, Parquet) and `top --once`, each as a process of its own; the ratio is
against that scan. With `--baseline REV`, the code of commit REV (its tree checked out by `git
archive`, run with this environment) beside this tree's, interleaved, and the outputs of both
compared (JSONL byte for byte, Parquet row for row, top's view as printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import polars as pl

import agentstream.schemas as s
from agentstream.schemas.kafka import KafkaSettings, ensure_topics
from agentstream.schemas.scan import scan
from agentstream.stack.kafka import LocalKafka
from agentstream.streams.assembly import Timing
from bench.replay import rollout_events
from bench.report import Report
from bench.streams_assembly import ROOT, checkout
from samples.assembly import assemble

SINKS = ("events", "chat", "parquet")
PREFIX = "bench-export."

EXPORT = """
import asyncio, json, resource, sys, time
from pathlib import Path
from agentstream.logs.replay import Job, Options, replay
from agentstream.schemas.kafka import KafkaSettings
url, prefix, sink, out, state = sys.argv[1:6]
settings = KafkaSettings(bootstrap_servers=url, topic_prefix=prefix, partitions=4)
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
began, used = time.perf_counter(), cpu()
summary = asyncio.run(replay(settings, Job("trajectories", sink, out), Options(Path(state))))
print(json.dumps({"written": summary.written, "wall_s": time.perf_counter() - began, "cpu_s": cpu() - used}))
"""
"""`replay export --from trajectories`, run by whichever tree is the working directory: figures as JSON"""

TOP = """
import asyncio, io, json, resource, sys, time
from rich.console import Console
from agentstream.logs.top import show_once
from agentstream.schemas.kafka import KafkaSettings
url, prefix, out = sys.argv[1:4]
settings = KafkaSettings(bootstrap_servers=url, topic_prefix=prefix, partitions=4)
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
text = io.StringIO()
began, used = time.perf_counter(), cpu()
view = asyncio.run(show_once(settings, 0, None, Console(file=text, width=200)))
figures = {"windows": len(view.windows), "wall_s": time.perf_counter() - began, "cpu_s": cpu() - used}
open(out, "w").write(text.getvalue().split(chr(10), 1)[1])  # (its first line shows the time of the latest event)
print(json.dumps(figures))
"""
"""`top --once` over the whole metrics and pool topics, run by whichever tree is the working directory"""


def run(tree: Path, script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the run by {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def trajectory_values(count: int) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of `count` stored trajectories: 500 assembled from `bench.replay`'s rollouts, repeated
    with ids of their own."""
    rng = random.Random(0)
    at = s.now_ms() - 3_600_000
    templates = [orjson.loads(s.encode(t)) for i in range(500)
                 for t in assemble(rollout_events(i, at + i * 50, rng), Timing(settle_ms=0, reward_grace_ms=0))]
    for i in range(count):
        event = dict(templates[i % len(templates)], id=s.new_id(), rollout_id=f"r{i}")
        yield event["rollout_id"].encode(), orjson.dumps(event)


def metrics_values(count: int) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of `count` metrics events: windows of 10 s, per model, weight version and partition,
    each window published again as it fills (the latest counts), as the streams worker writes them."""
    start = s.now_ms() // 10_000 * 10_000 - 3_600_000
    for i in range(count):
        window, version, partition = i // 400, i % 5, i % 4
        event = s.MetricsEvent(source="streams", data=s.Metrics(
            window_s=10, window_start=start + window * 10_000,
            group={"model": "tiny", "weight_version": str(version), "partition": str(partition)},
            values={"calls": float(i % 97), "errors": float(i % 3), "tokens_out": 50.0 * (i % 97),
                    "trajectories": float(i % 7), "rewarded": float(i % 7), "reward_sum": 0.5 * (i % 7),
                    **{f"latency_b{b}": float((i + b) % 11) for b in range(0, 40, 4)}}))
        yield b"tiny", s.encode(event)


def publish(settings: KafkaSettings, topic: str, records: Iterator[tuple[bytes, bytes]]) -> int:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "enable.idempotence": True,
                         "linger.ms": 50, "partitioner": "murmur2_random", "message.max.bytes": 16 * 1024 * 1024})
    count = 0
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:
                producer.poll(0.5)
        count += 1
    if producer.flush(120) != 0:
        raise RuntimeError("the broker did not acknowledge every record within 2 minutes")
    return count


async def count_scan(settings: KafkaSettings, topic: str) -> tuple[int, float]:
    began = time.perf_counter()
    counted = sum([len(batch) async for batch in scan(settings, topic, batch_size=20_000)])
    return counted, time.perf_counter() - began


def same_output(sink: str, a: Path, b: Path) -> bool:
    """The same rows (JSONL lines byte for byte), in any order of the partitions: each export reads the
    four partitions interleaved as their fetches come (tests/logs/test_replay_export.py compares the order
    too, on one partition)."""
    if sink == "parquet":
        order = ["trajectory_id", "sequence"]
        return pl.read_parquet(a).sort(order).equals(pl.read_parquet(b).sort(order))
    if sink == "top":
        return a.read_bytes() == b.read_bytes()
    return sorted(a.read_bytes().splitlines()) == sorted(b.read_bytes().splitlines())


async def measure(report: Report, settings: KafkaSettings, out: Path, trees: dict[str, Path], rounds: int,
                  trajectories: int, metrics: int) -> None:
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    written: dict[str, Path] = {}

    def note(name: str, count: int, raw_s: float, figures: dict, path: Path) -> None:
        """A run's rate, its ratio to the count-only scan before it, its CPU per record, and its output."""
        rates.setdefault(name, []).append(count / figures["wall_s"])
        ratios.setdefault(name, []).append(raw_s / figures["wall_s"])
        cpus.setdefault(name, []).append(figures["cpu_s"] / count * 1e6)
        written[name] = path

    for round_ in range(1, rounds + 1):
        for sink in SINKS:
            counted, raw_s = await count_scan(settings, settings.topics.trajectories)
            assert counted == trajectories
            rates.setdefault(f"scan of trajectories (count only), before {sink}", []).append(counted / raw_s)
            for label, tree in trees.items():
                path = out / f"{sink}-{label.split()[0]}-{round_}"
                figures = run(tree, EXPORT, settings.bootstrap_servers, PREFIX, sink, str(path), f"{path}.state")
                assert figures["written"] == trajectories, figures
                note(f"export {sink}, {label}", trajectories, raw_s, figures, path)
            print(f"  round {round_}, {sink}: scan {counted / raw_s:,.0f}/s; " + "; ".join(
                f"{label} {ratios[f'export {sink}, {label}'][-1]:.2f}x" for label in trees), flush=True)
        counted, raw_s = await count_scan(settings, settings.topics.metrics)
        assert counted == metrics
        rates.setdefault("scan of metrics (count only)", []).append(counted / raw_s)
        for label, tree in trees.items():
            path = out / f"top-{label.split()[0]}-{round_}.txt"
            note(f"top --once, {label}", metrics, raw_s, run(tree, TOP, settings.bootstrap_servers, PREFIX, str(path)),
                 path)
        print(f"  round {round_}, top: scan {counted / raw_s:,.0f}/s; " + "; ".join(
            f"{label} {ratios[f'top --once, {label}'][-1]:.2f}x" for label in trees), flush=True)
    for name, values in rates.items():
        unit = "metrics events/s" if "metrics" in name or "top" in name else "trajectories/s"
        figure = f"{statistics.median(values):,.0f} {unit}"
        if name in cpus:
            figure += f", CPU {min(cpus[name]):,.0f} µs each (best)"
        report.add(f"{name} (median of {rounds})", figure, statistics.median(ratios[name]) if name in ratios else 1.0)
    if len(trees) == 2:
        before, after = trees
        for sink in (*SINKS, "top"):
            name = f"export {sink}" if sink != "top" else "top --once"
            a, b = written[f"{name}, {before}"], written[f"{name}, {after}"]
            report.add(f"{name}: output before and after", "identical" if same_output(sink, a, b) else "DIFFERENT")
            report.add(f"{name}: CPU per record, before → after (best of the rounds)",
                       f"{min(cpus[f'{name}, {before}']):,.0f} → {min(cpus[f'{name}, {after}']):,.0f} µs",
                       min(cpus[f"{name}, {before}"]) / min(cpus[f"{name}, {after}"]))
    report.details.update(rates=rates, ratios=ratios, cpu_us=cpus)


async def main(trajectories: int, metrics: int, baseline: str | None, rounds: int) -> None:
    report = Report("export")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        broker = LocalKafka(out / "kafka", default_port=None)
        url = broker.start().url
        try:
            settings = KafkaSettings(bootstrap_servers=url, topic_prefix=PREFIX, partitions=4)
            await ensure_topics(settings)
            print(f"publishing {trajectories:,} trajectories and {metrics:,} metrics events…", flush=True)
            publish(settings, settings.topics.trajectories, trajectory_values(trajectories))
            publish(settings, settings.topics.metrics, metrics_values(metrics))
            trees = {"after (this tree)": ROOT}
            if baseline:
                tree, _ = checkout(baseline, out / "baseline")
                trees = {f"before ({baseline})": tree, **trees}
            load = os.getloadavg()[0]
            await measure(report, settings, out, trees, rounds, trajectories, metrics)
            report.add("load average (1 min) at the start and the end of the rounds",
                       f"{load:.2f} → {os.getloadavg()[0]:.2f}")
        finally:
            broker.stop()
    report.print("ratio: throughput vs. the count-only scan of the same topic just before (median of the rounds); "
                 "CPU: before / after")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=20_000)
    parser.add_argument("--metrics", type=int, default=200_000)
    parser.add_argument("--baseline", metavar="REV", help="also run the code of this commit, before/after")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    args = parser.parse_args()
    asyncio.run(main(args.trajectories, args.metrics, args.baseline, args.rounds))

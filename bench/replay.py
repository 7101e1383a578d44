"""Replay speed: raw events per second a rebuild folds into trajectories, and what its outputs add.

    uv run python -m bench.replay [--rollouts 10000]

Against a throwaway local broker: N rollouts (queued, two calls with prompts of a few hundred
tokens, a reward, finished; a tenth scored by a reward function) are published, then, in one run:
- baseline: a scan of the three raw topics that only counts records (what Kafka and aiokafka cost);
- `replay rebuild` into a new topic, `replay export` to Parquet (chat rows, with the calls'
  messages), and `replay rebuild --reward-fn` (rescoring every attempt), each from the raw topics;
- the raw topics archived to Parquet (`agentstream archive`), and the rebuild read from the archive;
- `replay export --from` the rebuilt topic (stored trajectories, no rebuild), against a count-only
  scan of that topic.

With `--baseline REV`, also before and after in the same run: `replay rebuild` into a topic by the
code of commit REV (its tree checked out by `git archive`, run with this environment) and by this
tree, each as a process of its own (events/s over its wall time, its CPU per event), in `--rounds`
interleaved rounds, each against a raw scan just before; the topics rebuilt by both are compared
byte for byte (a rebuild must make the live worker's bytes, so any change to them shows here). Before the
rebuilds of each round, the fold alone by each tree, in-process (2,000 rollouts' raw events decoded,
added, settled as time passes, recorded, the trajectories encoded; CPU of the best of 5 passes): what
both the rebuild and the live worker pay per event, without Kafka.
Each runs with its default processes (`--jobs`: one per core since the partition-parallel
rebuild); its CPU counts its worker processes' (and the fork server's that forks them).

    uv run python -m bench.replay [--rollouts 10000] [--baseline main [--rounds 2]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import schemas as s
from agentstream.replay import Job, Options, RebuildSpec, replay
from agentstream.archive import Archiver
from schemas.scan import KAFKA, Origin, scan
from agentstream.stack.kafka import LocalKafka
from bench.load import publish_all
from bench.report import Report
from bench.streams_assembly import ROOT, checkout
from schemas.kafka import KafkaSettings, ensure_topics
from streams.assembly import Timing

RAW = ("rollouts", "calls", "rewards")


def rollout_events(i: int, at: int, rng: random.Random) -> list[s.Event]:
    ids = dict(source="bench", rollout_id=f"r{i}", attempt_id="a1")
    scored = i % 10 == 0
    task = s.Task(id=f"t{i % 50}", input={"prompt": "p"}, reward_fn="streams.rewards:exact_match" if scored else None,
                  metadata={"answer": "42"})
    prompt = [rng.randrange(256) for _ in range(300)]
    first, second = [rng.randrange(256) for _ in range(40)], [rng.randrange(256) for _ in range(40)]
    tool = [rng.randrange(256) for _ in range(60)]

    def call(n: int, prompt_ids: list[int], completion: list[int]) -> s.CallEvent:
        return s.CallEvent(**ids, time=at + n, data=s.Call(
            api="chat.completions", model="tiny", weight_version=i // 1000, status=200, started_at=at + n - 5,
            latency_ms=40.0, request={"messages": [{"role": "user", "content": "x" * 300}]},
            response={"choices": [{"message": {"role": "assistant", "content": "42"}}]},
            prompt_token_ids=prompt_ids, completion_token_ids=completion, logprobs=[-0.5] * len(completion),
            finish_reason="stop"))

    events: list[s.Event] = [
        s.RolloutQueuedEvent(**ids, time=at, data=s.RolloutQueued(task=task, group_id=f"g{i % 50}",
                                                                   weight_version=i // 1000, model="tiny")),
        call(10, prompt, first), call(20, prompt + first + tool, second)]
    if not scored:
        events.append(s.RewardEvent(**ids, time=at + 30, data=s.Reward(value=rng.random())))
    return events + [s.RolloutFinishedEvent(**ids, time=at + 40, data=s.RolloutFinished(by="controller"))]


async def fill(settings: KafkaSettings, rollouts: int) -> int:
    rng = random.Random(0)
    start = s.now_ms() - 3_600_000
    return await publish_all(settings, (event for i in range(rollouts)
                                        for event in rollout_events(i, start + i * 50, rng)))


async def count_scan(settings: KafkaSettings, bases: tuple[str, ...], origin: Origin = KAFKA) -> int:
    return sum([len(batch) for base in bases async for batch in scan(settings, settings.topics.name(base),
                                                                      origin=origin)])


async def timed(coroutine) -> tuple[object, float]:
    start = time.perf_counter()
    result = await coroutine
    return result, time.perf_counter() - start


REBUILD = """
import asyncio, json, resource, sys, time
from pathlib import Path
from agentstream.replay import Job, Options, RebuildSpec, replay
from schemas.kafka import KafkaSettings
from streams.assembly import Timing
url, topic, state = sys.argv[1:4]
settings = KafkaSettings(bootstrap_servers=url, topic_prefix="bench.", partitions=4)
job = Job("raw", "topic", topic, rebuild=RebuildSpec(timing=Timing(settle_ms=1000, reward_grace_ms=30_000)))
def cpu():  # with its worker processes' (replay rebuild --jobs), where it has them
    usages = map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime + u.ru_stime for u in usages)
began, used = time.perf_counter(), cpu()
summary = asyncio.run(replay(settings, job, Options(Path(state))))
wall = time.perf_counter() - began
# workers forked by multiprocessing's fork server are its children: their CPU (and its own) counts here once
# the server, which reaped them, has ended and been waited for
import multiprocessing.forkserver
multiprocessing.forkserver._forkserver._stop()
print(json.dumps({"written": summary.written, "wall_s": wall, "cpu_s": cpu() - used}))
"""
"""`replay rebuild` into a topic, run by whichever tree is the working directory: figures as JSON"""


def rebuild_process(tree: Path, url: str, topic: str, state: Path) -> dict:
    """One rebuild by the code in `tree`, as a process of its own."""
    done = subprocess.run([sys.executable, "-c", REBUILD, url, topic, str(state)], cwd=tree, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"the rebuild by {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


FOLD = """
import json, pickle, sys, time
from schemas import collector
from schemas.codec import decode, encode
from streams.assembly import Assembly, Timing
raws = pickle.load(open(sys.argv[1], "rb"))
timing = Timing(settle_ms=1000, reward_grace_ms=30_000)
def fold():
    assembly, out = Assembly({}, {}, timing), []
    def settle(now):
        for rollout_id in assembly.due(now, [0]):
            settled = assembly.settle(rollout_id, now)
            out.extend(encode(trajectory) for trajectory in settled.trajectories)
            assembly.record(settled)
    began = time.process_time()
    for raw in raws:
        event = decode(raw)
        settle(event.time - 1)
        assembly.add(event, raw, 0)
    settle(2 ** 62)
    return time.process_time() - began
with collector.relaxed():
    print(json.dumps({"cpu_s": min(fold() for _ in range(int(sys.argv[2])))}))
"""
"""the rebuild's fold alone, in-process, by whichever tree is the working directory: decode, add, settle as
time passes, record, encode; CPU seconds of the best of N passes over the raw events in a pickle file"""


def fold_process(tree: Path, raws: Path, passes: int = 5) -> float:
    done = subprocess.run([sys.executable, "-c", FOLD, str(raws), str(passes)], cwd=tree, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"the fold by {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["cpu_s"]


def fold_events(rollouts: int) -> list[bytes]:
    """Raw events of `rollouts` rollouts as the rebuild meets them: in time order."""
    rng = random.Random(1)
    events = [event for i in range(rollouts) for event in rollout_events(i, 1_700_000_000_000 + i * 50, rng)]
    return [s.encode(event) for event in sorted(events, key=lambda event: event.time)]


async def values(settings: KafkaSettings, base: str) -> list[bytes]:
    return sorted([record.value async for batch in scan(settings, settings.topics.name(base)) for record in batch])


async def before_after(report: Report, settings: KafkaSettings, url: str, out: Path, rollouts: int, events: int,
                       baseline: str, rounds: int) -> None:
    """The rebuild by REV's code and by this tree's, interleaved; the topics they made compared."""
    tree, version = checkout(baseline, out / "baseline")
    if version != s.SCHEMA_VERSION:
        raise SystemExit(f"{baseline} reads schema version {version}, these events are version {s.SCHEMA_VERSION}: "
                         "choose a baseline of the same schema version")
    trees = {f"before ({baseline})": tree, "after (this tree)": ROOT}
    raws = out / "fold.pickle"
    folded = fold_events(2000)
    raws.write_bytes(pickle.dumps(folded))
    cpu: dict[str, list[float]] = {label: [] for label in trees}
    fold_cpu: dict[str, list[float]] = {label: [] for label in trees}
    for round_ in range(rounds):
        for label, root in trees.items():
            fold_cpu[label].append(fold_process(root, raws))
            report.add(f"round {round_ + 1}: the fold alone, in-process (decode, add, settle, record, encode), {label}",
                       f"{len(folded) / fold_cpu[label][-1]:,.0f} events/s of CPU", 1.0 if root == tree else
                       fold_cpu[f"before ({baseline})"][-1] / fold_cpu[label][-1])
    for round_ in range(rounds):
        _, raw_s = await timed(count_scan(settings, RAW))
        report.add(f"round {round_ + 1}: raw scan (count only)", f"{events / raw_s:,.0f} events/s", 1.0)
        for label, root in trees.items():
            topic = f"rebuilt-{'before' if root == tree else 'after'}-{round_}"
            figures = rebuild_process(root, url, topic, out / f"{topic}.state")
            assert figures["written"] == rollouts, (label, figures)
            cpu[label].append(figures["cpu_s"])
            report.add(f"  rebuild into a topic, {label}: events/s (vs. raw), CPU per event",
                       f"{events / figures['wall_s']:,.0f} events/s, {figures['cpu_s'] / events * 1e6:,.0f} µs",
                       raw_s / figures["wall_s"])
    before, after = cpu.values()
    report.add("CPU per event, before → after (best of the rounds)",
               f"{min(before) / events * 1e6:,.0f} → {min(after) / events * 1e6:,.0f} µs", min(before) / min(after))
    same = await values(settings, "rebuilt-before-0") == await values(settings, "rebuilt-after-0")
    report.add("the trajectories rebuilt before and after, byte for byte", "identical" if same else "DIFFERENT")
    report.details["before_after"] = {"baseline": baseline, "cpu_s": cpu, "events": events, "identical": same,
                                      "fold_cpu_s": fold_cpu, "fold_events": len(folded)}


async def main(rollouts: int, baseline: str | None = None, rounds: int = 2) -> None:
    report = Report("replay")
    timing = Timing(settle_ms=1000, reward_grace_ms=30_000)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        broker = LocalKafka(out / "kafka", default_port=None)
        state = broker.start()
        try:
            settings = KafkaSettings(bootstrap_servers=state.url, topic_prefix="bench.", partitions=4)
            await ensure_topics(settings)
            print(f"publishing {rollouts:,} rollouts…", flush=True)
            events = await fill(settings, rollouts)

            if baseline:
                await before_after(report, settings, state.url, out, rollouts, events, baseline, rounds)
            counted, raw_s = await timed(count_scan(settings, RAW))
            assert counted == events
            report.add(f"raw scan of rollouts, calls, rewards (count only), {events:,} events",
                       f"{events / raw_s:,.0f} events/s", 1.0)
            runs = [
                ("rebuild into a topic", Job("raw", "topic", "rebuilt", rebuild=RebuildSpec(timing=timing))),
                ("rebuild, export to Parquet (chat rows)",
                 Job("raw", "parquet", str(out / "data.parquet"), rebuild=RebuildSpec(timing=timing))),
                ("rebuild with a new reward function into a topic",
                 Job("raw", "topic", "rescored", rebuild=RebuildSpec("streams.rewards:numeric_answer", timing))),
            ]
            for label, job in runs:
                summary, took = await timed(replay(settings, job, Options(out / f"{label}.state")))
                assert summary.written == rollouts, (label, summary)
                report.add(label, f"{events / took:,.0f} events/s", raw_s / took)

            archiver = Archiver(settings, out / "archive", tables=RAW, say=lambda _: None)
            _, took = await timed(archiver.cycle())
            report.add("archive the raw topics (Parquet, zstd)", f"{events / took:,.0f} events/s", raw_s / took)
            archive = Origin("archive", out / "archive")
            counted, archived_raw_s = await timed(count_scan(settings, RAW, archive))
            assert counted == events
            report.add("raw scan of the archive (count only)", f"{events / archived_raw_s:,.0f} events/s",
                       raw_s / archived_raw_s)
            job = Job("raw", "topic", "rebuilt-from-archive", rebuild=RebuildSpec(timing=timing))
            summary, took = await timed(replay(settings, job, Options(out / "archived.state", origin=archive)))
            assert summary.written == rollouts, summary
            report.add("rebuild into a topic, from the archive", f"{events / took:,.0f} events/s", raw_s / took)

            counted, stored_s = await timed(count_scan(settings, ("rebuilt",)))
            report.add(f"scan of the rebuilt topic (count only), {counted:,} trajectories",
                       f"{counted / stored_s:,.0f} trajectories/s", 1.0)
            job = Job("rebuilt", "events", str(out / "stored.jsonl"))
            summary, took = await timed(replay(settings, job, Options(out / "stored.state")))
            assert summary.written == rollouts
            report.add("export stored trajectories (JSONL events)", f"{counted / took:,.0f} trajectories/s",
                       stored_s / took)
        finally:
            broker.stop()
    report.print("ratio: throughput vs. the count-only scan above it")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--baseline", metavar="REV", help="also rebuild with the code of this commit, before/after")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved before/after rounds with --baseline")
    args = parser.parse_args()
    asyncio.run(main(args.rollouts, args.baseline, args.rounds))

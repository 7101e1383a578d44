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
rebuild, one for a range under 25,000 raw records since a1e6eb8); its CPU counts its worker processes'
(and the fork server's that forks them).

With `--large N`, then the rebuild into a topic at the issue's scale (100000: 490,000 raw events), on raw
topics of their own: a raw scan and the rebuild by each tree (REV's too, with `--baseline`), `--large-rounds`
rounds. The raw events are produced by librdkafka from 50 rollouts encoded once, each rollout's id, event
ids and times put in (~110,000 events/s; building and encoding them one by one with pydantic alone ran at
~30,000 events/s of CPU).

    uv run python -m bench.replay [--rollouts 10000] [--baseline main [--rounds 2]] [--large 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import pickle
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import agentstream.schemas as s
from agentstream.archive import Archiver
from agentstream.logs.replay import Job, Options, RebuildSpec, replay
from agentstream.schemas.ids import new_id
from agentstream.schemas.kafka import KafkaSettings, ensure_topics
from agentstream.schemas.scan import KAFKA, Origin, scan
from agentstream.stack.kafka import LocalKafka
from agentstream.streams.assembly import Timing
from bench.report import Report
from bench.streams_assembly import ROOT, checkout

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


TEMPLATES = 50
"""distinct rollouts built and encoded once (a multiple of 10: every tenth is scored by a reward function)"""
RID, EID, T0 = "@@rollout@@", "@@event@@", 7_777_777_000_000
SLOTS = re.compile(rb"@@rollout@@|@@event@@|7777777(\d{6})")
"""a template's rollout id, event ids, and times (T0 + what follows it: the events' offsets within the rollout)"""


def templates() -> list[list[tuple[str, list[bytes], list[re.Match[bytes]]]]]:
    """`TEMPLATES` rollouts' events encoded once, each cut at its slots: (topic, the bytes between, the slots)."""
    rng = random.Random(0)
    out = []
    for i in range(TEMPLATES):
        events = rollout_events(i, T0, rng)
        for event in events:
            event.rollout_id, event.id = RID, EID
        encoded = [(event.topic, s.encode(event)) for event in events]
        assert all(raw.count(b"7777777") == sum(1 for slot in SLOTS.finditer(raw) if slot.group(1))
                   for _, raw in encoded)
        out.append([(topic, SLOTS.split(raw)[::2], list(SLOTS.finditer(raw))) for topic, raw in encoded])
    return out


def produce_rollouts(settings: KafkaSettings, rollouts: int, start: int) -> int:
    """N rollouts 50 ms apart from `start`, each a template's events with its own rollout id, event ids and
    times put in (building and encoding each event with pydantic alone runs at ~30,000 events/s of CPU; this
    publishes ~110,000 events/s, Kafka included)."""
    from bench.live_load import produce, producer

    shapes, names = templates(), {t: settings.topics.name(t) for t in RAW}
    writer, failures, count = producer(settings.bootstrap_servers), [], 0

    def delivered(error, _message) -> None:
        if error is not None:
            failures.append(error.str())

    for i in range(rollouts):
        rollout_id, at = f"r{i}".encode(), start + i * 50
        for topic, between, slots in shapes[i % TEMPLATES]:
            parts = [between[0]]
            for slot, after in zip(slots, between[1:]):
                value = slot.group(0)
                parts += (rollout_id if value == RID.encode() else new_id().encode() if value == EID.encode()
                          else b"%d" % (at + int(slot.group(1))), after)
            produce(writer, names[topic], b"".join(parts), rollout_id, delivered)
            count += 1
        writer.poll(0)
    while writer.flush(1.0):
        pass
    if failures:
        raise SystemExit(f"publishing the raw events: {failures[0]} ({len(failures)} failed)")
    return count


async def fill(settings: KafkaSettings, rollouts: int) -> int:
    return await asyncio.to_thread(produce_rollouts, settings, rollouts, s.now_ms() - 3_600_000 - rollouts * 50)


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
from agentstream.logs.replay import Job, Options, RebuildSpec, replay
from agentstream.schemas.kafka import KafkaSettings
from agentstream.streams.assembly import Timing
url, prefix, topic, state = sys.argv[1:5]
settings = KafkaSettings(bootstrap_servers=url, topic_prefix=prefix, partitions=4)
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


def rebuild_process(tree: Path, settings: KafkaSettings, topic: str, state: Path) -> dict:
    """One rebuild by the code in `tree`, as a process of its own."""
    done = subprocess.run([sys.executable, "-c", REBUILD, settings.bootstrap_servers, settings.topic_prefix, topic,
                           str(state)], cwd=tree, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the rebuild by {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


FOLD = """
import json, pickle, sys, time
from agentstream.schemas import collector
from agentstream.schemas.codec import decode, encode
from agentstream.streams.assembly import Assembly, Timing
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
    """The topic's records, as digests (a large rebuild's topic is a GB), sorted."""
    return sorted([hashlib.blake2b(record.value).digest() async for batch in scan(settings, settings.topics.name(base))
                   for record in batch])


async def before_after(report: Report, settings: KafkaSettings, out: Path, rollouts: int, events: int,
                       baseline: str, rounds: int) -> None:
    """The fold alone and the rebuild by REV's code and by this tree's, interleaved; the topics they made compared."""
    trees = baseline_trees(out, baseline)
    tree = trees[f"before ({baseline})"]
    raws = out / "fold.pickle"
    folded = fold_events(2000)
    raws.write_bytes(pickle.dumps(folded))
    fold_cpu: dict[str, list[float]] = {label: [] for label in trees}
    for round_ in range(rounds):
        for label, root in trees.items():
            fold_cpu[label].append(fold_process(root, raws))
            report.add(f"round {round_ + 1}: the fold alone, in-process (decode, add, settle, record, encode), {label}",
                       f"{len(folded) / fold_cpu[label][-1]:,.0f} events/s of CPU", 1.0 if root == tree else
                       fold_cpu[f"before ({baseline})"][-1] / fold_cpu[label][-1])
    report.details["before_after"] = {"baseline": baseline, "fold_cpu_s": fold_cpu, "fold_events": len(folded),
                                      **await rebuild_rounds(report, settings, out, trees, rollouts, events, rounds)}


def baseline_trees(out: Path, baseline: str | None) -> dict[str, Path]:
    """The trees whose rebuilds are compared: REV's (checked out once) and this one."""
    if baseline is None:
        return {"this tree": ROOT}
    into = out / "baseline"
    if not into.exists():
        _, version = checkout(baseline, into)
        if version != s.SCHEMA_VERSION:
            raise SystemExit(f"{baseline} reads schema version {version}, these events are version "
                             f"{s.SCHEMA_VERSION}: choose a baseline of the same schema version")
    return {f"before ({baseline})": into, "after (this tree)": ROOT}


async def rebuild_rounds(report: Report, settings: KafkaSettings, out: Path, trees: dict[str, Path], rollouts: int,
                         events: int, rounds: int) -> dict:
    """`replay rebuild` into a topic by each tree, as a process of its own, in interleaved rounds, each round
    after a raw scan; the topics of the first round compared byte for byte."""
    cpu: dict[str, list[float]] = {label: [] for label in trees}
    size = f"{events:,} events"
    for round_ in range(rounds):
        _, raw_s = await timed(count_scan(settings, RAW))
        report.add(f"{size}, round {round_ + 1}: raw scan (count only)", f"{events / raw_s:,.0f} events/s", 1.0)
        for n, (label, root) in enumerate(trees.items()):
            topic = f"rebuilt-{n}-{round_}"
            figures = rebuild_process(root, settings, topic, out / f"{settings.topic_prefix}{topic}.state")
            assert figures["written"] == rollouts, (label, figures)
            cpu[label].append(figures["cpu_s"])
            report.add(f"  rebuild into a topic, {label}: events/s (vs. raw), CPU per event",
                       f"{events / figures['wall_s']:,.0f} events/s, {figures['cpu_s'] / events * 1e6:,.0f} µs",
                       raw_s / figures["wall_s"])
    if len(trees) < 2:
        return {"cpu_s": cpu, "events": events}
    before, after = cpu.values()
    report.add(f"{size}: CPU per event, before → after (best of the rounds)",
               f"{min(before) / events * 1e6:,.0f} → {min(after) / events * 1e6:,.0f} µs", min(before) / min(after))
    same = await values(settings, "rebuilt-0-0") == await values(settings, "rebuilt-1-0")
    report.add(f"{size}: the trajectories rebuilt before and after, byte for byte", "identical" if same else "DIFFERENT")
    return {"cpu_s": cpu, "events": events, "identical": same}


async def large_size(report: Report, url: str, out: Path, rollouts: int, baseline: str | None, rounds: int) -> None:
    """The rebuild at the issue's scale (its fixed costs, a third of the CPU at 24,500 events, amortized):
    raw topics of their own, filled with `rollouts` rollouts, then the rebuild rounds."""
    settings = KafkaSettings(bootstrap_servers=url, topic_prefix="bench-large.", partitions=4)
    await ensure_topics(settings)
    print(f"publishing {rollouts:,} rollouts…", flush=True)
    events, took = await timed(fill(settings, rollouts))
    report.add(f"publishing {rollouts:,} rollouts ({events:,} raw events)", f"{events / took:,.0f} events/s")
    report.details["large"] = await rebuild_rounds(report, settings, out, baseline_trees(out, baseline), rollouts,
                                                   events, rounds)


async def main(rollouts: int, baseline: str | None = None, rounds: int = 2, large: int = 0,
               large_rounds: int = 1) -> None:
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
                await before_after(report, settings, out, rollouts, events, baseline, rounds)
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
            if large:
                await large_size(report, state.url, out, large, baseline, large_rounds)
        finally:
            broker.stop()
    report.print("ratio: throughput vs. the count-only scan above it")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--baseline", metavar="REV", help="also rebuild with the code of this commit, before/after")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved before/after rounds with --baseline")
    parser.add_argument("--large", type=int, default=0, metavar="ROLLOUTS",
                        help="then rebuild this many rollouts too (on topics of their own; 100000: 490,000 events)")
    parser.add_argument("--large-rounds", type=int, default=1, help="before/after rounds at the --large size")
    args = parser.parse_args()
    asyncio.run(main(args.rollouts, args.baseline, args.rounds, args.large, args.large_rounds))

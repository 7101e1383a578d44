"""The trainer's update on 1 vs 2 Ray ranks (FSDP2 over gloo), on the tiny model, in the same run.

For each number of ranks, on the same batches: samples/s and tokens/s of the update (median of the
repeats; the ratio to one rank is the figure, since these 2 cores are shared), the share of a
rank's step spent in collectives (FSDP's all-gathers and reduce-scatters and the gradient norm's
all-reduce, from the torch profiler: the union of those events' intervals), and the peak resident
memory of a rank process against the one-process update's (measured in a child process each).
One process is `grpo.Policy` in a child process; "1 rank" is the sharded path with N=1 (Ray actor,
FSDP2 on a group of one), so the Ray/FSDP overhead shows apart from the split.

    uv run python -m bench.ranks [--repeats 5] [--groups 8] [--group-size 8] [--completion 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.report import Report


def batch(model_dir: Path, groups: int, group_size: int, completion: int):
    from agentstream.trainer.batcher import Sample, group_of
    from bench.trainer_throughput import make_events

    events = make_events(groups, group_size, completion, seed=0, prefix="g")
    return [Sample(e.id, 0, i, e.data, group_of(e.id, e.data)) for i, e in enumerate(events)]


def one_process(model_dir: str, args: dict) -> dict:
    """Runs in a child process: the in-process update, timed, with its peak memory."""
    import resource

    import torch

    from agentstream.trainer.grpo import Policy
    from agentstream.trainer.settings import TrainerSettings

    samples = batch(Path(model_dir), args["groups"], args["group_size"], args["completion"])
    settings = TrainerSettings(group_size=args["group_size"], lr=1e-3, dtype="float32", torch_threads=1)
    torch.set_num_threads(1)
    policy = Policy.load(Path(model_dir), settings)
    times = []
    for round_ in range(args["repeats"] + 1):
        started = time.perf_counter()
        metrics = policy.update(samples)
        if round_:
            times.append(time.perf_counter() - started)
    return {"seconds": statistics.median(times), "tokens": metrics["tokens"], "samples": len(samples),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class Collectives:
    """Wall time spent inside collectives (FSDP's all-gathers and reduce-scatters, the norm's
    all-reduce), from the torch profiler: the union of those events' intervals on this rank."""

    NAMES = ("all_gather", "allgather", "reduce_scatter", "allreduce", "all_reduce", "broadcast", "c10d::")

    def __enter__(self) -> Collectives:
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self.profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profiler.__exit__(*exc)
        spans = sorted((e.time_range.start, e.time_range.end) for e in self.profiler.events()
                       if any(name in e.name.lower() for name in self.NAMES))
        total, reach = 0, None
        for start, end in spans:  # the union of intervals: nested and overlapping events count once
            if reach is None or start > reach:
                total += end - start
                reach = end
            elif end > reach:
                total += end - reach
                reach = end
        self.seconds = total / 1e6


def profiled_policy():
    """`RankedPolicy` whose ranks time their update, its time in collectives and their peak memory (the
    classes are made here, once the trainer is imported, and Ray ships them by value)."""
    from agentstream.trainer.ranks import Rank, RankedPolicy

    class ProfiledRank(Rank):
        def train(self, shard):
            with Collectives() as collectives:
                started = time.perf_counter()
                history = super().train(shard)
                elapsed = time.perf_counter() - started
            self.profile = {"step_s": elapsed, "collectives_s": collectives.seconds, "max_rss_mb": _max_rss_mb()}
            return history

        def last_profile(self) -> dict:
            return self.profile

    class ProfiledPolicy(RankedPolicy):
        rank_class = ProfiledRank

    return ProfiledPolicy


def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ranked(model_dir: Path, ranks: int, address: str, args: dict) -> dict:
    import ray

    from agentstream.trainer.settings import TrainerSettings

    samples = batch(model_dir, args["groups"], args["group_size"], args["completion"])
    settings = TrainerSettings(group_size=args["group_size"], lr=1e-3, dtype="float32", torch_threads=1,
                               ranks=ranks, ray_address=address)
    policy = profiled_policy().load(model_dir, settings)
    try:
        times, profiles = [], []
        for round_ in range(args["repeats"] + 1):
            started = time.perf_counter()
            metrics = policy.update(samples)
            if round_:
                times.append(time.perf_counter() - started)
                profiles.append(ray.get([rank.last_profile.remote() for rank in policy.ranks]))
    finally:
        policy.close()
    share = statistics.median(max(p["collectives_s"] / p["step_s"] for p in per_rank) for per_rank in profiles)
    return {"seconds": statistics.median(times), "tokens": metrics["tokens"], "samples": len(samples),
            "collectives_share": share, "max_rss_mb": max(p["max_rss_mb"] for p in profiles[-1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion", type=int, default=64)
    args = vars(parser.parse_args(argv))
    import ray
    from transformers.utils import logging as hf_logging

    from agentstream.models.tiny_model import build_tiny_model
    from agentstream.trainer.ranks import LocalRay, join_with_token

    hf_logging.set_verbosity_error()
    report = Report("ranks")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        code = (f"import json, sys; from bench.ranks import one_process; "
                f"print(json.dumps(one_process({str(model_dir)!r}, {args!r})))")
        single = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                           text=True).stdout.strip().splitlines()[-1])
        local = LocalRay(cpus=2, temp_dir=Path(tmp) / "ray")
        address = local.start()
        join_with_token()
        ray.init(address=address, _node_ip_address="127.0.0.1", logging_level="WARNING")
        try:
            results = {n: ranked(model_dir, n, address, args) for n in (1, 2)}
        finally:
            ray.shutdown()
            local.stop()
    results = {"process": single, **results}
    print(f"tiny model, {single['samples']} samples, {single['tokens']:.0f} generated tokens per update, "
          f"{args['repeats']} timed updates each")
    for name, r in results.items():
        label = "one process" if name == "process" else f"{name} rank{'s' if name != 1 else ''}"
        ratio = results["process"]["seconds"] / r["seconds"]
        report.add(f"{label}: samples/s", f"{r['samples'] / r['seconds']:.1f}", ratio)
        report.add(f"{label}: tokens/s", f"{r['tokens'] / r['seconds']:.0f}", ratio)
        if "collectives_share" in r:
            report.add(f"{label}: share of the step in collectives", f"{r['collectives_share']:.0%}")
        report.add(f"{label}: peak memory per process", f"{r['max_rss_mb']:.0f} MB",
                   r["max_rss_mb"] / results["process"]["max_rss_mb"])
    report.details = {"args": args, "results": {str(k): v for k, v in results.items()}}
    report.print("ratio vs. the one-process update (speed) or its peak memory (memory)")


if __name__ == "__main__":
    main()

"""`python -m bench [NAME …]` (`make bench`): run the benchmarks, each as `python -m bench.NAME`.

Each prints a table and writes bench/results/NAME.json; figures are ratios against a baseline
measured in the same run, because these machines are noisy. Before and after a change, each run whole
in two checkouts alternately: `python -m bench.compare` (bench/README.md).
"""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = {
    "gateway_overhead": "the gateway's added latency and throughput against calling the upstream directly",
    "streams_assembly": "events per second one streams worker assembles, finish-to-trajectory delay",
    "query": "call events per second into polars and through SQL, from Kafka and from the Parquet archive; bytes per event",
    "decode": "CPU per call event to decode records into a polars frame of all columns, its parts, and native JSON readers",
    "dashboard": "time to first render of the dashboard's views on a million events, against `agentstream sql`",
    "session_fold": "CPU per session event in the fold against a scored attempt's (with --baseline REV: before/after)",
    "streams_state": "a streams worker's RSS and recovery after kill -9 against days of sessions, memory vs disk store",
    "due_pass": "the streams worker's pass over its state from RocksDB (the due index): the loop held at once vs in slices",
    "replay": "raw events per second a replay rebuilds into trajectories (topic, Parquet, new reward; from the archive)",
    "controller_launch": "how fast the controller launches attempts",
    "trainer_throughput": "trainer samples per second, and the update's share of its time",
    "trainer_signal": "an update's time when few groups have signal (rows with advantage 0 are not run) vs every group",
    "trainer_dtype": "the trainer's forward and backward under bfloat16 autocast vs float32 on this CPU",
    "trainer_memory": "the trainer's estimated peak memory (trainer/memory.py) vs its measured peak RSS of an update",
    "tenant_trainers": "tenants' LoRA adapters: one trainer process with every adapter vs a process per tenant (memory, "
                       "update time, 1 and 3 tenants)",
    "sandbox_overhead": "the local sandbox's start-up and per-command cost against a bare subprocess",
    "sandbox_limits": "the local sandbox's cgroup and workspace disk: start-up, per-command and close cost against rlimits alone",
    "swe_grading": "seconds per grading in a fresh sandbox vs. the bare test run; coding tasks built per minute",
    "smollm2": "SmolLM2-135M trainer tokens/s (full, LoRA) vs a supervised step; its swap pause vs the tiny model's",
    "lora_serving": "a tenant's adapter loaded at run time vs a full weight reload; memory per adapter; throughput with 1/4/16 adapters vs the base",
    "partial_rollouts": "rollout throughput and weight-update latency with --partial-rollouts vs holding the update, "
                        "same run, same server",
    "ranks": "the trainer's update on 1 vs 2 Ray ranks (FSDP2/gloo): samples/s, share in collectives, memory",
    "trainer_learning": "how fast the trainer's update teaches the tiny model the demo's task",
    "distill": "on-policy distillation (a vLLM teacher's logprobs) vs plain GRPO from the same tiny student, same "
                "wall time, sparse reward: held-out pass@1 by version",
    "canary_sequential": "false promotions, false rollbacks and power of the canary rule over thousands of simulated canaries",
    "capacity": "per-process rates (gateway, streams worker, grader, trainer rank) rerun quickly, and the processes, "
                "partitions, brokers and GPUs 1,000 and 10,000 agents need (docs/scaling.md)",
    "recipe_swe": "the coding recipe's rollouts per minute and where the time goes, vs. a scripted agent",
    "cluster_chaos": "the loop on three brokers, one broker, gateway, streams worker and the trainer killed -9 in turn: lost, doubled",
}
ON_DEMAND = {
    "recipe_long": "the coding recipe's long run: the one command for --hours, stopped cleanly, a ledger of segments "
                   "in its run folder; --plot: validation pass@1 by version with its interval, per arm",
}
"""run only when named, with their own arguments (`python -m bench recipe_long --hours 2.5 -- …`): hours, not a
measurement `make bench` repeats"""


def main(argv: list[str]) -> int:
    if argv and argv[0] in ON_DEMAND:
        print(f"== bench.{argv[0]}: {ON_DEMAND[argv[0]]}", flush=True)
        return subprocess.run([sys.executable, "-m", f"bench.{argv[0]}", *argv[1:]]).returncode
    names = argv or list(BENCHMARKS)
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from: {', '.join([*BENCHMARKS, *ON_DEMAND])}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"\n== bench.{name}: {BENCHMARKS[name]}", flush=True)
        if subprocess.run([sys.executable, "-m", f"bench.{name}"]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Capacity model: what one process of each service does on this machine, and how many processes,
partitions and brokers a deployment of N concurrent agents needs (docs/scaling.md).

Per-process rates, each measured by rerunning an existing benchmark on a short setting, in a child
process of its own, one after the other:

- gateway: calls/s per core = 1 / the gateway's CPU per call at its most calls/s, durable (`ack`)
  publishing (`bench.gateway_overhead`); and the broker's CPU per call, the same run;
- streams worker: events/s per core = 1 / the worker's CPU per event while it catches up on a backlog
  (`bench.streams_assembly`);
- grader: trajectories/s per worker = 1 / seconds per grading of a coding task in a fresh sandbox,
  second opinion on (`bench.swe_grading`);
- trainer rank on CPU: tokens/s of SmolLM2-135M's GRPO update in one process (`bench.smollm2`);
- a call event's bytes at the assumed call shape, encoded here.

GPU figures (inference and training of a 7-8 B model) are the field's published ones, each named with
its source (`PUBLISHED`); they are not measured here. The model's inputs are flags (the agents' call
rate and tokens per call, calls per trajectory, target utilisation); its outputs are the processes
per part, partitions, brokers and GPUs, the first bottleneck of a deployment with the default counts,
and the setting that moves it.

    uv run python -m bench capacity        # or: python -m bench.capacity [--agents 1000,10000]
    python -m bench.capacity --rates bench/results/capacity.json   # the model again on measured rates
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from bench.report import RESULTS, Report

PUBLISHED = {
    "inference_tokens_per_gpu_s": (
        12_500, "output tokens/s of vLLM serving Llama-3.1-8B (bf16) on one H100 80GB at high concurrency "
                "(third-party benchmarks collected at https://www.morphllm.com/vllm-benchmarks; Lambda's "
                "github.com/LambdaLabsML/vllm-benchmark reports the same order)"),
    "gpu_peak_flops": (989e12, "H100 SXM dense BF16 tensor-core peak, NVIDIA H100 datasheet (1,979 TFLOPS with sparsity)"),
    "training_mfu": (0.40, "model FLOPs utilisation of BF16 training on H100s: 38-43 % in The Llama 3 Herd of Models "
                           "(arXiv 2407.21783, Table 4)"),
}
"""GPU figures from the field, not measured here: (value, source)"""

DEFAULT_COUNTS = {"gateway": 2, "streams": 2, "partitions": 8, "brokers": 3}
"""the Helm chart's defaults (deploy/helm/agentstream/values.yaml; brokers: the least for replication 3):
where the first bottleneck is looked for"""


@dataclass
class Rates:
    """Per-process figures measured on this machine."""

    gateway_calls_per_core_s: float
    broker_cpu_ms_per_call: float
    streams_events_per_core_s: float
    grading_s: float
    trainer_tokens_per_rank_s: float
    call_event_bytes: int
    cpus: int
    load_average: float


@dataclass
class Workload:
    """The assumed agents (flags)."""

    call_rate: float  # calls per agent per second
    prompt_tokens: int  # per call, the whole context sent
    new_prompt_tokens: int  # per call, what the previous turns did not already hold (prefill after the cache)
    completion_tokens: int  # per call
    calls_per_trajectory: int
    events_per_trajectory: int  # besides its calls: rollout queued/started/finished, reward
    utilisation: float  # the share of a process's measured rate a deployment plans to use
    replication: int
    broker_mb_s: float  # produced + replica bytes one broker takes (an assumption, see --broker-mb-s)
    model_params: float  # the trained and served model, for the GPU figures


# --- measuring (each a child process on a short setting) -------------------------------------------


def child(args: list[str], timeout: float = 900) -> str:
    """`python ARGS`'s standard output, once it has exited. Its output goes to files, not pipes: reading a pipe to its
    end waits for every process that holds it, and a child leaves some behind holding its stderr (the sandbox's
    warden keeps it by design until it has cleaned up after its host; a server a failed benchmark did not stop)."""
    started = time.monotonic()
    print(f"$ python {' '.join(args)}", flush=True)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        done = subprocess.run([sys.executable, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                              timeout=timeout)
        stdout, stderr = read_from_start(out), read_from_start(err)
    if done.returncode:
        raise SystemExit(f"`{' '.join(args)}` failed ({done.returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}")
    print(f"  done in {time.monotonic() - started:.0f} s", flush=True)
    return stdout


def read_from_start(file: IO[str]) -> str:
    file.seek(0)
    return file.read()


def gateway_rates(work: Path) -> tuple[float, float]:
    """(gateway calls/s per core, broker CPU ms per call) at the gateway's most calls/s, `ack` mode."""
    out = work / "gateway.json"
    child(["-m", "bench.gateway_overhead", "--seconds", "2", "--rounds", "1", "--levels", "16",
           "--throughput-clients", "64", "--json", str(out)])
    cpu = json.loads(out.read_text())["cpu_ms_per_call"]["ack"]
    return 1000 / cpu["gateway"], cpu.get("kafka", float("nan"))


def streams_rate() -> float:
    """The worker's events per CPU second while it assembles a backlog."""
    child(["-m", "bench.streams_assembly", "--rollouts", "600", "--seconds", "6", "--warm-up-s", "3", "--one-broker"])
    return streams_rate_measured()


def streams_rate_measured() -> float:
    """The same, from the benchmark's last results file."""
    results = json.loads((RESULTS / "streams_assembly.json").read_text())["details"]
    cpu = results["after"]["catch_up"]["worker_cpu"]
    if not cpu:  # no /proc: the wall-clock rate, a lower bound
        return float(results["after"]["worker_events_per_s"])
    return float(results["events"] / cpu["cpu_s"])


def grading_seconds() -> float:
    """Median seconds one grader worker spends per trajectory (a fresh sandbox, second opinion on)."""
    child(["-m", "bench.swe_grading", "--tasks", "2"])
    return grading_seconds_measured()


def grading_seconds_measured() -> float:
    graded = json.loads((RESULTS / "swe_grading.json").read_text())["details"]["graded_s"]["second opinion on"]
    return float(sorted(graded)[len(graded) // 2])


def trainer_rate() -> float:
    """Tokens/s of one CPU trainer process (a rank's work) on SmolLM2-135M's GRPO update."""
    out = child(["-m", "bench.smollm2", "--child", "full", "--repeats", "2"])
    return float(json.loads(out.strip().splitlines()[-1])["grpo_tokens_s"])


def call_event_bytes(prompt: int, completion: int) -> int:
    """One call event as the gateway writes it, at the assumed shape: the prompt's and the completion's
    text (~4 characters a token) and token ids, one logprob per completion token."""
    import agentstream.schemas as s

    rng = random.Random(0)
    words = lambda n: " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=3)) for _ in range(n))  # noqa: E731
    event = s.CallEvent(source="gateway", rollout_id="r" * 32, attempt_id="a" * 32, data=s.Call(
        api="chat.completions", model="policy", upstream="http://vllm-0:8000", weight_version=12, status=200,
        request={"model": "policy", "messages": [{"role": "user", "content": words(prompt)}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": words(completion)}}]},
        prompt_token_ids=[rng.randrange(100, 150_000) for _ in range(prompt)],
        completion_token_ids=[rng.randrange(100, 150_000) for _ in range(completion)],
        logprobs=[-rng.uniform(0, 8) for _ in range(completion)], finish_reason="stop",
        usage=s.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
        started_at=0, latency_ms=5000.0))
    return len(s.encode(event))


def measure(workload: Workload) -> Rates:
    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        gateway, broker = gateway_rates(Path(tmp))
    return Rates(gateway_calls_per_core_s=gateway, broker_cpu_ms_per_call=broker,
                 streams_events_per_core_s=streams_rate(), grading_s=grading_seconds(),
                 trainer_tokens_per_rank_s=trainer_rate(),
                 call_event_bytes=call_event_bytes(workload.prompt_tokens, workload.completion_tokens),
                 cpus=os.cpu_count() or 1, load_average=os.getloadavg()[0])


# --- the model -------------------------------------------------------------------------------------


def processes(load: float, rate: float, utilisation: float, least: int = 1) -> int:
    return max(least, math.ceil(load / (rate * utilisation)))


def deployment(agents: int, rates: Rates, w: Workload) -> dict[str, float]:
    """What `agents` concurrent agents need: per part, its load and its processes (one core each)."""
    calls = agents * w.call_rate
    trajectories = calls / w.calls_per_trajectory
    events = calls + trajectories * w.events_per_trajectory
    trained_tokens = calls * (w.new_prompt_tokens + w.completion_tokens)  # each token of a trajectory once
    gateways = processes(calls, rates.gateway_calls_per_core_s, w.utilisation, least=2)
    workers = processes(events, rates.streams_events_per_core_s, w.utilisation, least=2)
    # the calls and the trajectories (which carry the calls' tokens again) are most of the log's bytes
    log_mb_s = 2 * calls * rates.call_event_bytes / 1e6
    brokers = max(3, math.ceil(log_mb_s * w.replication / w.broker_mb_s))
    partitions = 2 * max(workers, brokers)  # the most consumers of one group ×2, as docs/scaling.md says
    partitions = math.ceil(partitions / brokers) * brokers  # leaders spread evenly over the brokers
    train_flops_per_token = 6 * w.model_params  # forward and backward (Kaplan et al.); old logprobs come with the rollout
    gpu_train_tokens_s = PUBLISHED["training_mfu"][0] * PUBLISHED["gpu_peak_flops"][0] / train_flops_per_token
    return {
        "agents": agents, "calls_per_s": calls, "events_per_s": events, "trajectories_per_s": trajectories,
        "generated_tokens_per_s": calls * w.completion_tokens, "trained_tokens_per_s": trained_tokens,
        "log_mb_per_s": log_mb_s, "log_tb_per_day": log_mb_s * 86_400 / 1e6,
        "gateway_processes": gateways, "streams_workers": workers, "partitions": partitions, "brokers": brokers,
        "broker_cores_for_calls": calls * rates.broker_cpu_ms_per_call / 1000 * w.replication,
        "grader_workers": processes(trajectories * rates.grading_s, 1.0, w.utilisation),
        "trainer_cpu_ranks": processes(trained_tokens, rates.trainer_tokens_per_rank_s, w.utilisation),
        "inference_gpus": processes(calls * w.completion_tokens, PUBLISHED["inference_tokens_per_gpu_s"][0],
                                    w.utilisation),
        "trainer_gpus": processes(trained_tokens, gpu_train_tokens_s, w.utilisation),
    }


def first_bottleneck(rates: Rates, w: Workload) -> list[tuple[str, float, str]]:
    """Agents each CPU part carries with the default counts (DEFAULT_COUNTS), fewest first, and the setting
    that moves each limit."""
    per_agent_calls = w.call_rate
    per_agent_events = w.call_rate * (1 + w.events_per_trajectory / w.calls_per_trajectory)
    per_agent_mb = 2 * w.call_rate * rates.call_event_bytes / 1e6 * w.replication
    per_worker = rates.streams_events_per_core_s * w.utilisation / per_agent_events
    limits = [
        ("gateway", DEFAULT_COUNTS["gateway"] * rates.gateway_calls_per_core_s * w.utilisation / per_agent_calls,
         "gateway.replicas (stateless: add replicas)"),
        ("streams", DEFAULT_COUNTS["streams"] * per_worker,
         f"streams.replicas, up to kafka.partitions ({DEFAULT_COUNTS['partitions']}: "
         f"{DEFAULT_COUNTS['partitions'] * per_worker:,.0f} agents), which is fixed at topic creation"),
        ("brokers", DEFAULT_COUNTS["brokers"] * w.broker_mb_s / per_agent_mb,
         "brokers; the call event's size (token ids and logprobs are most of it)"),
    ]
    return sorted(limits, key=lambda limit: limit[1])


# --- output ----------------------------------------------------------------------------------------


def show(rates: Rates, workload: Workload, agents: list[int]) -> None:
    report = Report("capacity")
    report.add("gateway: calls/s per core (durable acks; 1 / its CPU per call)", f"{rates.gateway_calls_per_core_s:,.0f}")
    report.add("broker: CPU per call (one broker, replication 1)", f"{rates.broker_cpu_ms_per_call:.3f} ms")
    report.add("streams worker: events/s per core (catching up)", f"{rates.streams_events_per_core_s:,.0f}")
    report.add("grader worker: trajectories/s (a coding task in a fresh sandbox)",
               f"{1 / rates.grading_s:.2f} ({rates.grading_s:.1f} s each)")
    report.add("trainer rank on CPU: tokens/s (SmolLM2-135M, GRPO)", f"{rates.trainer_tokens_per_rank_s:,.0f}")
    report.add(f"call event at {workload.prompt_tokens}+{workload.completion_tokens} tokens", f"{rates.call_event_bytes:,} B")
    for name, (value, source) in PUBLISHED.items():
        report.add(f"published: {name}", f"{value:,.4g} — {source}")
    for n in agents:
        d = deployment(n, rates, workload)
        report.add(f"{n:,} agents: calls/s, events/s, trajectories/s",
                   f"{d['calls_per_s']:,.0f}, {d['events_per_s']:,.0f}, {d['trajectories_per_s']:,.1f}")
        report.add(f"{n:,} agents: gateways, streams workers, partitions, brokers",
                   f"{d['gateway_processes']}, {d['streams_workers']}, {d['partitions']}, {d['brokers']}")
        report.add(f"{n:,} agents: log MB/s (TB/day, before replication)",
                   f"{d['log_mb_per_s']:,.0f} ({d['log_tb_per_day']:,.1f})")
        report.add(f"{n:,} agents: grader workers, trainer ranks on CPU",
                   f"{d['grader_workers']:,}, {d['trainer_cpu_ranks']:,}")
        report.add(f"{n:,} agents: GPUs (published rates): inference, training",
                   f"{d['inference_gpus']:,}, {d['trainer_gpus']:,}")
        report.details[f"agents_{n}"] = d
    for part, carried, setting in first_bottleneck(rates, workload):
        report.add(f"Helm defaults {DEFAULT_COUNTS}: {part} carries", f"{carried:,.0f} agents; moved by {setting}")
    report.details.update(rates=asdict(rates), workload=asdict(workload),
                          published={name: {"value": v, "source": src} for name, (v, src) in PUBLISHED.items()})
    report.print("figures measured on this machine unless marked published")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=lambda text: [int(x) for x in text.split(",")], default=[1000, 10000])
    parser.add_argument("--call-rate", type=float, default=0.1, help="calls per agent per second (a call every 10 s)")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="context sent per call")
    parser.add_argument("--new-prompt-tokens", type=int, default=200, help="of it, new per call (tool output)")
    parser.add_argument("--completion-tokens", type=int, default=400, help="generated per call")
    parser.add_argument("--calls-per-trajectory", type=int, default=20)
    parser.add_argument("--utilisation", type=float, default=0.5, help="share of a measured rate to plan on")
    parser.add_argument("--replication", type=int, default=3)
    parser.add_argument("--broker-mb-s", type=float, default=100.0, help="bytes a broker takes in, replicas included "
                        "(an assumption: a share of one VM's disk and network; measure your own)")
    parser.add_argument("--model-params", type=float, default=8e9, help="the policy's parameters (GPU figures)")
    parser.add_argument("--rates", type=Path, help="a capacity.json of an earlier run: its rates, not measured again")
    args = parser.parse_args(argv)
    workload = Workload(call_rate=args.call_rate, prompt_tokens=args.prompt_tokens,
                        new_prompt_tokens=args.new_prompt_tokens, completion_tokens=args.completion_tokens,
                        calls_per_trajectory=args.calls_per_trajectory, events_per_trajectory=4,
                        utilisation=args.utilisation, replication=args.replication, broker_mb_s=args.broker_mb_s,
                        model_params=args.model_params)
    if args.rates:
        rates = Rates(**json.loads(args.rates.read_text())["details"]["rates"])
        rates.call_event_bytes = call_event_bytes(workload.prompt_tokens, workload.completion_tokens)
    else:
        rates = measure(workload)
    show(rates, workload, args.agents)


if __name__ == "__main__":
    main()

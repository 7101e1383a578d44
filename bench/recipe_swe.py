"""The coding recipe's throughput here: rollouts per minute and where an attempt's time goes.

One run, one stack (Kafka, vLLM, gateway, streams worker, grader service, trainer), the same tasks:
  - the recipe: mini-swe-agent on the model through the gateway, commands in bubblewrap;
  - the baseline: the same harness with a scripted agent (mini-swe-agent's deterministic model running
    a fixed list of commands): same sandbox, same diff, same grading, no model.
The ratio (recipe rollouts per minute ÷ scripted ones) is what the model costs. Per attempt, the time
is split into model (the gateway's call latencies), commands (time inside the sandbox), harness (the
rest: checkout, mini-swe-agent, the diff); grading is the grader service's time per diff, training the
trainer's update time for one version of the recipe's trajectories. The shares of the run's wall time
(generation, harness, grading, training) add the parts up over every attempt of the recipe arm.

Updates: tokens per second of a GRPO update with LoRA adapters (`Policy.update`, rank 16) against a plain
supervised step of every weight (forward, cross-entropy on the generated tokens, backward, AdamW) on the
same tensors: `--update-sequences` of the recipe arm's trajectories cut to `--update-seq-len` tokens (the
plain step takes them in one forward, as `bench.trainer_throughput`'s baseline does; small by default: a
0.5B's forward and backward over 2,000 tokens takes minutes on two shared cores). One model in memory at a
time (a 0.5B's full AdamW state is ~10 GB), the two alternating `--update-repeats` times, median reported
(the first step of each includes its one-time allocations alike).
`--updates-from FILE` (trajectory events, one encoded event a line) measures only that.

    uv run python -m bench.recipe_swe [--model qwen-coder-0.5b|smollm2|tiny] [--tasks 3] [--samples 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from rich.console import Console

from agentstream.demo.loop import Stack
from agentstream.demo.overrides import given
from agentstream.recipes.swe.models import build_base_model
from agentstream.recipes.swe.recipe import HARNESS, Recipe, RecipeConfig
from agentstream.recipes.swe.task_files import build_recipe_tasks
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import CallEvent, RewardEvent, RolloutDiffEvent, TrajectoryEvent, WeightsEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import scan
from agentstream.stack.process import free_port
from agentstream.stack.service import Service
from agentstream.trainer.settings import TrainerSettings
from bench.report import Report

SCRIPT = ["ls", "grep -rn 'def ' --include=*.py . | head -20", "git status --short",
          "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]


class Bench(Recipe):
    async def measure(self, args) -> dict:
        config = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        kafka = await self.topics()
        self.tasks = build_recipe_tasks(self.out / "tasks", args.tasks, 1, say=self.say)
        train = self.tasks[0]
        model_dir = self.base_model()
        stack = Stack(kafka=kafka, model_dir=model_dir, servers=self.inference(model_dir), gateway_port=free_port(),
                      token_secret=secrets.token_urlsafe(24), api_key=secrets.token_urlsafe(24), out=self.out)
        for service in self.grading(stack).services():
            self.start(service)
        await self.await_http("gateway", f"{stack.gateway_url}/healthz")
        env = self.harness(stack).env()
        arms = {}
        for arm, extra in (("scripted", {"AGENTSTREAM_SWE_SCRIPT": json.dumps(SCRIPT)}), ("recipe", {})):
            rollouts = args.tasks * args.samples
            self.say(f"{arm}: {rollouts} rollouts")
            started = time.monotonic()
            controller = stack.controller(tasks=train, agent=HARNESS, samples=args.samples, run_id=f"bench-{arm}",
                                          max_attempts=1, concurrency=config.concurrency, model=self.served,
                                          timeout_s=config.attempt_timeout_s, logs_dir=self.out / "attempts")
            run = self.start(Service(f"controller-{arm}", "agentstream.controller", controller, env={**env, **extra}))
            while run.process.poll() is None:
                self.check_alive()
                await asyncio.sleep(0.5)
            arms[arm] = await self.collect(kafka, f"bench-{arm}", rollouts, time.monotonic() - started)
        # the trainer service is started after the stack stops serving: on two cores it would share them with vLLM
        self.vllm.stop()
        arms["training_s"] = await self.train_once(stack) if args.train else None
        arms["trained_tokens"] = sum(len(seq.token_ids[:config.trainer().max_seq_len]) for t in self.recipe_trajectories
                                     for seq in t.data.sequences if t.data.reward is not None)
        self.model_dir = model_dir
        return arms

    async def collect(self, kafka: KafkaSettings, run_id: str, rollouts: int, wall_s: float) -> dict:
        """Per attempt: model, command and grading time, from the log (waits for every trajectory)."""
        deadline = time.monotonic() + 600
        while True:
            events = []
            for base in ("rollouts", "calls", "rewards", "trajectories"):
                async for batch in scan(kafka, kafka.topics.name(base)):
                    for record in batch:
                        try:
                            events.append(decode(record.value))
                        except DecodeError:
                            pass
            mine = {e.rollout_id for e in events if e.type == "rollout.queued" and _run_of(e) == run_id}
            done = [e for e in events if isinstance(e, TrajectoryEvent) and e.rollout_id in mine]
            if len(done) >= rollouts or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        model = defaultdict(float)
        for e in events:
            if isinstance(e, CallEvent) and e.rollout_id in mine:
                model[e.rollout_id] += e.data.latency_ms / 1000
        diffs = {e.rollout_id: e.data for e in events if isinstance(e, RolloutDiffEvent) and e.rollout_id in mine}
        grading = [e.data.details.get("timings_s", {}).get("total", 0.0) for e in events
                   if isinstance(e, RewardEvent) and e.rollout_id in mine and e.source == "grader"]
        if run_id == "bench-recipe":
            self.recipe_trajectories = done
        durations = {t.rollout_id: (t.data.duration_ms or 0) / 1000 for t in done}
        commands = {r: d.details.get("command_s", 0.0) for r, d in diffs.items()}
        mean = lambda values: statistics.fmean(values) if values else 0.0  # noqa: E731
        attempt_s = mean(list(durations.values()))
        return {"rollouts": len(done), "wall_s": round(wall_s, 1), "per_minute": round(60 * len(done) / wall_s, 2),
                "attempt_s": round(attempt_s, 2), "model_s": round(mean(list(model.values())) if model else 0.0, 2),
                "commands_s": round(mean(list(commands.values())), 2), "grading_s": round(mean(grading), 2),
                "attempt_total_s": round(sum(durations.values()), 1), "model_total_s": round(sum(model.values()), 1),
                "commands_total_s": round(sum(commands.values()), 1), "grading_total_s": round(sum(grading), 1),
                "generated_tokens": sum(len(turn.completion_token_ids) for t in done for turn in t.data.turns),
                "outcomes": dict(sorted(_count(d.outcome for d in diffs.values()).items())),
                "rewards": [t.data.reward for t in done]}

    async def train_once(self, stack: Stack) -> float | None:
        """The trainer's update time for one version made of the recipe arm's trajectories."""
        kafka = stack.kafka
        trainer = stack.settings(TrainerSettings, model=self.served, base_model=stack.model_dir,
                                 checkpoint_dir=self.out / "checkpoints", group_size=self.bench_args.samples,
                                 groups_per_batch=1, min_group_size=1, max_versions=1, micro_batch_size=1,
                                 **given(self.config.trainer()))
        self.start(Service("trainer", "agentstream.trainer", trainer))
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            async for batch in scan(kafka, kafka.topics.weights):
                for record in batch:
                    event = decode(record.value)
                    if isinstance(event, WeightsEvent):
                        return round(event.data.metrics.get("train_s", 0.0), 2)
            self.check_alive()
            await asyncio.sleep(2)
        return None


def wall_shares(arm: dict, training_s: float) -> dict[str, float]:
    """Where the recipe's time goes, added up over its attempts (as if one after another): generation (the
    model calls), harness (the rest of each attempt: checkout, mini-swe-agent, the commands, the diff),
    grading (the grader's time per diff) and one version's training."""
    parts = {"generation": arm["model_total_s"], "harness": arm["attempt_total_s"] - arm["model_total_s"],
             "grading": arm["grading_total_s"], "training": training_s}
    total = sum(parts.values()) or 1.0
    return {part: seconds / total for part, seconds in parts.items()}


def update_rates(model_dir: Path, trajectories: list[TrajectoryEvent], seq_len: int, repeats: int,
                 sequences: int = 4) -> dict:
    """Tokens per second of a LoRA GRPO update and of a plain supervised step, on the same tensors."""
    import gc

    import torch

    from agentstream.trainer.batcher import Sample, group_of
    from agentstream.trainer.grpo import Policy, to_tensors
    from bench.trainer_throughput import supervised_step

    samples, rows = [], 0
    for t in trajectories:  # a sequence whose generated tokens all lie past seq_len is no row
        trained = sum(1 for seq in t.data.sequences if any(seq.mask[1:seq_len]))
        if t.data.reward is not None and trained and rows < sequences:
            samples.append(Sample(t.id, 0, len(samples), t.data, group_of(t.id, t.data)))
            rows += trained
    if not samples:
        return {}
    batch = to_tensors(samples, seq_len)
    tokens = int(batch.attention_mask.sum())
    arms = {"lora_update": TrainerSettings(lora_rank=16, lr=1e-4, max_seq_len=seq_len, group_size=len(samples),
                                           min_group_size=1, micro_batch_size=1),
            "supervised_step": TrainerSettings(lr=1e-5, max_seq_len=seq_len, micro_batch_size=1)}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, settings in arms.items():
            policy = Policy.load(model_dir, settings)
            started = time.perf_counter()
            if name == "lora_update":
                policy.update(samples)
            else:
                supervised_step(policy.model, policy.optimizer, batch)
            seconds[name].append(time.perf_counter() - started)
            del policy
            gc.collect()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {"sequences": batch.rows, "tokens": tokens, "generated_tokens": int(batch.loss_mask.sum()),
            "torch_threads": torch.get_num_threads(), "seconds": seconds,
            **{f"{name}_tokens_per_s": round(tokens / median[name], 1) for name in arms}}


def _read_events(path: Path) -> list[TrajectoryEvent]:
    events = [decode(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [event for event in events if isinstance(event, TrajectoryEvent)]


def _run_of(event) -> str:
    from agentstream.schemas.ids import derived_id

    queued = event.data
    for run_id in ("bench-recipe", "bench-scripted"):
        if queued.group_id == derived_id(run_id, "group", queued.split, queued.task.id, str(queued.epoch)):
            return run_id
    return ""


def _count(values) -> dict:
    counts: dict = defaultdict(int)
    for value in values:
        counts[value] += 1
    return counts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recipe_swe")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--step-limit", type=int, default=None, help="default: the model's (recipes/swe/models.py)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the model's")
    parser.add_argument("--attempt-timeout-s", type=float, default=None, help="default: the model's")
    parser.add_argument("--vllm-name", default="bench-recipe",
                        help="the local vLLM server's name: one running under it with this model is reused (reset to "
                             "the starting weights); stopped at the end")
    parser.add_argument("--update-seq-len", type=int, default=512, help="tokens per sequence in the update figures")
    parser.add_argument("--update-sequences", type=int, default=2, help="sequences in the update figures")
    parser.add_argument("--update-repeats", type=int, default=1)
    parser.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                        help="train one version with the trainer service (--no-train: estimate its time from the "
                             "update figures; a 0.5B's update takes long on two shared cores)")
    parser.add_argument("--updates-from", type=Path, default=None,
                        help="only the update figures, on the trajectory events of this file")
    args = parser.parse_args(argv)
    if args.updates_from is not None:
        model_dir = build_base_model(args.model, Path("runs") / "bench-recipe-swe-model")
        figures = update_rates(model_dir, _read_events(args.updates_from), args.update_seq_len, args.update_repeats,
                               args.update_sequences)
        print(json.dumps(figures, indent=2))
        return 0
    config = RecipeConfig(model=args.model, step_limit=args.step_limit, max_tokens=args.max_tokens, concurrency=2,
                          attempt_timeout_s=args.attempt_timeout_s,
                          out=Path("runs") / time.strftime("bench-recipe-swe-%Y%m%d-%H%M%S"), vllm_name=args.vllm_name)
    bench = Bench(config, Console())
    bench.bench_args = args
    try:
        figures = asyncio.run(bench.measure(args))
    finally:
        bench.stop_all()
    print(json.dumps(figures), flush=True)  # the arms, before the update figures (minutes more)
    figures["updates"] = update_rates(bench.model_dir, bench.recipe_trajectories, args.update_seq_len,
                                      args.update_repeats, args.update_sequences)
    recipe, scripted = figures["recipe"], figures["scripted"]
    report = Report("recipe_swe", details=figures)
    report.add("recipe: rollouts per minute", f"{recipe['per_minute']:.2f}",
               recipe["per_minute"] / scripted["per_minute"] if scripted["per_minute"] else None)
    report.add("scripted agent (baseline): rollouts per minute", f"{scripted['per_minute']:.2f}", 1.0)
    for arm in ("recipe", "scripted"):
        figures_of = figures[arm]
        attempt = figures_of["attempt_s"] or 1.0
        for part in ("model_s", "commands_s"):
            report.add(f"{arm}: {part[:-2]} per attempt", f"{figures_of[part]:.1f} s", figures_of[part] / attempt)
        report.add(f"{arm}: grading per diff", f"{figures_of['grading_s']:.1f} s", figures_of["grading_s"] / attempt)
        report.add(f"{arm}: attempt (launch to end)", f"{attempt:.1f} s", None)
    training_s = figures["training_s"]
    if training_s is not None:
        report.add("training: one version's update", f"{training_s:.1f} s", None)
    elif figures["updates"]:  # --no-train: the recipe arm's tokens at the plain step's rate
        training_s = figures["trained_tokens"] / figures["updates"]["supervised_step_tokens_per_s"]
        report.add(f"training: one version's update, estimated ({figures['trained_tokens']} tokens at the plain "
                   "step's rate)", f"{training_s:.1f} s", None)
    for part, share in wall_shares(recipe, training_s or 0.0).items():
        report.add(f"recipe: share of the time in {part}", f"{share:.2f}", share)
    if recipe["model_total_s"]:
        report.add("recipe: generated tokens per second of model time",
                   f"{recipe['generated_tokens'] / recipe['model_total_s']:.2f}", None)
    updates = figures.get("updates") or {}
    if updates:
        lora, plain = updates["lora_update_tokens_per_s"], updates["supervised_step_tokens_per_s"]
        report.add(f"update: LoRA GRPO ({updates['sequences']} seqs, {updates['tokens']} tokens)", f"{lora:.0f} tok/s",
                   lora / plain)
        report.add("update: plain supervised step, every weight (baseline)", f"{plain:.0f} tok/s", 1.0)
    report.print("ratio: rollouts/min vs. the scripted agent; per-part rows: share of the attempt's time")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

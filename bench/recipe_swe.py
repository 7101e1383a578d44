"""The coding recipe's throughput here: rollouts per minute and where an attempt's time goes.

One run, one stack (Kafka, vLLM, gateway, streams worker, grader service, trainer), the same tasks:
  - the recipe: mini-swe-agent on the model through the gateway, commands in bubblewrap;
  - the baseline: the same harness with a scripted agent (mini-swe-agent's deterministic model running
    a fixed list of commands): same sandbox, same diff, same grading, no model.
The ratio (recipe rollouts per minute ÷ scripted ones) is what the model costs. Per attempt, the time
is split into model (the gateway's call latencies), commands (time inside the sandbox), harness (the
rest: checkout, mini-swe-agent, the diff); grading is the grader service's time per diff, training the
trainer's update time for one version of the recipe's trajectories.

    uv run python -m bench.recipe_swe [--model smollm2|tiny] [--tasks 3] [--samples 2]
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
        arms["training_s"] = await self.train_once(stack)
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
        durations = {t.rollout_id: (t.data.duration_ms or 0) / 1000 for t in done}
        commands = {r: d.details.get("command_s", 0.0) for r, d in diffs.items()}
        mean = lambda values: statistics.fmean(values) if values else 0.0  # noqa: E731
        attempt_s = mean(list(durations.values()))
        return {"rollouts": len(done), "wall_s": round(wall_s, 1), "per_minute": round(60 * len(done) / wall_s, 2),
                "attempt_s": round(attempt_s, 2), "model_s": round(mean(list(model.values())) if model else 0.0, 2),
                "commands_s": round(mean(list(commands.values())), 2), "grading_s": round(mean(grading), 2),
                "outcomes": dict(sorted(_count(d.outcome for d in diffs.values()).items())),
                "rewards": [t.data.reward for t in done]}

    async def train_once(self, stack: Stack) -> float | None:
        """The trainer's update time for one version made of the recipe arm's trajectories."""
        kafka = stack.kafka
        trainer = stack.settings(TrainerSettings, model=self.served, base_model=stack.model_dir,
                                 checkpoint_dir=self.out / "checkpoints", group_size=self.bench_args.samples,
                                 groups_per_batch=1, min_group_size=1, max_versions=1, lr=1e-5, micro_batch_size=1)
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
    parser.add_argument("--step-limit", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    config = RecipeConfig(model=args.model, step_limit=args.step_limit, max_tokens=args.max_tokens, concurrency=2,
                          attempt_timeout_s=600,
                          out=Path("runs") / time.strftime("bench-recipe-swe-%Y%m%d-%H%M%S"), vllm_name="bench-recipe")
    bench = Bench(config, Console())
    bench.bench_args = args
    try:
        figures = asyncio.run(bench.measure(args))
    finally:
        bench.stop_all()
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
    if figures["training_s"] is not None:
        report.add("training: one version's update", f"{figures['training_s']:.1f} s", None)
    report.print("ratio: rollouts/min vs. the scripted agent; per-part rows: share of the attempt's time")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

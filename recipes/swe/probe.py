"""`agentstream tasks swe probe`: how often the starting model solves each train task, before training.

GRPO learns only from groups whose attempts differ in reward: a task the model never solves, or always
solves, gives every attempt the same advantage (zero). So before a run, the starting model tries each
train task k times through the recipe's own machinery (local stack, gateway, mini-swe-agent in
sandboxes, grader, streams worker; `agentstream.eval`'s runner with the rollouts in the train split):
the attempts are in the log like any rollout (an offline `--loss sft` trainer can learn from the
successful ones), the probe's summary is an `eval` event (run id `probe-…`), and the task file is
written again with each probed task's `probe` {k, solved, model, version, run_id}.

`agentstream recipe swe --probed FILE` then trains on the tasks with mixed results plus a share of
never-solved ones (`select_train`). Validation tasks are never chosen by how the model does on them, which
would bias the number the recipe reports: `--split validation` measures a model on them (its pass@1 with a
95 % interval, e.g. of an SFT checkpoint given as `--base-model`) and writes no task file.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from rich.console import Console

from agentstream.demo.loop import Stack
from agentstream.demo.progress import Progress
from agentstream.demo.run import run_folder, run_to_summary
from agentstream.eval import EvalSettings, Evaluator, pass_at_1_interval
from agentstream.recipes.swe.build import write
from agentstream.recipes.swe.recipe import HARNESS, Recipe, RecipeConfig, RecipeLoop
from agentstream.recipes.swe.task_files import (
    Selection,
    build_recipe_tasks,
    read_instances,
    select_train,
    write_task_files,
)
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack import StackError


class ProbeConfig(RecipeConfig):
    instances_file: Path | None = None
    """the SWE-bench task file to probe; None: build `train_tasks + validation_tasks` tasks"""
    k: int = 2
    """attempts per train task"""
    probed_out: Path = Path("tasks.probed.jsonl")
    """the task file written, with each probed task's `probe`"""
    split: Literal["train", "validation"] = "train"
    """the tasks attempted: train (their probe written into the task file) or validation (measured only)"""
    out: Path = Field(default_factory=lambda: run_folder("probe-swe"))
    vllm_name: str = "probe-swe"


class Probe(Recipe):
    """The recipe's stack without trainer or eval: the train tasks' attempts, graded, then the file."""

    starting = "Starting the local stack for the probe…"

    config: ProbeConfig

    def __init__(self, config: ProbeConfig, console: Console):
        super().__init__(config, console)
        self.result: dict[str, Any] = {}

    def task_files(self) -> tuple[Path, Path, Path]:
        config = self.config
        if config.instances_file is not None:
            self.instances = read_instances(config.instances_file)
        else:
            build_recipe_tasks(self.out / "built", config.train_tasks, config.validation_tasks, say=self.say)
            self.instances = read_instances(self.out / "built" / "instances.jsonl")
        if not any(i.split == config.split for i in self.instances):
            raise StackError(f"the task set has no {config.split} task to probe")
        return write_task_files(self.instances, self.out / "tasks")

    def loop(self, stack: Stack) -> RecipeLoop:
        """Only what grades the attempts: the probe runs them itself (`follow`)."""
        self.stack = stack
        return self.grading(stack)

    async def follow(self, kafka: KafkaSettings) -> None:
        config, stack = self.config, self.stack
        evaluation = EvalSettings(tasks=self.tasks[0 if config.split == "train" else 1], agent=HARNESS, gateway_url=stack.gateway_url,
                                  token_secret=stack.token_secret, model=self.served, samples=config.k,
                                  concurrency=config.concurrency, timeout_s=config.attempt_timeout_s,
                                  out=self.out / "probe", agent_env=self.harness(stack).env(), split=config.split,
                                  settle_timeout_s=config.attempt_timeout_s + 300)
        evaluator = Evaluator(kafka, evaluation, say=self.say)
        started = time.monotonic()
        try:
            event = await self.supervised(evaluator.evaluate(0))  # a dead grader restarted, a dead gateway said
        finally:
            evaluator.stop()
        self.result = {"event": event, "seconds": time.monotonic() - started,
                       "trajectories": evaluator.last_trajectories}

    def summary(self, console: Console, elapsed_s: float) -> dict[str, Any]:
        config, data = self.config, self.result["event"].data
        result = self.measures(elapsed_s)
        if config.split == "validation":
            low, high = result["pass_at_1_interval_95"] or (0.0, 0.0)
            console.print(f"Measured {data.tasks} validation tasks × {config.k} with {config.model}: pass@1 "
                          f"{data.pass_at_1:.3f} [95 %: {low:.2f}, {high:.2f}], solved at least once {data.solved_tasks}; "
                          f"{_pace(result)}")
        else:
            selection = self.write_probed()
            result.update(mixed=selection.mixed, never=selection.never, always=selection.always,
                          probed_file=str(config.probed_out))
            console.print(f"Probed {data.tasks} train tasks × {config.k} with {config.model}: solved at least once "
                          f"{data.solved_tasks}; {selection.summary()}; {_pace(result)}; wrote {config.probed_out}")
        (self.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        return result

    def measures(self, elapsed_s: float) -> dict[str, Any]:
        """What the attempts showed: pass rates, how they ended, tokens and time."""
        config, data = self.config, self.result["event"].data
        trajectories = self.result["trajectories"].values()
        generated = sum(len(turn.completion_token_ids) for t in trajectories for turn in t.data.turns)
        prompts = sum(len(turn.prompt_token_ids) for t in trajectories for turn in t.data.turns)
        ends = Counter(t.data.end_reason or t.data.status for t in trajectories)
        durations = [t.data.duration_ms for t in trajectories if t.data.duration_ms is not None]
        seconds = self.result["seconds"]
        return {"model": config.model, "base_model": str(config.base_model or ""), "split": config.split,
                "k": config.k, "tasks": data.tasks, "attempts": data.samples,
                "solved_at_least_once": data.solved_tasks, "pass_at_1": data.pass_at_1,
                "pass_at_1_interval_95": pass_at_1_interval(data.per_task, data.threshold),
                "unscored": data.unscored, "end_reasons": dict(ends.most_common()), "probe_s": round(seconds, 1),
                # the wall time's share of one attempt slot (a long last attempt inflates it), and how long
                # the middle attempt took
                "seconds_per_attempt": round(seconds * config.concurrency / max(data.samples, 1), 1),
                "median_attempt_s": round(statistics.median(durations) / 1000, 1) if durations else None,
                "concurrency": config.concurrency, "generated_tokens": generated, "prompt_tokens": prompts,
                "generated_tokens_per_s": round(generated / max(seconds, 1e-9), 2), "wall_time_s": round(elapsed_s, 1)}

    def write_probed(self) -> Selection:
        """The task file again, each probed train task with its `probe`; and what `select_train` would take."""
        config, data = self.config, self.result["event"].data
        for instance in self.instances:
            rewards = data.per_task.get(instance.instance_id)
            if rewards is not None:
                solved = sum(1 for r in rewards if r is not None and r >= data.threshold)
                extra = instance.__pydantic_extra__
                assert extra is not None  # Instance allows extra fields
                extra["probe"] = {"k": len(rewards), "solved": solved, "model": config.model,
                                  "version": data.weight_version, "run_id": data.run_id}
        write(self.instances, config.probed_out)
        return select_train(self.instances, config.unsolved_share)


def _pace(result: dict[str, Any]) -> str:
    return (f"{result['seconds_per_attempt']} s of wall time per attempt at concurrency {result['concurrency']}, "
            f"median attempt {result['median_attempt_s']} s")


def run_probe(config: ProbeConfig, console: Console | None = None) -> dict[str, Any]:
    probe = Probe(config, console or Console())

    def summarize(_progress: Progress, _config: ProbeConfig, console: Console, elapsed_s: float) -> dict[str, Any]:
        return probe.summary(console, elapsed_s)

    return run_to_summary(probe, summarize)

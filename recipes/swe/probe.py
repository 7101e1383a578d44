"""`agentstream tasks swe probe`: how often the starting model solves each train task, before training.

GRPO learns only from groups whose attempts differ in reward: a task the model never solves, or always
solves, gives every attempt the same advantage (zero). So before a run, the starting model tries each
train task k times through the recipe's own machinery (local stack, gateway, mini-swe-agent in
sandboxes, grader, streams worker; `agentstream.eval`'s runner with the rollouts in the train split):
the attempts are in the log like any rollout (an offline `--loss sft` trainer can learn from the
successful ones), the probe's summary is an `eval` event (run id `probe-…`), and the task file is
written again with each probed task's `probe` {k, solved, model, version, run_id}.

`agentstream recipe swe --probed FILE` then trains on the tasks with mixed results plus a share of
never-solved ones (`select_train`). Validation tasks are never probed: choosing them by how the model
does on them would bias the number the recipe reports.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from agentstream.demo import run_folder, run_to_summary
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.recipe import HARNESS, Recipe, RecipeConfig, write_task_files
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack import StackError
from agentstream.stack.process import ServerState


@dataclass
class ProbeConfig(RecipeConfig):
    instances_file: Path | None = None
    """the SWE-bench task file to probe; None: build `train_tasks + validation_tasks` tasks"""
    k: int = 2
    """attempts per train task"""
    probed_out: Path = Path("tasks.probed.jsonl")
    """the task file written, with each probed task's `probe`"""
    out: Path = field(default_factory=lambda: run_folder("probe-swe"))
    vllm_name: str = "probe-swe"


def probe_of(instance: Instance) -> dict | None:
    return (instance.model_extra or {}).get("probe")


@dataclass
class Selection:
    tasks: list[Instance]
    mixed: int
    never: int
    always: int
    unprobed: int

    def summary(self) -> str:
        return (f"{self.mixed} train tasks with mixed results, {self.never} never solved, {self.always} always "
                f"solved, {self.unprobed} not probed; selected {len(self.tasks)}")


def select_train(instances: list[Instance], unsolved_share: float = 0.25) -> Selection:
    """The train tasks worth a GRPO group: every one the probe solved sometimes, plus never-solved ones up
    to `unsolved_share` of the selection (in file order); always-solved and unprobed ones are left out."""
    if not 0 <= unsolved_share < 1:
        raise ValueError(f"unsolved_share must be in [0, 1), got {unsolved_share}")
    mixed, never, always, unprobed = [], [], [], 0
    for instance in (i for i in instances if i.split == "train"):
        probe = probe_of(instance)
        if not probe:
            unprobed += 1
        elif probe["solved"] == 0:
            never.append(instance)
        elif probe["solved"] >= probe["k"]:
            always.append(instance)
        else:
            mixed.append(instance)
    extra = math.floor(unsolved_share * len(mixed) / (1 - unsolved_share) + 1e-9)
    return Selection(mixed + never[:extra], len(mixed), len(never), len(always), unprobed)


class Probe(Recipe):
    """The recipe's stack without trainer or eval: the train tasks' attempts, graded, then the file."""

    starting = "Starting the local stack for the probe…"

    def __init__(self, config: ProbeConfig, console: Console):
        super().__init__(config, console)
        self.config: ProbeConfig = config
        self.result: dict = {}

    def task_files(self) -> tuple[Path, Path, Path]:
        config = self.config
        if config.instances_file is not None:
            self.instances = [Instance.model_validate_json(line) for line in config.instances_file.read_text().splitlines()
                              if line.strip()]
        else:
            from agentstream.recipes.swe.recipe import build_recipe_tasks

            build_recipe_tasks(self.out / "built", config.train_tasks, config.validation_tasks, say=self.say)
            self.instances = [Instance.model_validate_json(line) for line in
                              (self.out / "built" / "instances.jsonl").read_text().splitlines() if line.strip()]
        if not any(i.split == "train" for i in self.instances):
            raise StackError("the task set has no train task to probe")
        return write_task_files(self.instances, self.out / "tasks")

    async def launch(self, kafka: KafkaSettings, model_dir: Path, vllm: ServerState) -> None:
        self.agents = self.start_grading(kafka, vllm, self.tasks[2])
        await self.await_http("gateway", f"{self.agents.gateway_url}/healthz")

    async def follow(self, kafka: KafkaSettings) -> None:
        from agentstream.eval import EvalConfig, Evaluator

        config = self.config
        evaluation = EvalConfig(tasks=self.tasks[0], agent=HARNESS, gateway_url=self.agents.gateway_url,
                                token_secret=self.agents.token_secret, model=self.served, samples=config.k,
                                concurrency=config.concurrency, timeout_s=config.attempt_timeout_s,
                                out=self.out / "probe", agent_env=self.agents.env, split="train",
                                settle_timeout_s=config.attempt_timeout_s + 300)
        evaluator = Evaluator(kafka, evaluation, say=self.say)
        started = time.monotonic()
        try:
            event = await evaluator.evaluate(0)
        finally:
            evaluator.stop()
        self.result = {"event": event, "seconds": time.monotonic() - started,
                       "trajectories": evaluator.last_trajectories}

    def summary(self, console: Console, elapsed_s: float) -> dict:
        config, event = self.config, self.result["event"]
        data = event.data
        for instance in self.instances:
            rewards = data.per_task.get(instance.instance_id)
            if rewards is not None:
                solved = sum(1 for r in rewards if r is not None and r >= data.threshold)
                instance.__pydantic_extra__["probe"] = {"k": len(rewards), "solved": solved, "model": config.model,
                                                        "version": data.weight_version, "run_id": data.run_id}
        from agentstream.recipes.swe.build import write

        write(self.instances, config.probed_out)
        attempts = data.samples
        generated = prompts = 0
        for trajectory in self.result["trajectories"].values():
            for turn in trajectory.data.turns:
                generated += len(turn.completion_token_ids)
                prompts += len(turn.prompt_token_ids)
        selection = select_train(self.instances, config.unsolved_share)
        result = {"model": config.model, "k": config.k, "tasks": data.tasks, "attempts": attempts,
                  "solved_at_least_once": data.solved_tasks, "pass_at_1": data.pass_at_1,
                  "unscored": data.unscored, "mixed": selection.mixed, "never": selection.never,
                  "always": selection.always, "probe_s": round(self.result["seconds"], 1),
                  "seconds_per_attempt": round(self.result["seconds"] * config.concurrency / max(attempts, 1), 1),
                  "concurrency": config.concurrency, "generated_tokens": generated, "prompt_tokens": prompts,
                  "generated_tokens_per_s": round(generated / max(self.result["seconds"], 1e-9), 2),
                  "wall_time_s": round(elapsed_s, 1), "probed_file": str(config.probed_out)}
        (self.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"Probed {data.tasks} train tasks × {config.k} with {config.model}: solved at least once "
                      f"{data.solved_tasks}; {selection.summary()}; {result['seconds_per_attempt']} s per attempt at "
                      f"concurrency {config.concurrency}; wrote {config.probed_out}")
        return result


def run_probe(config: ProbeConfig, console: Console | None = None) -> dict:
    probe = Probe(config, console or Console())
    return run_to_summary(probe, lambda _progress, _config, console, elapsed: probe.summary(console, elapsed))

"""`agentstream recipe swe`: the coding-agent loop on this machine, every part real.

Tasks (built, or given) → the controller launches mini-swe-agent (`recipes.swe.harness`) per rollout;
its model calls go through the gateway to vLLM, its commands run in bubblewrap sandboxes; at its end
its diff goes into the log → the grader service scores the diff in a fresh sandbox → the streams
worker assembles trajectories → the trainer trains a version on the train split → the pool swaps it
in → `agentstream eval --follow` measures each version on the validation split. Every service is its
own process, started as on a cluster (the demo's process helpers).

On two CPU cores a small model will rarely fix a bug (SmolLM2-135M never follows the harness's format;
Qwen2.5-Coder-0.5B follows it, and fixed none of the probed tasks here until warm-started on an expert's
demonstrations, `recipes.swe.demonstrate`, and given as `--base-model`): the numbers shown (train reward
and validation pass rate per version) are what happened, not a curve to admire. `--probed` trains on
the tasks a probe (`recipes.swe.probe`) found the model solving sometimes. The same run on GPUs is
docs/recipes/swe.md.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator
from rich.console import Console
from rich.table import Table

from agentstream.demo.loop import Loop, Stack
from agentstream.demo.overrides import given, overridden
from agentstream.demo.progress import Progress as DemoProgress
from agentstream.demo.progress import VersionRow, plot_by_version
from agentstream.demo.run import STOP_GRACE_S, Demo, Running, StackConfig, reset_weights, run_folder, run_to_summary
from agentstream.eval import EvalSettings, pass_at_1_interval
from agentstream.recipes.swe.grade_service import GradeSettings
from agentstream.recipes.swe.models import SweModel, build_base_model, model_defaults
from agentstream.recipes.swe.task_files import build_recipe_tasks, probed_task_files
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import EvalEvent, Event, PoolUpdateEvent, RewardEvent, TrajectoryEvent, WeightsEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import scan
from agentstream.stack import StackError
from agentstream.stack.process import ServerState, free_port, start_time, stop_pid
from agentstream.stack.service import Service
from agentstream.streams.settings import StreamsSettings
from agentstream.trainer.checkpoint import Checkpoint, CheckpointStore
from agentstream.trainer.settings import TrainerSettings

HARNESS = f"{sys.executable} -m agentstream.recipes.swe.harness"

Say = Callable[[str], None]


class RecipeConfig(StackConfig):
    """The recipe's knobs. Those a model sizes (`recipes.swe.models.DEFAULTS`: steps, tokens per answer, group
    size, attempt timeout) default to the model's when not given (or given as None); so do the trainer's settings
    it gives (sequence length, LoRA, learning rate), which `--trainer.*` (`flags`) goes over."""

    model: str = "smollm2"
    """the base model: qwen-coder-0.5b / -1.5b, smollm2 (from their PyPI wheels) or tiny (plumbing only)"""
    train_tasks: int = 4
    validation_tasks: int = 2
    tasks: Path | None = None
    """a task file to use instead of building tasks (controller format); with validation_tasks_file"""
    validation_tasks_file: Path | None = None
    instances: Path | None = None
    """the SWE-bench instances (hidden tests) the grader reads, when tasks are given"""
    probed: Path | None = None
    """a probed SWE-bench task file (`agentstream tasks swe probe`): train on its tasks with mixed results"""
    unsolved_share: float = 0.25
    """with `probed`: the share of the train tasks that may be ones the starting model never solved"""
    versions: int = 1
    group_size: int = 2
    groups_per_batch: int = 2
    eval_samples: int = 1
    step_limit: int = 4
    max_tokens: int = 128
    """tokens per model answer"""
    attempt_timeout_s: float = 300.0
    out: Path = Field(default_factory=lambda: run_folder("recipe-swe"))
    vllm_name: str = "recipe-swe"

    @model_validator(mode="before")
    @classmethod
    def _model_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        given = {name: value for name, value in data.items() if value is not None}
        sized = model_defaults(str(given.get("model", cls.model_fields["model"].default)))
        return {**sized.model_dump(exclude={"trainer"}), **given}

    @property
    def spec(self) -> SweModel:
        return model_defaults(self.model)

    def trainer(self) -> TrainerSettings:
        """The trainer's settings this recipe gives for its model, with `--trainer.*` over them."""
        return overridden(self.spec.trainer, self.flags.get("trainer", []), "trainer.")

    @property
    def batch(self) -> int:
        return self.group_size * self.groups_per_batch

    def build_model(self, out: Path, say: Say) -> Path:
        return build_base_model(self.model, out / "base-model", say=say)


class Harness(BaseModel):
    """What mini-swe-agent's harness (`recipes.swe.harness`) reads from its environment, typed."""

    step_limit: int
    max_tokens: int
    workspace: Path
    attempt_timeout_s: int
    index: Path
    demonstrations: Path | None = None
    """the expert's answers the model is made to give (`recipes.swe.demonstrate`)"""

    def env(self) -> dict[str, str]:
        return {f"AGENTSTREAM_SWE_{name.upper()}": str(value) for name, value in self if value is not None}


class RecipeLoop(Loop):
    """The loop with the grader, which scores each attempt's diff, and eval, which measures each version."""

    grader: GradeSettings
    eval: EvalSettings | None = None

    def services(self) -> list[Service]:
        gateway, streams, *rest = super().services()
        # the grader commits a diff's offset once its reward is acknowledged: a restart grades the rest again
        grader = Service("grader", "agentstream.recipes.swe.grade_service", self.grader, restartable=True)
        return [gateway, streams, grader, *rest]

    def traffic(self) -> list[Service]:
        measure = [] if self.eval is None else [Service("eval", "agentstream.eval", self.eval)]
        return measure + super().traffic()


# --- what the recipe shows: train reward and validation pass rate per version -----------------


@dataclass
class RecipeRow(VersionRow):
    """One weight version: its train attempts (those launched at it) and its validation eval."""

    train_rewards: list[float] = field(default_factory=list)
    train_unscored: int = 0
    groups: dict[str, set[float | None]] = field(default_factory=dict)
    """train group id → the rewards its attempts got"""
    end_reasons: Counter[str] = field(default_factory=Counter)
    """how the attempts launched at this version ended (train and validation)"""
    graded: int = 0
    flagged: int = 0
    trained_on: int | None = None
    pass_at_1: float | None = None
    pass_at_1_interval: tuple[float, float] | None = None
    pass_at_k: float | None = None
    eval_samples: int | None = None
    eval_unscored: dict[str, int] = field(default_factory=dict)
    served_versions: list[int] = field(default_factory=list)
    """the versions that generated its eval's tokens: this one alone, unless the pool moved during the eval"""
    measured_at: float | None = None
    """when its eval event was written (seconds since the epoch): the long run's hours by version"""

    @property
    def signal_share(self) -> float | None:
        """The share of train groups whose rewards differ: the only ones GRPO's advantages are not all 0 in."""
        if not self.groups:
            return None
        return sum(1 for rewards in self.groups.values() if len(rewards) > 1) / len(self.groups)

    @property
    def flagged_share(self) -> float | None:
        return self.flagged / self.graded if self.graded else None


class Progress(DemoProgress):
    row_type = RecipeRow

    def __init__(self, config: RecipeConfig) -> None:
        super().__init__()
        self.config = config
        self.graded = 0
        self.flagged_rollouts: dict[str, bool] = {}
        """rollout id → whether its grading raised a flag, until its trajectory says its version"""

    def row(self, version: int) -> RecipeRow:
        row = super().row(version)
        assert isinstance(row, RecipeRow)  # row_type
        return row

    def take(self, event: Event) -> None:
        if isinstance(event, TrajectoryEvent):
            self.take_trajectory(event)
        elif isinstance(event, RewardEvent):
            self.graded += 1
            self.flagged_rollouts[event.rollout_id or event.id] = bool(event.data.details.get("flagged"))
        elif isinstance(event, WeightsEvent):
            self.row(event.data.version).trained_on = len(event.data.lineage)
        elif isinstance(event, PoolUpdateEvent) and event.data.status == "ok":
            self.row(event.data.version).pause_ms = event.data.pause_ms
        elif isinstance(event, EvalEvent):
            row = self.row(event.data.weight_version)
            row.pass_at_1, row.pass_at_k = event.data.pass_at_1, event.data.pass_at_k
            row.pass_at_1_interval = pass_at_1_interval(event.data.per_task, event.data.threshold)
            row.eval_samples, row.eval_unscored = event.data.samples, event.data.unscored
            row.served_versions = event.data.served_versions
            row.measured_at = event.time / 1000

    def take_trajectory(self, event: TrajectoryEvent) -> None:
        data, rollout = event.data, event.rollout_id or event.id
        row = self.row(data.weight_version_launch or 0)
        row.end_reasons[data.end_reason or data.status] += 1
        if rollout in self.flagged_rollouts:
            row.graded += 1
            row.flagged += self.flagged_rollouts.pop(rollout)
        if data.split != "train":
            return
        if data.reward is None:
            row.train_unscored += 1
        else:
            row.train_rewards.append(data.reward)
        row.groups.setdefault(data.group_id or rollout, set()).add(data.reward)

    def recipe_rows(self) -> dict[int, RecipeRow]:
        return {version: self.row(version) for version in sorted(self.rows)}

    def evaluated(self) -> set[int]:
        return {v for v, row in self.recipe_rows().items() if row.pass_at_1 is not None}

    def table(self) -> Table:
        elapsed = time.monotonic() - self.started
        table = Table(title=f"agentstream recipe swe · {elapsed:.0f} s · {self.graded} diffs graded")
        k = self.config.eval_samples
        for column in ("version", "train rollouts", "train reward", "unscored", "groups with signal", "flagged",
                       "ends", "trained on", "swap pause", "val pass@1 [95 %]", f"val pass@{k}", "val samples"):
            table.add_column(column, justify="right")
        for version, row in self.recipe_rows().items():
            mean = sum(row.train_rewards) / len(row.train_rewards) if row.train_rewards else None
            signal = row.signal_share
            table.add_row(str(version), str(len(row.train_rewards) + row.train_unscored),
                          "" if mean is None else f"{mean:.3f}", str(row.train_unscored or ""),
                          "" if signal is None else f"{signal:.2f} of {len(row.groups)}",
                          "" if not row.graded else f"{row.flagged}/{row.graded}",
                          " ".join(f"{reason} {n}" for reason, n in row.end_reasons.most_common()),
                          "" if row.trained_on is None else str(row.trained_on),
                          "" if row.pause_ms is None else f"{row.pause_ms:.0f} ms",
                          _with_interval(row.pass_at_1, row.pass_at_1_interval),
                          "" if row.pass_at_k is None else f"{row.pass_at_k:.3f}",
                          "" if row.eval_samples is None else str(row.eval_samples))
        return table


def _with_interval(value: float | None, interval: tuple[float, float] | None) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if interval is None else f"{value:.3f} [{interval[0]:.2f}, {interval[1]:.2f}]"


# --- tasks -------------------------------------------------------------------------------------


# --- resuming: what an interrupted run left in its folder and on its topics ---------------------


SERVICES_FILE = "services.json"
"""the run's service processes (name, pid, start time), in its logs folder: a rerun after a kill -9 of the command,
whose services outlived it, stops them before it starts its own"""


@dataclass(frozen=True)
class Resumed:
    """Where a run in the same folder (its topic prefix) stopped. The trainer resumes from its newest checkpoint
    (weights, optimizer state, and its ledger of the trajectories it trained on); the pool serves that version
    again; the controller reads its rollouts topic and launches what was not done; the eval measures the versions
    not measured yet. A version the trainer had replaced while its eval was cut short is served no more: it stays
    unmeasured (`lost`). A fresh folder: version 0, nothing measured."""

    checkpoint: Checkpoint | None = None
    measured: frozenset[int] = frozenset()
    """the versions with an eval event on the run's metrics topic"""

    @property
    def version(self) -> int:
        return self.checkpoint.version if self.checkpoint else 0

    @property
    def from_version(self) -> int:
        """the first version the eval measures: the served one unless measured already"""
        return self.version + 1 if self.version in self.measured else self.version

    @property
    def lost(self) -> list[int]:
        return [v for v in range(self.from_version) if v not in self.measured]

    def summary(self) -> dict[str, Any]:
        return {"from_version": self.version, "measured_before": sorted(self.measured), "not_measured": self.lost}


async def measured_versions(kafka: KafkaSettings, model: str) -> frozenset[int]:
    """The versions of `model` the run's eval measured (its `eval-…` runs: a probe writes `probe-…` ones)."""
    measured: set[int] = set()
    async for batch in scan(kafka, kafka.topics.metrics):
        for record in batch:
            try:
                event: Event = decode(record.value or b"")
            except DecodeError:
                continue
            if isinstance(event, EvalEvent) and event.data.model == model and event.data.validation:
                measured.add(event.data.weight_version)
    return frozenset(measured)


# --- the run ----------------------------------------------------------------------------------


class Recipe(Demo):
    """The demo's stack and process handling, with the coding recipe's services; a run in a folder that holds an
    interrupted one resumes it (`Resumed`)."""

    config: RecipeConfig
    starting = "Starting the local stack and building tasks…"

    def __init__(self, config: RecipeConfig, console: Console):
        super().__init__(config, console)
        self.progress: Progress = Progress(config)
        self.served = config.model
        self.resumed = Resumed()
        self.measured_count = 0

    def prepare(self) -> None:
        self.stop_leftovers()
        self.tasks = self.task_files()
        self.resumed = Resumed(CheckpointStore(self.out / "checkpoints").latest())

    # --- resuming

    def stop_leftovers(self) -> None:
        """Services of an earlier run in this folder still running (its command was killed -9): stopped, or they
        would train and launch on beside this run's (one is the same process if its start time is)."""
        path = self.out / "logs" / SERVICES_FILE
        for entry in json.loads(path.read_text()) if path.exists() else []:
            if start_time(entry["pid"]) == entry["started"]:
                self.say(f"stopping the {entry['name']} (pid {entry['pid']}) an earlier run left running")
                stop_pid(entry["pid"], grace=STOP_GRACE_S)
        path.unlink(missing_ok=True)

    def start(self, service: Service) -> Running:
        running = super().start(service)
        self.record_services()
        return running

    def restart(self, service: Running, ended: str) -> None:
        super().restart(service, ended)
        self.record_services()

    def record_services(self) -> None:
        path = self.out / "logs" / SERVICES_FILE
        entries = [{"name": s.name, "pid": s.process.pid, "started": start_time(s.process.pid)} for s in self.running]
        path.write_text(json.dumps(entries) + "\n")

    def inference(self, model_dir: Path) -> list[ServerState]:
        """The starting weights, or a resumed run's newest checkpoint under its own version (the pool applied it,
        or will find it served when the trainer announces it)."""
        servers = super().inference(model_dir)
        if (checkpoint := self.resumed.checkpoint) is not None:
            self.say(f"resuming {self.out.name} from its checkpoint v{checkpoint.version} ({checkpoint.path})")
            if not reset_weights(servers[0].url, Path(checkpoint.event.data.uri), checkpoint.version):
                raise StackError(f"the vLLM server at {servers[0].url} did not load {checkpoint.event.data.uri}")
        return servers

    async def launch(self, stack: Stack) -> None:
        measured = await measured_versions(stack.kafka, self.served)
        self.resumed = resumed = Resumed(self.resumed.checkpoint, measured)
        if measured or resumed.checkpoint is not None:
            self.say(f"resumed: trainer at v{resumed.version}, versions measured before {sorted(measured)}, the eval "
                     f"goes on from v{resumed.from_version}" + (f"; {resumed.lost} were replaced before their eval "
                                                                 "ended: not measured" if resumed.lost else ""))
        if not self.training_left() and "trainer" in self.config.flags:  # no trainer to take them
            self.config = self.config.model_copy(update={"flags": {
                name: flags for name, flags in self.config.flags.items() if name != "trainer"}})
        await super().launch(stack)

    def training_left(self) -> int:
        return max(0, self.config.versions - self.resumed.version)

    def run_id(self) -> str | None:
        """The controller's run to resume: the one its attempt logs are under (a larger --versions plans more epochs
        of the same run: its rollouts done so far stay done); None for a fresh run."""
        runs = sorted(path.name for path in (self.out / "attempts").glob("run-*") if path.is_dir())
        return runs[0] if len(runs) == 1 else None

    def task_files(self) -> tuple[Path, Path, Path]:
        """(train tasks, validation tasks, instances for the grader): given, or built."""
        config = self.config
        if config.probed is not None:
            return probed_task_files(config.probed, self.out / "tasks", config.train_tasks, config.validation_tasks,
                                     config.unsolved_share, say=self.say)
        if config.tasks is not None:
            if config.validation_tasks_file is None or config.instances is None:
                raise StackError("--tasks needs --validation-tasks and --instances (the grader's hidden tests) too")
            return config.tasks, config.validation_tasks_file, config.instances
        return build_recipe_tasks(self.out / "tasks", config.train_tasks, config.validation_tasks, say=self.say)

    def index_file(self, instances: Path) -> Path:
        """The public index (instance id → repository, base commit) the harness locates tasks with."""
        from agentstream.recipes.swe.repos import default_repos_dir
        from agentstream.recipes.swe.tasks import load
        from agentstream.recipes.swe.workspace import write_index

        index = instances.with_name("index.jsonl")
        return index if index.exists() else write_index(load(instances, default_repos_dir(), check_apply=False), index)

    def grading(self, stack: Stack) -> RecipeLoop:
        """The gateway, a streams worker and the grader: what turns attempts into graded trajectories."""
        config, out = self.config, stack.out
        return RecipeLoop(
            gateway=stack.gateway(self.served),
            # a diff is graded after the attempt ends: the trajectory waits for that reward (a grading takes seconds)
            streams=stack.settings(StreamsSettings, web_port=free_port(), settle_s=0.5,
                                   reward_grace_s=config.attempt_timeout_s, data_dir=out / "streams"),
            grader=stack.settings(GradeSettings, tasks=self.tasks[2]))

    def harness(self, stack: Stack) -> Harness:
        """What each attempt's harness reads from its environment."""
        config = self.config
        return Harness(step_limit=config.step_limit, max_tokens=config.max_tokens, workspace=stack.out / "workspaces",
                       attempt_timeout_s=int(config.attempt_timeout_s), index=self.index_file(self.tasks[2]))

    def loop(self, stack: Stack) -> RecipeLoop:
        config, out, (train, validation, _) = self.config, stack.out, self.tasks
        harness, grading = self.harness(stack).env(), self.grading(stack)
        resumed, to_measure = self.resumed, config.versions + 1 - self.resumed.from_version
        # a resumed trainer publishes the versions left (`max_versions` counts this process's); none left: no trainer.
        # It holds each version until the eval has measured it: an eval's attempts take longer than a version here,
        # and the pool must not move under them (`trainer.eval_hold`)
        trainer = stack.settings(
            TrainerSettings, model=self.served, base_model=stack.model_dir, checkpoint_dir=out / "checkpoints",
            group_size=config.group_size, groups_per_batch=config.groups_per_batch, min_group_size=1,
            max_staleness=1, max_versions=self.training_left(), keep_checkpoints=2, hold_for_eval=to_measure > 0,
            **given(config.spec.trainer)) if self.training_left() else None
        return RecipeLoop(
            gateway=grading.gateway, streams=grading.streams, grader=grading.grader, trainer=trainer,
            eval=stack.settings(
                EvalSettings, tasks=validation, agent=HARNESS, follow=True, max_versions=to_measure,
                from_version=resumed.from_version, samples=config.eval_samples, out=out / "eval",
                gateway_url=stack.gateway_url, token_secret=stack.token_secret, model=self.served,
                timeout_s=config.attempt_timeout_s, concurrency=config.concurrency,
                agent_env=harness) if to_measure > 0 else None,
            controller=stack.controller(
                tasks=train, agent=HARNESS, samples=config.group_size, epochs=config.versions, shuffle=False,
                max_staleness=0, train_batch_size=config.batch, max_attempts=1, logs_dir=out / "attempts",
                run_id=self.run_id(), model=self.served, timeout_s=config.attempt_timeout_s,
                concurrency=config.concurrency),
            agent_env=harness)

    async def follow(self, kafka: KafkaSettings) -> None:
        """Until every version has its eval (a resumed run's: every version from the one it resumed measuring);
        each version measured is written to the run folder as it comes (`write_versions`)."""
        wanted = set(range(self.resumed.from_version, self.config.versions + 1))
        eval_ended: float | None = None

        async def done(fetched: bool) -> bool:
            nonlocal eval_ended
            if len(self.progress.evaluated()) != self.measured_count:
                self.write_versions()
            if wanted <= self.progress.evaluated():
                return True
            if self.service_done("eval"):
                eval_ended = eval_ended or time.monotonic()
                if time.monotonic() - eval_ended > 2.0:  # its last events had time to arrive
                    raise StackError("the eval ended before every version was measured; its log: "
                                     f"{self.service('eval').log}")
            return False

        topics = kafka.topics
        await self.watch(kafka, [topics.trajectories, topics.weights, topics.pool, topics.metrics, topics.rewards],
                         done, refresh_per_second=1)

    def write_versions(self) -> None:
        """The rows by version so far into `versions.json`: what a run stopped before its summary measured."""
        self.measured_count = len(self.progress.evaluated())
        rows = per_version(self.progress, self.config)
        path = self.out / "versions.json"
        path.with_suffix(".partial").write_text(json.dumps(rows, indent=2) + "\n")
        path.with_suffix(".partial").replace(path)


# --- the summary ----------------------------------------------------------------------------


def per_version(progress: Progress, config: RecipeConfig) -> dict[int, dict[str, Any]]:
    rows = {}
    for version, row in progress.recipe_rows().items():
        mean = sum(row.train_rewards) / len(row.train_rewards) if row.train_rewards else None
        rows[version] = {"train_rollouts": len(row.train_rewards) + row.train_unscored,
                         "train_reward_mean": mean, "train_unscored": row.train_unscored,
                         "trained_on": row.trained_on, "swap_pause_ms": row.pause_ms,
                         "train_groups": len(row.groups), "train_groups_with_signal_share": row.signal_share,
                         "end_reasons": dict(row.end_reasons.most_common()), "graded": row.graded,
                         "flagged_share": row.flagged_share,
                         "validation_pass_at_1": row.pass_at_1,
                         "validation_pass_at_1_interval_95": row.pass_at_1_interval,
                         f"validation_pass_at_{config.eval_samples}": row.pass_at_k,
                         "validation_samples": row.eval_samples, "validation_unscored": row.eval_unscored,
                         "validation_served_versions": row.served_versions,
                         "validation_measured_at": row.measured_at}
    return rows


def summary(progress: Progress, config: RecipeConfig, console: Console, elapsed_s: float,
            resumed: Resumed | None = None) -> dict[str, Any]:
    trainer = progress.loop.trainer if progress.loop and progress.loop.trainer else config.trainer()
    result = {"model": config.model, "versions": config.versions, "train_tasks": config.train_tasks,
              "validation_tasks": config.validation_tasks, "group_size": config.group_size,
              "batch": config.batch, "step_limit": config.step_limit, "max_tokens": config.max_tokens,
              "max_seq_len": trainer.max_seq_len, "lora_rank": trainer.lora_rank, "lr": trainer.lr,
              "wall_time_s": round(elapsed_s, 1), "per_version": per_version(progress, config),
              "attempt": config.out.resolve().name, "resumed": (resumed or Resumed()).summary()}
    out = config.out.resolve()
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(progress, out / "recipe.png")
    console.print(progress.table())
    console.print(f"Summary: {out / 'summary.json'}; plot: {out / 'recipe.png'}; wall time {elapsed_s:.0f} s.")
    return result


def plot(progress: Progress, path: Path) -> None:
    versions = sorted(progress.rows)
    rows = list(progress.recipe_rows().values())
    train = [sum(r.train_rewards) / len(r.train_rewards) if r.train_rewards else float("nan") for r in rows]
    passed = [r.pass_at_1 if r.pass_at_1 is not None else float("nan") for r in rows]
    plot_by_version(path, "agentstream recipe swe: mini-swe-agent, graded diffs", versions,
                    {"train reward (mean)": train, "validation pass@1": passed})


def run_recipe(config: RecipeConfig, console: Console | None = None) -> dict[str, Any]:
    """The run, or the rest of an interrupted one in the same folder (`Resumed`), then its summary."""
    recipe = Recipe(config, console or Console())
    return run_to_summary(recipe, lambda progress, config, console, elapsed: summary(
        progress, config, console, elapsed, recipe.resumed))

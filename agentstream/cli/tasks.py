"""`agentstream tasks swe`: build, probe, split and check the coding recipe's task files (recipes/swe/)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console

from agentstream.cli.options import StartingWeights, Teacher, TeacherAttempts, TeacherKeyEnv, service_flags
from agentstream.cli.output import console, fail
from agentstream.recipes.swe.mutate import EASY_KINDS, KINDS

ReposDir = Annotated[Path | None, typer.Option(help="task repositories (default: AGENTSTREAM_HOME/swe/repos)")]
if TYPE_CHECKING:
    from agentstream.demo.run import StackConfig

Config = TypeVar("Config", bound="StackConfig")
SITES = ("file", "function")
"""what no validation and training bug may share"""


def swe_build(
    out: Annotated[Path, typer.Option(help="the task file to write (JSONL)")] = Path("tasks.jsonl"),
    limit: Annotated[int, typer.Option(help="tasks to build")] = 60,
    seed: Annotated[int, typer.Option(help="the order candidate bugs are tried in")] = 0,
    package: Annotated[str, typer.Option(help="the pinned package to inject bugs into")] = "toolz",
    workers: Annotated[int, typer.Option(help="candidates tested at once")] = 2,
    repos_dir: ReposDir = None,
    split_by: Annotated[str, typer.Option(help="file: no file holds both a validation and a training bug; "
                                               "function: no function does")] = "file",
    kinds: Annotated[str, typer.Option(help="the kinds of bug to inject, comma-separated (recipes/swe/mutate.py); "
                                            "misspell_name is the easiest, for models that solve none of the others")]
        = ",".join(KINDS),
) -> None:
    """Inject bugs into a pinned package and keep those its own tests catch (see recipes/swe/README.md)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentstream.recipes.swe.build import PINNED, build, write

    if package not in PINNED:
        fail(f"no pinned package {package!r}; choose from: {', '.join(PINNED)}")
    if split_by not in SITES:
        fail(f"--split-by takes file or function, not {split_by!r}")
    chosen = kinds.split(",")
    if unknown := sorted(set(chosen) - set(KINDS + EASY_KINDS)):
        fail(f"no bug kind {', '.join(unknown)}; choose from: {', '.join(KINDS + EASY_KINDS)}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("tried {task.fields[tried]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("tasks", total=limit, tried=0)
        built = build(PINNED[package], limit=limit, seed=seed, repos_dir=repos_dir, workers=workers,
                      progress=lambda kept, tried, total: progress.update(bar, completed=kept, tried=f"{tried}/{total}"),
                      split_by=split_by, kinds=chosen)  # type: ignore[arg-type]  # checked above
    write(built.instances, out)
    validation = sum(i.split == "validation" for i in built.instances)
    console.print(f"Wrote {len(built.instances)} tasks ({len(built.instances) - validation} train, {validation} "
                  f"validation, no {split_by} holding both) to {out} in {built.seconds:.0f} s; "
                  f"tried {built.tried} candidates, rejected: {built.rejected or 'none'}")
    if len(built.instances) < limit:
        console.print(f"[yellow]only {len(built.instances)} of {limit}: the package ran out of candidates[/yellow]")


def swe_probe(
    ctx: typer.Context,
    tasks: Annotated[Path | None, typer.Option(help="the SWE-bench task file to probe (e.g. from `tasks swe build`); "
                                                       "default: build --train-tasks + --validation-tasks tasks")] = None,
    out: Annotated[Path, typer.Option(help="the task file to write, each probed task with its `probe`")] = Path(
        "tasks.probed.jsonl"),
    model: Annotated[str, typer.Option(help="the starting model: qwen-coder-0.5b, qwen-coder-1.5b, smollm2 or tiny")]
        = "qwen-coder-0.5b",
    k: Annotated[int, typer.Option("-k", help="attempts per train task")] = 2,
    train_tasks: Annotated[int, typer.Option(help="train tasks to build (without --tasks)")] = 4,
    validation_tasks: Annotated[int, typer.Option(help="validation tasks to build (without --tasks)")] = 2,
    step_limit: Annotated[int | None, typer.Option(help="mini-swe-agent's step limit (model calls per attempt); "
                                                      "default: the model's (recipes/swe/models.py)")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="tokens per model answer; default: the model's")] = None,
    concurrency: Annotated[int, typer.Option(help="agents running at once")] = 2,
    attempt_timeout_s: Annotated[float | None, typer.Option(help="seconds an attempt may run; default: the "
                                                                "model's")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="run folder (default: runs/probe-swe-TIME)")] = None,
    keep_stack: Annotated[bool, typer.Option(help="leave Kafka and vLLM running afterwards")] = False,
    split: Annotated[str, typer.Option(help="train: probe the train tasks and write --out; validation: measure "
                                            "a model on the validation tasks (pass@1 with its 95 % interval)")]
        = "train",
    base_model: StartingWeights = None,
) -> None:
    """Run the starting model k times on each train task (local stack, mini-swe-agent, grader: attempts in the
    log like any rollout) and write the tasks with each one's probe pass rate, for `recipe swe --probed`.

    Any setting of a service it runs, as --SERVICE.SETTING VALUE: --grader.workers 4, --streams.settle-s 1, …"""
    from agentstream.recipes.swe.probe import ProbeConfig, run_probe
    from agentstream.recipes.swe.recipe import RecipeLoop

    if split not in ("train", "validation"):
        fail(f"--split takes train or validation, not {split!r}")
    config = ProbeConfig(model=model, instances_file=tasks, probed_out=out, k=k, train_tasks=train_tasks,
                         validation_tasks=validation_tasks, step_limit=step_limit, max_tokens=max_tokens,
                         concurrency=concurrency, attempt_timeout_s=attempt_timeout_s, keep_stack=keep_stack,
                         split=split, base_model=base_model, flags=service_flags(ctx, RecipeLoop))
    run_in(run_dir, config, run_probe)


def swe_demonstrate(
    tasks: Annotated[Path, typer.Option(help="the SWE-bench task file (e.g. from `tasks swe build`): its train "
                                             "tasks are demonstrated (the expert: any text patch that fits)")],
    model: Annotated[str, typer.Option(help="the model that answers: qwen-coder-0.5b, qwen-coder-1.5b, smollm2 "
                                            "or tiny")] = "qwen-coder-0.5b",
    concurrency: Annotated[int, typer.Option(help="agents running at once")] = 2,
    run_dir: Annotated[Path | None, typer.Option(help="run folder (default: runs/demonstrate-swe-TIME); its "
                                                      "name is the topic prefix")] = None,
    keep_stack: Annotated[bool, typer.Option(help="leave Kafka and vLLM running afterwards")] = False,
    base_model: StartingWeights = None,
    teacher: Teacher = "expert",
    teacher_key_env: TeacherKeyEnv = None,
    teacher_attempts: TeacherAttempts = 1,
    keep_max_tokens: Annotated[int, typer.Option(help="leave out teacher attempts that generated more tokens; "
                                                      "0: any")] = 0,
    max_tokens: Annotated[int | None, typer.Option(help="tokens per answer (default: the model's); a task whose "
                                                        "answers do not fit is not demonstrated")] = None,
) -> None:
    """Record an expert's answers to the train tasks through the whole loop (the served model made to answer
    them, graded like any attempt): the trajectories an SFT warm start learns from (recipes/swe/expert.py)."""
    from agentstream.recipes.swe.demonstrate import DemonstrateConfig
    from agentstream.recipes.swe.keep import parse_teacher
    from agentstream.recipes.swe.teacher import run_demonstrations

    try:
        parse_teacher(teacher)
    except ValueError as exc:
        fail(str(exc))
    config = DemonstrateConfig(model=model, instances_file=tasks, concurrency=concurrency, keep_stack=keep_stack,
                               base_model=base_model, teacher=teacher, teacher_key_env=teacher_key_env,
                               teacher_attempts=teacher_attempts, keep_max_tokens=keep_max_tokens,
                               max_tokens=max_tokens)
    run_in(run_dir, config, run_demonstrations)


def run_in(run_dir: Path | None, config: Config, run: Callable[[Config, Console], object]) -> None:
    """A run of the local stack in `run_dir` (default: the config's own), its failure said as the CLI's error."""
    if run_dir is not None:
        config.out = run_dir
    try:
        run(config, console)
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc))


def swe_split(
    file: Annotated[Path, typer.Argument(help="a task file (SWE-bench JSONL)")],
    out: Annotated[Path, typer.Option(help="where to write the re-split tasks")],
    by: Annotated[str, typer.Option(help="file or function: the bug site no two splits may share")] = "file",
    validation_share: Annotated[float, typer.Option(help="validation tasks at most (a share)")] = 0.25,
    minimum: Annotated[float, typer.Option(help="validation tasks at least (a share)")] = 0.2,
) -> None:
    """Split a task file again by bug site (recipes/swe/split.py) and say how many tasks each split holds."""
    from agentstream.recipes.swe.build import write
    from agentstream.recipes.swe.instance import Instance
    from agentstream.recipes.swe.split import split_by_site

    if by not in SITES:
        fail(f"--by takes file or function, not {by!r}")
    try:
        instances = [Instance.model_validate_json(line) for line in file.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        fail(f"cannot read {file}: {exc} (check it with `agentstream tasks swe check`)")
    result = split_by_site(instances, by, validation_share, minimum)  # type: ignore[arg-type]  # checked above
    for instance in instances:
        instance.split = result.splits[instance.instance_id]
    write(instances, out)
    console.print(f"Wrote {out}: {result.summary()}, split by {by}")
    if result.problem:
        console.print(f"[yellow]{result.problem}[/yellow]")
        raise typer.Exit(2)


def swe_check(
    file: Annotated[Path, typer.Argument(help="a SWE-bench / SWE-smith / SWE-Gym JSONL file")],
    repos_dir: ReposDir = None,
) -> None:
    """Check a task file before anything runs: every bad line with its reason."""
    from agentstream.recipes.swe.repos import default_repos_dir
    from agentstream.recipes.swe.split import leaks
    from agentstream.recipes.swe.tasks import load

    try:
        instances = load(file, repos_dir or default_repos_dir())
    except OSError as exc:
        fail(f"cannot read {file}: {exc}")
    validation = sum(i.split == "validation" for i in instances)
    console.print(f"{file}: {len(instances)} tasks ({validation} validation), all usable")
    if shared := leaks(instances):
        console.print(f"[yellow]{len(shared)} file(s) hold both a validation and a training bug "
                      f"({', '.join(sorted(shared)[:5])}{', …' if len(shared) > 5 else ''}): "
                      "split again with `agentstream tasks swe split`[/yellow]")

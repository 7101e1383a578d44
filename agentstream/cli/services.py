"""The services' commands: each hands its arguments to the service's own `main(argv)` and its flags.

The service parses them (pydantic-settings), so `agentstream train --help` is the trainer's help. Where
the arguments name no Kafka, the service is given the local broker's address (`--bootstrap-servers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from agentstream.stack import bootstrap_servers
from agentstream.stack.process import StackError

FORWARD: dict[str, Any] = {
    "add_help_option": False, "context_settings": {"allow_extra_args": True, "ignore_unknown_options": True}}
"""how a command that forwards every argument is registered"""

KAFKA_FLAGS = ("--bootstrap-servers", "--kafka-bootstrap-servers")


def forward(service_main: Callable[[list[str]], int | None], args: list[str]) -> None:
    """Run a service with `args` (and the local broker, unless they name one); exit with its code."""
    if not any(arg.split("=")[0] in KAFKA_FLAGS for arg in args):
        try:
            args = [*args, "--bootstrap-servers", bootstrap_servers()]
        except StackError:
            pass  # no local broker: the service tries its default address and says what failed
    raise typer.Exit(service_main(args) or 0)


def run(ctx: typer.Context) -> None:
    """Run an agent over a task set, recording every rollout (flags: `agentstream run --help`).

    agentstream run --tasks FILE --agent "CMD" --samples N --concurrency C [--backend local|kubernetes]
    """
    from agentstream.controller.__main__ import main as controller_main

    forward(controller_main, list(ctx.args))


def gateway(ctx: typer.Context) -> None:
    """The OpenAI-compatible gateway that records every model call (flags: `agentstream gateway --help`)."""
    from agentstream.gateway.__main__ import main as gateway_main

    forward(gateway_main, list(ctx.args))


def streams(ctx: typer.Context) -> None:
    """A streams worker: trajectory assembly and windowed analytics (flags: `agentstream streams --help`)."""
    from agentstream.streams.__main__ import main as streams_main

    forward(streams_main, ["worker", *ctx.args])


def grade(ctx: typer.Context) -> None:
    """The coding recipe's grader: diffs from the rollouts topic in, rewards out (flags: `agentstream grade --help`).

    agentstream grade --tasks FILE [--workers N] [--timeout-s S] [--no-second-opinion]
                      [--reward-penalties default|none|FLAG,FLAG…]
    """
    from agentstream.recipes.swe.grade_service import main as grade_main

    forward(grade_main, list(ctx.args))


def train(ctx: typer.Context) -> None:
    """Run the trainer (`python -m agentstream.trainer`); flags: `agentstream train --help`."""
    from agentstream.trainer.__main__ import main as trainer_main

    forward(trainer_main, list(ctx.args))


def dashboard(ctx: typer.Context) -> None:
    """The web dashboard: overview, rollouts, each trajectory down to its tokens (flags: `agentstream dashboard --help`)."""
    from agentstream.dashboard.__main__ import main as dashboard_main

    forward(dashboard_main, list(ctx.args))

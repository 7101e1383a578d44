"""The flags several commands share, and their conversion into what the packages take.

A flag takes the name the services' settings give the same setting (`--topic-prefix`); an older name
of the CLI's stays accepted, hidden from the help, for one release (`OLD_NAMES`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer._click import Context
from typer.core import TyperCommand

from agentstream.cli.output import fail
from agentstream.stack import bootstrap_servers

if TYPE_CHECKING:
    from pydantic_settings import BaseSettings

    from agentstream.demo.loop import Loop
    from agentstream.demo.overrides import ServiceFlags
    from agentstream.schemas.kafka import KafkaSettings
    from agentstream.schemas.scan import Bounds, Origin

OLD_NAMES = {"--prefix": "--topic-prefix"}
"""old flag → its name now (the services' own)"""
PRESET_OLD_NAMES = {"--lr": "--trainer.lr", "--lora-rank": "--trainer.lora-rank", "--max-seq-len": "--trainer.max-seq-len"}
"""a preset's old flag for a service's setting → the service's own (`--trainer.lr`), for one release"""
SERVICE_FLAGS = {"allow_extra_args": True, "ignore_unknown_options": True}
"""the context of a preset command: what is not its own flag is a service's (`--trainer.lr 1e-4`)"""


class AcceptsOldNames(TyperCommand):
    """A command that also takes the old names of its flags (`OLD_NAMES`); the help shows the new ones."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        own = {name for param in self.get_params(ctx) for name in param.opts}
        return super().parse_args(ctx, renamed(args, own))


def renamed(args: list[str], own: set[str]) -> list[str]:
    """`args` with each old flag name (before any `--`) given its new name, where the command has that flag."""
    out: list[str] = []
    for at, arg in enumerate(args):
        if arg == "--":
            return [*out, *args[at:]]
        flag, equals, value = arg.partition("=")
        new = OLD_NAMES.get(flag)
        out.append(new + equals + value if new in own else arg)
    return out


TopicPrefix = Annotated[str, typer.Option("--topic-prefix", envvar="AGENTSTREAM_TOPIC_PREFIX", help="topic name prefix")]
Since = Annotated[str | None, typer.Option(help="from this time: epoch ms, ISO-8601, or an age (10m, 2h)")]
Until = Annotated[str | None, typer.Option(help="up to this time (same forms as --since)")]
StartOffsets = Annotated[str | None, typer.Option("--from-offsets", help="first offsets, PARTITION:OFFSET,…")]
EndOffsets = Annotated[str | None, typer.Option("--to-offsets", help="stop before these offsets, PARTITION:OFFSET,…")]
ReadFrom = Annotated[str, typer.Option(
    "--source", help="where records come from: kafka, archive (only what `agentstream archive` holds), or auto "
                     "(the archive for what it holds, Kafka for the rest)")]
ArchiveDir = Annotated[Path, typer.Option("--archive", envvar="AGENTSTREAM_ARCHIVE",
                                          help="the Parquet archive's folder (agentstream archive)")]
ModelName = Annotated[str, typer.Option(help="the served model name")]
StartingWeights = Annotated[Path | None, typer.Option(
    "--base-model", help="a model folder to serve and start from instead of --model's (e.g. an SFT checkpoint); "
                         "--model still names it and sets the defaults")]
Teacher = Annotated[str, typer.Option(help="who demonstrates: expert (reads the gold patch; any text patch) or "
                                           "MODEL=URL, a stronger model behind OpenAI's chat completions (vLLM, "
                                           "OpenAI, Anthropic's OpenAI-compatible endpoint) whose graded, filtered "
                                           "attempts the student then answers (recipes/swe/teacher.py)")]
TeacherKeyEnv = Annotated[str | None, typer.Option(help="the environment variable holding the teacher's key (never "
                                                        "the key itself); sent to the teacher's server only")]
TeacherAttempts = Annotated[int, typer.Option(help="the teacher's attempts per train task")]


def service_flags(ctx: typer.Context, loop: type[Loop], extra: dict[str, type[BaseSettings]] | None = None) \
        -> ServiceFlags:
    """A preset's `--<service>.<field> VALUE` arguments by service (the loop's, and `extra` ones a preset runs
    besides), checked by the services' own parsers; a bad one is one line naming it, exit 2."""
    from agentstream.demo.overrides import split
    from agentstream.schemas.flags import BadSetting, refuse

    args = [PRESET_OLD_NAMES.get(flag, flag) + equals + value
            for flag, equals, value in (arg.partition("=") for arg in ctx.args)]
    try:
        return split(args, {**loop.settings_types(), **(extra or {})})
    except BadSetting as exc:
        refuse(str(exc))


def kafka_settings(topic_prefix: str) -> KafkaSettings:
    """The local broker's (or KAFKA_BOOTSTRAP_SERVERS') settings, with this topic prefix."""
    from agentstream.schemas.kafka import KafkaSettings

    return KafkaSettings(bootstrap_servers=bootstrap_servers(), topic_prefix=topic_prefix)


def bounds(since: str | None, until: str | None, start: str | None, end: str | None) -> Bounds:
    from agentstream.schemas.scan import Bounds, parse_offsets, parse_time

    try:
        return Bounds(
            since_ms=parse_time(since) if since else None, until_ms=parse_time(until) if until else None,
            start_offsets=parse_offsets(start) if start else {}, end_offsets=parse_offsets(end) if end else {},
        )
    except ValueError as exc:
        fail(str(exc))


def origin(source: str, archive: Path) -> Origin:
    from agentstream.schemas.scan import Origin

    return Origin(source, archive)  # type: ignore[arg-type]  # Origin checks it, naming the modes


def pairs(values: list[str], option: str) -> dict[str, str]:
    """KEY=VALUE flags (repeatable) as a dict."""
    if any("=" not in value for value in values):
        fail(f"{option} takes KEY=VALUE")
    return dict(value.split("=", 1) for value in values)

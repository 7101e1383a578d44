"""The local stack: a Kafka broker, vLLM-CPU servers and a tiny model, all on 127.0.0.1."""

from __future__ import annotations

import os
from pathlib import Path

from agentstream.settings import agentstream_home
from agentstream.stack.process import StackError


def default_kafka_dir() -> Path:
    return agentstream_home() / "kafka" / "data"


def bootstrap_servers() -> str:
    """KAFKA_BOOTSTRAP_SERVERS if set, else the running local broker's address."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    from agentstream.stack.kafka import LocalKafka

    state = LocalKafka(default_kafka_dir()).state()
    if state is None:
        raise StackError("no Kafka to talk to: start the local broker with `agentstream kafka start`, "
                         "or set KAFKA_BOOTSTRAP_SERVERS to an existing cluster")
    return state.url

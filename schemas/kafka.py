"""Kafka clients, configured once for every service.

Producers are idempotent with acks=all, so a retried send never duplicates or reorders a record.
Consumers never auto-commit: each service commits offsets after the work they cover is durable.
Every client authenticates as the settings say (SASL/SCRAM, TLS): `aiokafka_auth` for aiokafka's,
`librdkafka_auth` for confluent-kafka's, from the same fields.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.helpers import create_ssl_context
from aiokafka.structs import RecordMetadata
from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentstream.schemas.codec import encode
from agentstream.schemas.events import Deadletter, DeadletterEvent, Event
from agentstream.schemas.topics import Topics, TopicSpec, topic_specs


class KafkaSettings(BaseSettings):
    """Settings every service shares. Services subclass this for their own settings model."""

    model_config = SettingsConfigDict(
        env_prefix="AGENTSTREAM_", cli_kebab_case=True, cli_implicit_flags=True, extra="ignore"
    )

    bootstrap_servers: str = Field(
        "127.0.0.1:9092",
        validation_alias=AliasChoices("bootstrap_servers", "KAFKA_BOOTSTRAP_SERVERS"),
        description="Kafka bootstrap servers (env KAFKA_BOOTSTRAP_SERVERS)",
    )
    topic_prefix: str = Field("", description="prefix of every topic name, to run several experiments on one cluster")
    partitions: int = Field(4, description="partitions of the rollout-scoped topics when they are created")
    replication_factor: int | None = Field(
        None, description="replicas of each topic when it is created; default: the cluster's brokers, up to 3")
    min_insync_replicas: int | None = Field(
        None, description="min.insync.replicas of each topic when it is created: the replicas an acks=all write "
        "waits for; default: one fewer than its replicas, at least 1 (2 of 3: a write survives one broker down)")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="how clients reach the brokers: SASL_SSL for SCRAM over TLS, SASL_PLAINTEXT for "
        "SCRAM inside a trusted network")
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] = Field(
        "SCRAM-SHA-512", description="the SASL mechanism (with a SASL_* security protocol)")
    sasl_username: str = Field("", description="the SASL user (with a SASL_* security protocol)")
    sasl_password: SecretStr = Field(
        SecretStr(""), description="the SASL user's password (AGENTSTREAM_SASL_PASSWORD: flags show in process listings)")
    ssl_cafile: str = Field("", description="CA bundle that signed the brokers' certificates (SSL, SASL_SSL); "
                            "empty: the system's")

    @model_validator(mode="after")
    def _credentials_with_sasl(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL_") and not (self.sasl_username and
                                                                self.sasl_password.get_secret_value()):
            raise ValueError(f"security_protocol {self.security_protocol} needs sasl_username and sasl_password "
                             "(AGENTSTREAM_SASL_USERNAME, AGENTSTREAM_SASL_PASSWORD)")
        return self

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)


S = TypeVar("S", bound=KafkaSettings)
MOST_REPLICAS = 3
"""the replicas a topic gets by default on a cluster that has that many brokers or more"""
DESCRIBE_S = 10.0
NOT_YET_KNOWN = (3, 5)
"""UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE: what a broker answers for a topic created a moment ago"""


def replicas_for(settings: KafkaSettings, brokers: int) -> tuple[int, int]:
    """A topic's replication factor and min.insync.replicas: as set, else from the cluster's size."""
    replicas = settings.replication_factor or min(MOST_REPLICAS, max(brokers, 1))
    return replicas, settings.min_insync_replicas or max(1, replicas - 1)


async def with_replicas(settings: S) -> S:
    """The settings with their replication factor and min.insync.replicas decided (from the cluster's size
    where unset): for a client that creates topics itself (Faust)."""
    admin = make_admin(settings, request_timeout_ms=15_000)
    await admin.start()
    try:
        replicas, min_isr = replicas_for(settings, await _brokers(admin))
    finally:
        await admin.close()
    return settings.model_copy(update={"replication_factor": replicas, "min_insync_replicas": min_isr})


async def _brokers(admin: AIOKafkaAdminClient) -> int:
    return len((await admin.describe_cluster())["brokers"])


def aiokafka_auth(settings: KafkaSettings) -> dict[str, Any]:
    """aiokafka's connection options (producers, consumers, admin clients) for the settings' protocol."""
    options: dict[str, Any] = {"bootstrap_servers": settings.bootstrap_servers,
                               "security_protocol": settings.security_protocol}
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = create_ssl_context(cafile=settings.ssl_cafile or None)
    if settings.security_protocol.startswith("SASL_"):
        options.update(sasl_mechanism=settings.sasl_mechanism, sasl_plain_username=settings.sasl_username,
                       sasl_plain_password=settings.sasl_password.get_secret_value())
    return options


def librdkafka_auth(settings: KafkaSettings) -> dict[str, Any]:
    """confluent-kafka's (librdkafka's) connection settings, the same as `aiokafka_auth`."""
    config: dict[str, Any] = {"bootstrap.servers": settings.bootstrap_servers,
                              "security.protocol": settings.security_protocol.lower()}
    if settings.ssl_cafile and settings.security_protocol in ("SSL", "SASL_SSL"):
        config["ssl.ca.location"] = settings.ssl_cafile
    if settings.security_protocol.startswith("SASL_"):
        config.update({"sasl.mechanism": settings.sasl_mechanism, "sasl.username": settings.sasl_username,
                       "sasl.password": settings.sasl_password.get_secret_value()})
    return config


def make_admin(settings: KafkaSettings, **overrides: Any) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**{**aiokafka_auth(settings), **overrides})


def make_producer(settings: KafkaSettings, **overrides: Any) -> AIOKafkaProducer:
    options: dict[str, Any] = dict(
        **aiokafka_auth(settings),
        enable_idempotence=True,
        acks="all",
        linger_ms=1,
        max_request_size=16 * 1024 * 1024,
        request_timeout_ms=10_000,
    )
    options.update(overrides)
    return AIOKafkaProducer(**options)


def make_consumer(settings: KafkaSettings, *topics: str, group_id: str | None, **overrides: Any) -> AIOKafkaConsumer:
    """A consumer of full topic names; `group_id=None` reads without a group (replay, queries)."""
    options: dict[str, Any] = dict(
        **aiokafka_auth(settings),
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
        max_partition_fetch_bytes=16 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


class Publisher:
    """Writes events to their topics under one prefix."""

    def __init__(self, producer: AIOKafkaProducer, topics: Topics):
        self.producer = producer
        self.topics = topics

    async def publish(self, event: Event) -> RecordMetadata:
        """Send and wait for the broker's acknowledgement."""
        return await (await self.send(event))

    async def publish_all(self, events: Iterable[Event]) -> list[RecordMetadata]:
        """Send in order and wait for the acknowledgements together (not one round trip each)."""
        return list(await asyncio.gather(*[await self.send(event) for event in events]))

    async def send(self, event: Event) -> asyncio.Future[RecordMetadata]:
        """Queue the record; the returned future resolves when the broker acknowledges it."""
        sent: asyncio.Future[RecordMetadata] = await self.producer.send(self.topics.name(event.topic), encode(event),
                                                                        key=event.key)
        return sent

    async def deadletter(self, record: ConsumerRecord, reason: str, consumer: str) -> RecordMetadata:
        return await self.publish(deadletter_event(record, reason, consumer))


def deadletter_event(record: ConsumerRecord, reason: str, consumer: str) -> DeadletterEvent:
    key = record.key.decode("utf-8", "replace") if record.key else None
    value = record.value.decode("utf-8", "replace") if record.value is not None else ""
    return DeadletterEvent(
        source=consumer,
        data=Deadletter(topic=record.topic, partition=record.partition, offset=record.offset, key=key,
                        value=value, reason=reason, consumer=consumer),
    )


@dataclass
class TopicReport:
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches


async def ensure_topics(settings: KafkaSettings, specs: Iterable[TopicSpec] | None = None) -> TopicReport:
    """Create the topics that are missing; report those whose settings differ from the spec.

    Idempotent: running it again creates nothing. Mismatches are reported, never "fixed", because
    changing a live topic's partition count moves rollouts between partitions. Topics are created with
    `replicas_for` the cluster: on three brokers, three replicas of which two take each write. A topic with
    fewer replicas than that (made on one broker, the cluster grown since) is a mismatch too, as is one whose
    replicas differ from a replication factor that is set.
    """
    specs = list(specs if specs is not None else topic_specs(settings.partitions))
    names = {settings.topics.name(s.base): s for s in specs}
    report = TopicReport()
    admin = make_admin(settings, request_timeout_ms=15_000)
    await admin.start()
    try:
        present = set(await admin.list_topics())
        missing = [name for name in names if name not in present]
        replicas, min_isr = replicas_for(settings, await _brokers(admin))
        if missing:
            response = await admin.create_topics(
                [NewTopic(name, names[name].partitions, replicas,
                          topic_configs={**names[name].config, "min.insync.replicas": str(min_isr)})
                 for name in missing]
            )
            for name, code, message in _topic_errors(response):
                if code == 0:
                    report.created.append(name)
                elif code == 36:  # TOPIC_ALREADY_EXISTS: another process created it meanwhile
                    present.add(name)
                else:
                    report.mismatches.append(f"{name}: could not be created ({message or f'error {code}'})")
        report.existing = [name for name in names if name in present]
        if report.existing:
            report.mismatches += await _compare(admin, {name: names[name] for name in report.existing},
                                                replicas, exact=settings.replication_factor is not None)
    finally:
        await admin.close()
    return report


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for entry in response.topic_errors:
        name, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else None
        out.append((name, code, message))
    return out


async def _compare(admin: AIOKafkaAdminClient, specs: dict[str, TopicSpec], replicas: int, exact: bool) -> list[str]:
    """What differs from the specs, and from `replicas` per partition: any difference when the replication factor is
    set (`exact`), else fewer (one taken from the brokers up now, so a broker down is not a mismatch)."""
    mismatches = []
    for topic in await _described(admin, list(specs)):
        spec = specs[topic["topic"]]
        actual = len(topic["partitions"])
        if actual != spec.partitions:
            mismatches.append(f"{topic['topic']}: {actual} partitions, expected {spec.partitions}")
        factor = min((len(partition["replicas"]) for partition in topic["partitions"]), default=replicas)
        if factor < replicas or (exact and factor != replicas):
            mismatches.append(f"{topic['topic']}: replication factor {factor}, expected {replicas}; it is not changed "
                              "here: raise it with kafka-reassign-partitions (each partition's new replica list), or "
                              "delete the topic and have it created again (its events are lost)")
    resources = [ConfigResource(ConfigResourceType.TOPIC, name, None) for name in specs]
    for response in await admin.describe_configs(resources):
        for resource in response.resources:
            name, entries = resource[3], resource[4]
            configured = {entry[0]: entry[1] for entry in entries}
            for key, wanted in specs[name].config.items():
                if configured.get(key) != wanted:
                    mismatches.append(f"{name}: {key}={configured.get(key)}, expected {wanted}")
    return mismatches


async def _described(admin: AIOKafkaAdminClient, topics: list[str]) -> list[dict[str, Any]]:
    """The topics as the broker describes them. One just created (here or by another process) can be unknown to the
    broker for a moment, its metadata not yet handed on by the controller: "0 partitions" then is no mismatch, so it
    is asked again, for up to DESCRIBE_S."""
    deadline = time.monotonic() + DESCRIBE_S
    while True:
        described: list[dict[str, Any]] = await admin.describe_topics(topics)
        if not any(topic["error_code"] in NOT_YET_KNOWN for topic in described) or time.monotonic() > deadline:
            return described
        await asyncio.sleep(0.1)


async def partitions_of(settings: KafkaSettings, topic: str) -> list[TopicPartition]:
    """The partitions of `topic` as the cluster has them (empty if the topic does not exist)."""
    admin = make_admin(settings)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    if described["error_code"]:
        return []
    return sorted(TopicPartition(topic, p["partition"]) for p in described["partitions"])

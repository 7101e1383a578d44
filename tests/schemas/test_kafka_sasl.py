"""Kafka with SASL/SCRAM: every client kind (aiokafka's producer, consumer and admin; librdkafka's consumer, which
the scans use) authenticates with the settings' user, and a wrong password or no SASL at all is refused.

The broker is a real one (the local stack's) with a second listener that takes SCRAM only; the user is created
through the plaintext listener, as a cluster's operator would with kafka-configs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError
from confluent_kafka import Consumer, KafkaException
from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion
from pydantic import ValidationError

import agentstream.schemas as s
from agentstream.schemas.kafka import (
    KafkaSettings,
    Publisher,
    ensure_topics,
    librdkafka_auth,
    make_consumer,
    make_producer,
)
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import free_port

USER = "agentstream"
PASSWORD = uuid.uuid4().hex
JAAS = "org.apache.kafka.common.security.scram.ScramLoginModule required;"


@dataclass
class ScramKafka(LocalKafka):
    """The local broker plus a listener SASL on `sasl_port` that accepts SCRAM-SHA-512 and -256 only."""

    sasl_port: int = 0

    def _write_config(self, port: int, controller_port: int) -> Path:
        config = super()._write_config(port, controller_port)
        config.write_text(config.read_text() + "\n".join([  # a later key wins
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port},"
            f"SASL://127.0.0.1:{self.sasl_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port},"
            f"SASL://127.0.0.1:{self.sasl_port}",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL:SASL_PLAINTEXT",
            "inter.broker.listener.name=PLAINTEXT",
            "sasl.enabled.mechanisms=SCRAM-SHA-512,SCRAM-SHA-256",
            f"listener.name.sasl.scram-sha-512.sasl.jaas.config={JAAS}",
            f"listener.name.sasl.scram-sha-256.sasl.jaas.config={JAAS}",
            "",
        ]))
        return config


@pytest.fixture(scope="module")
def scram_broker(tmp_path_factory) -> str:
    """The SASL listener's address, with USER known to it by PASSWORD (SCRAM-SHA-512)."""
    broker = ScramKafka(tmp_path_factory.mktemp("scram-kafka"), default_port=None, sasl_port=free_port())
    state = broker.start()
    try:
        admin = AdminClient({"bootstrap.servers": state.url})
        upsert = UserScramCredentialUpsertion(USER, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192),
                                              PASSWORD.encode())
        for future in admin.alter_user_scram_credentials([upsert]).values():
            future.result(timeout=30)
        yield f"127.0.0.1:{broker.sasl_port}"
    finally:
        broker.stop(grace=0)


def scram(bootstrap: str, password: str = PASSWORD, **fields) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:8]}.", partitions=2,
                         security_protocol="SASL_PLAINTEXT", sasl_username=USER, sasl_password=password, **fields)


@pytest.mark.slow  # a broker of its own (10-20 s to start)
async def test_every_client_authenticates_with_scram(scram_broker):
    settings = scram(scram_broker)
    assert (await ensure_topics(settings)).ok  # the admin client
    event = s.RewardEvent(source="test", rollout_id="r1", attempt_id="a", data=s.Reward(value=1.0))
    producer = make_producer(settings)
    await producer.start()
    try:
        await Publisher(producer, settings.topics).publish(event)
    finally:
        await producer.stop()
    consumer = make_consumer(settings, settings.topics.name(event.topic), group_id=None)
    await consumer.start()
    try:
        batch = await consumer.getmany(timeout_ms=20_000)
    finally:
        await consumer.stop()
    assert [record.key for records in batch.values() for record in records] == [b"r1"]
    # librdkafka (the scans' reader): the same settings, its own names for them
    reader = Consumer({**librdkafka_auth(settings), "group.id": "sasl-test"})
    try:
        assert settings.topics.name(event.topic) in reader.list_topics(timeout=20).topics
    finally:
        reader.close()


@pytest.mark.slow
async def test_a_wrong_password_or_no_sasl_is_refused(scram_broker):
    # the attacks: a client that guessed the password, one that skips SASL, one with the other mechanism's
    # credentials (the user has SCRAM-SHA-512 only)
    for settings in (scram(scram_broker, password="guessed"), KafkaSettings(bootstrap_servers=scram_broker),
                     scram(scram_broker, sasl_mechanism="SCRAM-SHA-256")):
        producer = make_producer(settings, request_timeout_ms=5000, metadata_max_age_ms=5000)
        with pytest.raises(KafkaError):
            try:
                await producer.start()
            finally:
                await producer.stop()
    reader = Consumer({**librdkafka_auth(scram(scram_broker, password="guessed")), "group.id": "sasl-test",
                       "log_level": 0})
    try:
        with pytest.raises(KafkaException):
            reader.list_topics(timeout=10)
    finally:
        reader.close()


def test_sasl_without_credentials_is_refused_by_name():
    with pytest.raises(ValidationError, match="AGENTSTREAM_SASL_USERNAME, AGENTSTREAM_SASL_PASSWORD"):
        KafkaSettings(security_protocol="SASL_SSL", sasl_username=USER)


@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL", "SSL", "PLAINTEXT"])
def test_the_streams_worker_connects_as_the_other_services(protocol):
    """Faust takes credentials objects; what its aiokafka driver makes of them is aiokafka_auth's options."""
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    from agentstream.schemas.kafka import aiokafka_auth
    from agentstream.streams.app import broker_credentials
    from agentstream.streams.settings import StreamsSettings

    fields = {"sasl_username": USER, "sasl_password": PASSWORD} if protocol.startswith("SASL_") else {}
    settings = StreamsSettings.model_validate({"security_protocol": protocol, **fields})
    faust = credentials_to_aiokafka_auth(broker_credentials(settings))
    ours = aiokafka_auth(settings)
    assert {key: value for key, value in faust.items() if key != "ssl_context" and value is not None} == {
        key: value for key, value in ours.items() if key not in ("ssl_context", "bootstrap_servers")}
    assert ("ssl_context" in ours) == (faust.get("ssl_context") is not None)

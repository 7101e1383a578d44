"""`agentstream canary status|promote|rollback`: the releases of the log, and a human's decision.

A human decision is a `release` event like the decision service's (`decided_by` names the person), with
the last numbers measured; the first decision of a canary stands, whoever made it (`schemas.releases`).
"""

from __future__ import annotations

import getpass
from typing import Literal

from aiokafka import TopicPartition

from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.errors import ConfigurationError
from agentstream.schemas.events import ReleaseEvent
from agentstream.schemas.kafka import KafkaSettings, Publisher, make_consumer, make_producer
from agentstream.schemas.releases import ReleaseKey, ReleaseState, fold
from agentstream.schemas.scan import resolve


class NoCanary(ConfigurationError):
    """A promote or rollback of a model with no canary running: the model named cannot work as given."""


async def release_states(settings: KafkaSettings) -> dict[ReleaseKey, ReleaseState]:
    """Every model's (and tenant's) release state: the `releases` topic folded from its beginning to its end now."""
    topic = settings.topics.releases
    ends = {TopicPartition(topic, number): end for number, (_, end) in (await resolve(settings, topic)).items()}
    states: dict[ReleaseKey, ReleaseState] = {}
    if not any(ends.values()):
        return states
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        consumer.assign(list(ends))
        await consumer.seek_to_beginning(*ends)
        while [partition for partition, end in ends.items() if await consumer.position(partition) < end]:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                for record in records:
                    if record.offset < ends[TopicPartition(record.topic, record.partition)]:
                        try:
                            event = decode(record.value, expect=ReleaseEvent)
                        except DecodeError:
                            continue
                        fold(states, event)
    finally:
        await consumer.stop()
    return states


async def decide(settings: KafkaSettings, model: str, action: Literal["promote", "rollback"], reason: str,
                 who: str | None = None, tenant: str | None = None) -> ReleaseEvent:
    """Publish a human's decision about `model`'s running canary (`tenant`'s adapter's, if given); NoCanary if none
    runs."""
    state = (await release_states(settings)).get((model, tenant))
    if state is None or not state.active:
        where = f"its last release was {state.phase} (version {state.current.version})" if state else "none in the log"
        whose = f"model {model!r}" + (f" for tenant {tenant!r}" if tenant else "")
        raise NoCanary(f"{whose} has no running canary ({where}); `agentstream canary status` lists them")
    base = state.measured or state.current
    event = ReleaseEvent(source="agentstream.cli", data=base.model_copy(update=dict(
        action=action, decided_by=f"cli:{who or getpass.getuser()}", reason=reason or f"{action} by hand")))
    producer = make_producer(settings)
    await producer.start()
    try:
        await Publisher(producer, settings.topics).publish(event)
    finally:
        await producer.stop()
    return event

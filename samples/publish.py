"""Filling topics with many events, fast, for a benchmark to read."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from agentstream.schemas.events import Event
from agentstream.schemas.kafka import KafkaSettings, Publisher, make_producer


async def publish_all(settings: KafkaSettings, events: Iterable[Event], window: int = 5000) -> int:
    """Publish `events` in order through a batching producer; return how many, all acknowledged."""
    producer = make_producer(settings, linger_ms=20)
    await producer.start()
    count, pending = 0, []
    try:
        publisher = Publisher(producer, settings.topics)
        for event in events:
            pending.append(await publisher.send(event))
            count += 1
            if len(pending) >= window:  # bounded: the producer's buffer is not the whole data set
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return count

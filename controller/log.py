"""Reading a topic from its beginning, without a consumer group (history by `schemas.scan`).

The controller keeps no state of its own: on start it reads the `rollouts` topic (what happened
in this run so far) and the `weights` topic (the current version) from the beginning, then
follows `weights`. Records it cannot decode are deadlettered under an id derived from their
position, so reading the same topic again does not deadletter them twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition

from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import Event
from agentstream.schemas.ids import derived_id
from agentstream.schemas.kafka import KafkaSettings, Publisher, deadletter_event, make_consumer
from agentstream.schemas.scan import Bounds, Record, resolve, scan

log = logging.getLogger(__name__)

Handler = Callable[[Event], None]


class TopicReader:
    """A topic's history up to its current end, read by the one bounded reader (`schemas.scan`); then,
    for a follower, each new record (aiokafka, from where the history ended)."""

    def __init__(self, settings: KafkaSettings, topic: str, publisher: Publisher, name: str):
        self.settings = settings
        self.topic = topic
        self.publisher = publisher
        self.name = name
        self.positions: dict[int, int] = {}
        """next offset per partition: where following starts"""
        self.consumer: AIOKafkaConsumer | None = None

    async def stop(self) -> None:
        if self.consumer is None:
            return
        try:
            await self.consumer.stop()
        except asyncio.CancelledError:
            # aiokafka's fetcher, stopped while it backs off from a broker that is gone, lets the cancellation of
            # its own fetch task out of stop() (and a failed task group has left this task `cancelling()` anyway,
            # so the two cannot be told apart). stop() is a last step: passing it on would turn the error that
            # stopped the run into an uncaught traceback and the wrong exit code.
            log.warning("the %s reader stopped with its fetcher cancelled (the broker is gone)", self.topic)

    async def catch_up(self, handle: Handler) -> int:
        """Hand every record up to the topic's current end to `handle`; return how many."""
        log_range = await resolve(self.settings, self.topic)
        count = 0
        async for records in scan(self.settings, self.topic, Bounds.exactly(log_range, log_range)):
            count += await self._hand(records, handle)
        self.positions = {p: end for p, (_, end) in log_range.items()}
        return count

    async def read_batch(self, handle: Handler, timeout_ms: int = 1000) -> int:
        """Hand the records published since (at most one fetch) to `handle`; return how many."""
        if self.consumer is None:
            self.consumer = await self._follower()
        batches = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=1000)
        return sum([await self._hand(records, handle) for records in batches.values()])

    async def _follower(self) -> AIOKafkaConsumer:
        consumer = make_consumer(self.settings, group_id=None)
        await consumer.start()
        partitions = [TopicPartition(self.topic, p) for p in self.positions]
        consumer.assign(partitions)
        for tp in partitions:
            consumer.seek(tp, self.positions[tp.partition])
        return consumer

    async def _hand(self, records: Iterable[Record], handle: Handler) -> int:
        count = 0
        for record in records:
            event = await self._decode(record)
            if event is not None:
                handle(event)
                count += 1
        return count

    async def _decode(self, record: Record) -> Event | None:
        try:
            if record.value is None:
                raise DecodeError("a record without a value (a tombstone)")
            return decode(record.value)
        except DecodeError as exc:
            log.warning("%s: undecodable record at %s[%d]@%d: %s", self.name, record.topic, record.partition,
                        record.offset, exc)
            event = deadletter_event(record, str(exc), self.name)
            event.id = derived_id("deadletter", self.name, record.topic, str(record.partition), str(record.offset))
            await self.publisher.publish(event)
            return None

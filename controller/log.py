"""Reading a topic from its beginning, without a consumer group.

The controller keeps no state of its own: on start it reads the `rollouts` topic (what happened
in this run so far) and the `weights` topic (the current version) from the beginning, then
follows `weights`. Records it cannot decode are deadlettered under an id derived from their
position, so reading the same topic again does not deadletter them twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiokafka import ConsumerRecord, TopicPartition

from schemas.codec import DecodeError, decode
from schemas.events import Event
from schemas.ids import derived_id
from schemas.kafka import KafkaSettings, Publisher, deadletter_event, make_consumer, partitions_of

log = logging.getLogger(__name__)

Handler = Callable[[Event], None]


class TopicReader:
    def __init__(self, settings: KafkaSettings, topic: str, publisher: Publisher, name: str):
        self.settings = settings
        self.topic = topic
        self.publisher = publisher
        self.name = name
        self.consumer = make_consumer(settings, group_id=None)
        self.partitions: list[TopicPartition] = []

    async def start(self) -> None:
        self.partitions = await partitions_of(self.settings, self.topic)
        if not self.partitions:
            raise RuntimeError(f"topic {self.topic} does not exist: create the topics with "
                               "`agentstream topics ensure` (with the same --prefix)")
        await self.consumer.start()
        self.consumer.assign(self.partitions)
        await self.consumer.seek_to_beginning(*self.partitions)

    async def stop(self) -> None:
        await self.consumer.stop()

    async def catch_up(self, handle: Handler) -> int:
        """Hand every record up to the topic's current end to `handle`; return how many."""
        end = await self.consumer.end_offsets(self.partitions)
        count = 0
        while await self._behind(end):
            count += await self.read_batch(handle, timeout_ms=1000)
        return count

    async def _behind(self, end: dict[TopicPartition, int]) -> bool:
        for tp in self.partitions:
            if await self.consumer.position(tp) < end[tp]:
                return True
        return False

    async def read_batch(self, handle: Handler, timeout_ms: int = 1000) -> int:
        batches = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=1000)
        count = 0
        for records in batches.values():
            for record in records:
                event = await self._decode(record)
                if event is not None:
                    handle(event)
                    count += 1
        return count

    async def _decode(self, record: ConsumerRecord) -> Event | None:
        try:
            return decode(record.value)
        except DecodeError as exc:
            log.warning("%s: undecodable record at %s[%d]@%d: %s", self.name, record.topic, record.partition,
                        record.offset, exc)
            event = deadletter_event(record, str(exc), self.name)
            event.id = derived_id("deadletter", self.name, record.topic, str(record.partition), str(record.offset))
            await self.publisher.publish(event)
            return None

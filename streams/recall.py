"""Call events read back from the calls topic by offset: what a session's revision is built from.

A settled conversation waits `--session-retention-s` (30 days) for feedback that comes later. It keeps a
reference to each call its trajectory was built from (its offset; the partition is the session's), not the
call (prompt, token ids, logprobs: nearly all of a session's bytes), so 30 days of sessions take their ids and
times on disk, not their calls. Late feedback's revision reads those calls back here (`Assembly.wanted`).

A call the log no longer holds (the calls topic's retention shorter than the sessions', or its records
deleted) is not in what `read` returns: the assembly then makes no revision and deadletters the feedback with
why. `retention_ms` is the start's check of the same (the worker warns, and says so in /analytics).
"""

from __future__ import annotations

import time
from collections import defaultdict

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from agentstream.schemas.kafka import KafkaSettings, make_admin, make_consumer
from agentstream.streams.assembly import CallRef

READ_TIMEOUT_S = 30.0
"""how long reading back one revision's calls may take before the settling is tried again later"""


class CallLog:
    """Reads records of the calls topic at given offsets, with a consumer of no group (started on first use)."""

    def __init__(self, settings: KafkaSettings, timeout_s: float = READ_TIMEOUT_S):
        self.settings = settings
        self.topic = settings.topics.calls
        self.timeout_s = timeout_s
        self._consumer: AIOKafkaConsumer | None = None
        self.reads = 0
        """records read back (since the start)"""

    async def read(self, refs: list[CallRef]) -> dict[str, bytes]:
        """Event id → the record's value, of the references the log still holds (their ids are checked by the
        caller: a record at that offset that is another event counts as gone). A read that does not finish within
        the timeout raises `KafkaTimeoutError` (the settling is tried again at the next tick)."""
        by_partition: dict[int, dict[int, str]] = defaultdict(dict)
        for partition, offset, event_id in refs:
            by_partition[partition][offset] = event_id
        consumer = await self._started()
        tps = [TopicPartition(self.topic, partition) for partition in by_partition]
        consumer.assign(tps)
        starts = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        found: dict[str, bytes] = {}
        deadline = time.monotonic() + self.timeout_s
        for tp in tps:
            wanted = {offset: event_id for offset, event_id in by_partition[tp.partition].items()
                      if starts[tp] <= offset < ends[tp]}  # (outside: deleted, or never written here)
            found.update(await self._read_partition(consumer, tp, wanted, deadline))
        self.reads += len(found)
        return found

    async def _read_partition(self, consumer: AIOKafkaConsumer, tp: TopicPartition, wanted: dict[int, str],
                              deadline: float) -> dict[str, bytes]:
        """Seek to each wanted offset not read yet, take the wanted records of what that fetch returns."""
        found: dict[str, bytes] = {}
        left = sorted(wanted)
        while left:
            offset = left[0]
            consumer.seek(tp, offset)
            records: list[ConsumerRecord[bytes, bytes]] = []
            while not records:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"reading back {self.topic}:{tp.partition}@{offset} took over "
                                               f"{self.timeout_s:g} s")
                records = (await consumer.getmany(tp, timeout_ms=int(min(remaining, 1.0) * 1000))).get(tp, [])
            read = {record.offset: record.value for record in records}
            for at in [at for at in left if at <= records[-1].offset]:
                value = read.get(at)  # (a first record past `offset`: the ones before were deleted)
                if value is not None:
                    found[wanted[at]] = value
                left.remove(at)
        return found

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = make_consumer(self.settings, group_id=None, max_partition_fetch_bytes=1024 * 1024)
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await consumer.stop()


async def retention_ms(settings: KafkaSettings) -> int | None:
    """The calls topic's `retention.ms` (-1: forever), None if it cannot be read."""
    admin = make_admin(settings, request_timeout_ms=15_000)
    try:
        await admin.start()
        (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, settings.topics.calls)])
    except (KafkaError, OSError, TimeoutError):
        return None
    finally:
        await admin.close()
    for resource in response.resources:
        configured = {entry[0]: entry[1] for entry in resource[4]}
        value = configured.get("retention.ms")
        return int(value) if value is not None else None
    return None

"""`--hold-for-eval`: the trainer trains no version past one the eval has not measured.

`agentstream eval --follow` measures each version the pool serves, on the validation tasks, and its attempts
take minutes. A trainer that went on meanwhile would move the pool under them, and the eval event would count
for version v attempts that later versions served. Held, the trainer keeps reading samples but takes no batch
until v's eval event (`Eval.validation`) is on the metrics topic: every attempt of v's eval was served by v.

The metrics topic is read incrementally by a consumer without a group, from the beginning, so a restarted
trainer finds the versions measured before it started.
"""

from __future__ import annotations

import logging
import time

from aiokafka import AIOKafkaConsumer

from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import EvalEvent, Event
from agentstream.schemas.kafka import KafkaSettings, make_consumer

log = logging.getLogger("trainer")
HOLD_LOG_S = 60.0


class EvalHold:
    """Which versions of `model` the eval measured, read as they come."""

    def __init__(self, kafka: KafkaSettings, model: str):
        self.kafka = kafka
        self.model = model
        self.measured: set[int] = set()
        self.waiting_for: int | None = None
        """the version whose eval the trainer is waiting for (None: not held)"""
        self.consumer: AIOKafkaConsumer | None = None
        self._since: float | None = None
        self._last_log = 0.0

    async def start(self) -> None:
        self.consumer = make_consumer(self.kafka, self.kafka.topics.metrics, group_id=None)
        await self.consumer.start()

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()

    async def holds(self, version: int) -> bool:
        """Whether the next version must wait: `version`'s eval event has not been read yet."""
        await self._read()
        if version in self.measured:
            self.waiting_for = None
            if self._since is not None:
                log.info("version %d measured: training goes on after a hold of %.0f s", version,
                         time.monotonic() - self._since)
                self._since = None
            return False
        now = time.monotonic()
        self.waiting_for, self._since = version, self._since or now
        if now - self._last_log >= HOLD_LOG_S:
            self._last_log = now
            log.info("holding the next version until the eval has measured version %d (--hold-for-eval; %.0f s so "
                     "far)", version, now - self._since)
        return True

    async def _read(self) -> None:
        assert self.consumer is not None, "start() first"
        for records in (await self.consumer.getmany(timeout_ms=0)).values():
            for record in records:
                try:
                    event: Event = decode(record.value or b"")
                except DecodeError:
                    continue  # not the trainer's to judge: the streams deadletter it
                if isinstance(event, EvalEvent) and event.data.model == self.model and event.data.validation:
                    self.measured.add(event.data.weight_version)

"""Publishing the gateway's events, with the durability the settings ask for.

`ack` (the default): `record` returns only when Kafka acknowledged the event, so a response is
finished only once it is in the log; when Kafka does not answer within the publish timeout the
caller gets a 503 instead. `async`: `record` hands the event to the producer and returns; a crash
can lose the events not yet acknowledged, and failures are logged and counted, not raised.

After a timeout (in `async` mode: an event unacknowledged for longer than it) the recorder stays
"down" until the stuck event is acknowledged (the idempotent producer retries it until the broker
is back), so while Kafka is away agents get an immediate
503 rather than a response the log would not hold. The gateway starts even while Kafka is
unreachable and connects when it can.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from functools import partial
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from agentstream.gateway.errors import ErrorCode, GatewayError, Unavailable
from agentstream.gateway.logs import fields
from agentstream.gateway.metrics import Metrics
from agentstream.schemas.events import Event
from agentstream.schemas.kafka import KafkaSettings, Publisher, make_producer

log = logging.getLogger("gateway.recorder")


class Recorder:
    def __init__(self, settings: KafkaSettings, metrics: Metrics, *, durable: bool, timeout_s: float,
                 linger_ms: int = 0):
        self.settings = settings
        self.metrics = metrics
        self.durable = durable
        self.timeout_s = timeout_s
        self._linger_ms = linger_ms
        self._publisher: Publisher | None = None
        self._stuck: asyncio.Future[Any] | None = None
        self._unacked: deque[tuple[float, asyncio.Future[Any]]] = deque()
        """`async` durability: events sent and not yet acknowledged, oldest first (roughly)"""
        self._tasks: set[asyncio.Task[None]] = set()
        self._connector: asyncio.Task[None] | None = None

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect now if Kafka answers, else keep trying in the background."""
        if not await self._connect_once():
            self._connector = asyncio.create_task(self._connect_until_up())

    async def _connect_once(self) -> bool:
        producer = make_producer(self.settings, linger_ms=self._linger_ms)
        try:
            await producer.start()
        except KafkaError as exc:
            await producer.stop()
            log.warning("Kafka is unreachable; model calls get 503 until it answers",
                        extra=fields(bootstrap_servers=self.settings.bootstrap_servers, problem=str(exc)))
            return False
        self._publisher = Publisher(producer, self.settings.topics)
        log.info("connected to Kafka", extra=fields(bootstrap_servers=self.settings.bootstrap_servers))
        return True

    async def _connect_until_up(self) -> None:
        delay = 0.5
        while not await self._connect_once():
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def stop(self) -> None:
        """Flush what is queued (bounded by the publish timeout: with Kafka away, shutting down wins)."""
        if self._connector:
            self._connector.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout_s)
        if self._publisher:
            producer: AIOKafkaProducer = self._publisher.producer
            try:
                await asyncio.wait_for(producer.flush(), self.timeout_s)
                await asyncio.wait_for(producer.stop(), self.timeout_s)
            except TimeoutError:
                log.error("Kafka did not acknowledge the last events before shutdown",
                          extra=fields(unacknowledged=self.unacknowledged))

    # --- state ------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        if self._publisher is None or self._stuck is not None:
            return False
        if self._unacked and time.perf_counter() - self._unacked[0][0] > self.timeout_s:
            self._trip(self._unacked[0][1])  # `async` durability: the oldest event waits too long for its ack
            return False
        return True

    @property
    def unacknowledged(self) -> int:
        """`async` durability: events handed to the producer and not yet acknowledged."""
        return sum(1 for _, future in self._unacked if not future.done())

    def check_available(self) -> None:
        if not self.available:
            raise self._down()

    def _down(self) -> GatewayError:
        return Unavailable(
            f"Kafka ({self.settings.bootstrap_servers}) is not acknowledging events, so this call could not be "
            "recorded and is not served; retry when Kafka is back", ErrorCode.KAFKA_UNAVAILABLE, retry_after_s=2)

    # --- publishing -------------------------------------------------------------------------

    async def record(self, event: Event) -> None:
        """Publish per the durability setting; in `ack` mode raise a 503 `GatewayError` if it is not acked."""
        if self.durable:
            await self.publish(event)
        else:
            await self.enqueue(event)

    @property
    def _ready(self) -> Publisher:
        """The publisher; a 503 before Kafka was first reached (`check_available` has said so already)."""
        if self._publisher is None:
            raise self._down()
        return self._publisher

    async def enqueue(self, event: Event) -> None:
        """Hand the event to the producer and return: its ack is watched, not awaited (`async` durability)."""
        self.check_available()
        try:
            async with asyncio.timeout(self.timeout_s):
                future = await self._ready.send(event)
        except TimeoutError:
            self._trip(None)
            raise self._down() from None
        start = time.perf_counter()
        self._unacked.append((start, future))
        future.add_done_callback(partial(self._acked, event, start))

    def _acked(self, event: Event, start: float, future: asyncio.Future[Any]) -> None:
        problem = "cancelled" if future.cancelled() else future.exception()
        if problem is None:
            self.metrics.publish.observe(time.perf_counter() - start)
        else:
            self.metrics.publish_failures.labels(type(problem).__name__).inc()
            log.error("an event was not recorded", extra=fields(event_id=event.id, type=event.type,
                                                                rollout_id=event.rollout_id, problem=str(problem)))
        while self._unacked and self._unacked[0][1].done():
            self._unacked.popleft()

    async def publish(self, event: Event) -> None:
        """Publish and wait for the ack, whatever the durability setting (rewards, rollout ends, pool events)."""
        self.check_available()
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                # awaited directly (a shield would cost a loop turn): a timeout cancels this record's
                # future only; the record stays in its batch, which the producer keeps sending
                await (await self._ready.send(event))
        except TimeoutError:
            self.metrics.publish_failures.labels("timeout").inc()
            self._trip(None)
            raise self._down() from None
        except KafkaError as exc:
            self.metrics.publish_failures.labels(type(exc).__name__).inc()
            log.error("Kafka refused an event", extra=fields(event_id=event.id, type=event.type, problem=str(exc)))
            raise self._down() from None
        self.metrics.publish.observe(time.perf_counter() - start)

    def record_later(self, event: Event) -> None:
        """Publish in the background; failures are logged, never raised."""
        task = asyncio.create_task(self._publish_logged(event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish_logged(self, event: Event) -> None:
        try:
            await self.publish(event)
        except GatewayError as exc:
            log.error("an event may not be recorded", extra=fields(event_id=event.id, type=event.type,
                                                                   rollout_id=event.rollout_id, problem=exc.message))

    def _trip(self, future: asyncio.Future[Any] | None) -> None:
        """Stay down until `future` (default: everything the producer holds now) is acknowledged."""
        if self._stuck is not None:
            return
        log.error("Kafka did not acknowledge an event in time: answering model calls with 503 until it does",
                  extra=fields(bootstrap_servers=self.settings.bootstrap_servers, timeout_s=self.timeout_s))
        self._stuck = future or asyncio.ensure_future(self._ready.producer.flush())
        self._stuck.add_done_callback(self._recovered)

    def _recovered(self, future: asyncio.Future[Any]) -> None:
        self._stuck = None
        problem = "cancelled" if future.cancelled() else future.exception()
        if problem is not None:
            log.warning("a stuck event failed; trying Kafka again", extra=fields(problem=str(problem)))
        else:
            log.info("Kafka acknowledges events again; serving model calls")

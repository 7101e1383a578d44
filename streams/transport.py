"""Faust's Kafka transport: the worker's source records handed over in batches, the rest without tasks
when nothing waits.

**Batches.** Faust hands every fetched record to its streams one at a time: the conductor's callback
(a lock, flow control, the producer buffer's check, an event built, a queue put with pressure
callbacks), then the stream's iterator and its acknowledgement, then the agent's step: a large share
of what a catching-up worker spends per record. The records of topics claimed with `Transport.claim`
skip all of that: the consumer's callback (`Transport.create_consumer`, the public place to give a
consumer its callback) appends them to an `Inbox`, and the worker takes what is there in one go.
What stays Faust's: fetching, offsets read, flow control (the fetcher hands on nothing while a
rebalance suspends the flow, and the worker takes nothing until it is resumed), pausing a partition
whose records pile up (`Consumer.on_buffer_full`, as a stream's buffer does), commits of the offsets
the worker acknowledges (`Consumer.ack`), and the tables, their changelogs and rebalances.

**Where a claimed partition is read from.** After a rebalance Faust seeks every partition to the group's
committed offset. The worker's commits lag what its table holds (acknowledged records are committed every
second; the table says what was handled: worker.py), so a restarted worker fetched again, and skipped, every
record between the two (1,642 at 30 days of sessions, ~13 MiB of calls, whose pages the allocator kept).
An inbox may say where its worker's state has handled each partition up to (`Inbox.start_of`): those
offsets are committed before Faust's seek, which then starts the partition there, and Faust's own commits go
on from there. Faust has resumed the partitions before it seeks, and the consumer's thread fetches from the
old position meanwhile, so a claimed partition hands on nothing below its start (Faust's read offset, raised to it)
and is held back (paused) from the commit to the seek.

**Without tasks.**
faust-streaming 0.15.3's fetcher (`Consumer._drain_messages`) hands every record on through
`Service.wait_first(callback(message), self.suspend_flow.wait())`, so that a callback blocked on a
full stream buffer gives way when a rebalance suspends the flow. `wait_first` makes four tasks (the
callback, the flow's event, the service's stopped and crashed events), an `asyncio.wait` and three
cancellations per record, each a cost a worker catching up pays per record. Almost always the callback
does not block (the stream's buffer has room, the flow and the producer's buffer let it through).

`Consumer.wait_first` is the narrowest hook: a method of the consumer (mode's `Service`), not a copy
of the fetcher loop. For that one call shape, with the flow not suspended, it runs the callback up to
its first suspension in the fetcher's own task. A callback that finishes there (the usual case)
costs no task; one that suspends goes Faust's way, `wait_first`, for the rest of its run, so what
reaches the streams and when a rebalance or a stop cuts a callback short stay Faust's. Every other
call of `wait_first` goes to mode's as it is. Re-check `_drain_messages` when the pinned
faust-streaming changes (the call shape is matched by the flow event's `wait` coroutine).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Generator, Iterable
from typing import Any, cast

from aiokafka.errors import KafkaError
from aiokafka.producer.message_accumulator import BatchBuilder
from faust.transport.drivers import aiokafka as driver
from faust.types import TP, AppT, Message
from faust.types.transports import ConsumerCallback, ConsumerT
from mode.services import WaitResults

log = logging.getLogger("streams")
_FLOW_WAIT = asyncio.Event.wait.__code__
"""the code of `suspend_flow.wait()`, the second coroutine of the fetcher's call"""


class Rest:
    """The rest of a coroutine run up to its first suspension, resumed from the future it waits on."""

    def __init__(self, coro: Coroutine[Any, Any, Any], suspended_on: Any):
        self.coro = coro
        self.suspended_on = suspended_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, waiting = self.coro, self.suspended_on
        while True:
            try:
                sent = yield waiting
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation: into the coroutine, as a task would
                try:
                    waiting = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    waiting = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


class Consumer(driver.Consumer):
    async def perform_seek(self) -> None:
        """Faust's seek of every assigned partition to the group's committed offset, the claimed partitions
        first committed where their inbox says to start (`Inbox.start_of`).

        Faust resumes the partitions before it seeks them, and the consumer's thread fetches all the while
        from the old position. So the claimed partitions hand on nothing below their start (`_skip_below`) and
        are held back (Faust's pause: the client drops what it fetched once the seek moves the position)
        from before the commit until after the seek. Where the commit did not land (a rebalance under way),
        they are sought to their start after Faust's seek."""
        starts = self.claimed_starts(self.assignment())
        self._skip_below(starts)
        held = set(starts) - self._paused_partitions  # those Faust pauses itself (recovery) stay paused
        self.pause_partitions(held)
        try:
            if starts and not await self._committed(starts):
                log.warning("the state's positions were not committed before the seek: seeking to them")
                await super().perform_seek()
                for tp, offset in starts.items():
                    await self.seek(tp, offset)
                self._committed_offset.update(starts)  # Faust commits what is acknowledged after them
            else:
                await super().perform_seek()
        finally:
            self.resume_partitions(held)

    def resume_partitions(self, tps: Iterable[TP]) -> None:
        """Faust's resume, the claimed partitions handing on nothing below their start: the client may hold
        records fetched from before it (a partition resumed before Faust's seek after a rebalance)."""
        tps = set(tps)
        self._skip_below(self.claimed_starts(tps))
        super().resume_partitions(tps)

    def _skip_below(self, starts: dict[TP, int]) -> None:
        """Faust drops a fetched record below its partition's read offset as it hands records on (the
        records' order in the partition): raised to each start, what the state holds is not handed on."""
        for tp, offset in starts.items():
            self._read_offset[tp] = max(self._read_offset[tp] or 0, offset)

    async def _committed(self, offsets: dict[TP, int]) -> bool:
        try:
            return await self._commit_offsets(offsets)
        except KafkaError:
            log.warning("committing the state's positions failed", exc_info=True)
            return False

    def claimed_starts(self, tps: Iterable[TP]) -> dict[TP, int]:
        """The claimed partitions of `tps` whose inbox says where to start them."""
        inboxes = cast(Transport, self.transport).inboxes
        starts = {}
        for tp in tps:
            inbox = inboxes.get(tp.topic)
            if inbox is not None and inbox.start_of is not None and (offset := inbox.start_of(tp)) is not None:
                starts[tp] = offset
        return starts

    async def wait_first(self, *coros: Any, timeout: Any = None) -> WaitResults:
        if (timeout is None and len(coros) == 2 and asyncio.iscoroutine(coros[0])
                and getattr(coros[1], "cr_code", None) is _FLOW_WAIT and not self.suspend_flow.is_set()
                and not self.should_stop):
            callback, flow = coros
            try:
                first = callback.send(None)
            except StopIteration as done:  # handed on without waiting: no task
                flow.close()
                return WaitResults([callback], [done.value], False)
            except BaseException:
                flow.close()
                raise
            coros = (Rest(callback, first), flow)
        return await super().wait_first(*coros, timeout=timeout)


class Inbox:
    """The fetched records of claimed topics, in the order fetched, taken by the worker a batch at a time.

    A partition whose records pile up past `high` is paused, as Faust pauses one whose stream's
    buffer fills (`on_buffer_full`), and resumed when the worker takes them (`on_buffer_drop`).
    """

    def __init__(self, app: AppT, high: int):
        self.app = app
        self.high = high
        self.records: list[Message] = []
        self.ready = asyncio.Event()
        self.paused: set[TP] = set()
        self.start_of: Callable[[TP], int | None] | None = None
        """a partition → the offset to read it from after a rebalance (None: the group's committed offset)"""

    def put(self, message: Message) -> None:
        self.records.append(message)
        if len(self.records) >= self.high:
            tp = TP(message.topic, message.partition)  # Faust's, not the driver's, as the consumer's sets hold
            if tp not in self.paused:
                self.paused.add(tp)
                self.app.consumer.on_buffer_full(tp)
        self.ready.set()

    async def wait(self) -> None:
        """Until there are records to take."""
        await self.ready.wait()

    def take(self) -> list[Message]:
        """The records fetched since the last take; the partitions paused for them fetched again."""
        records, self.records = self.records, []
        self.ready.clear()
        for tp in self.paused:
            self.app.consumer.on_buffer_drop(tp)
        self.paused.clear()
        return records

    def clear(self) -> None:
        """Drop what was fetched before a rebalance (Faust clears its streams' buffers the same way): the
        partitions kept are read again from their committed offsets, or from a gap the worker sees."""
        self.take()


class Producer(driver.Producer):
    """Faust's producer, and aiokafka's record batches: many records of one partition in one send,
    without the per-record step of `send` (the table's changelog writes at a batch end:
    `tables.StateTable.write_all`)."""

    def create_batch(self) -> BatchBuilder:
        return self._ensure_producer().create_batch()

    async def send_batch(self, batch: BatchBuilder, topic: str, partition: int) -> asyncio.Future[Any]:
        """The batch's acknowledgement, to await (once the batch before it of the partition has gone out)."""
        sent: asyncio.Future[Any] = await self._ensure_producer().send_batch(batch, topic, partition=partition)
        return sent


class Transport(driver.Transport):
    Consumer = Consumer
    Producer = Producer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.inboxes: dict[str, Inbox] = {}
        """claimed topic → the inbox its records go to"""

    def claim(self, topics: Iterable[str], high: int) -> Inbox:
        """An inbox that gets the fetched records of these topics instead of Faust's streams; before
        the consumer starts (a record fetched before would go to a stream)."""
        inbox = Inbox(self.app, high)
        self.inboxes.update(dict.fromkeys(topics, inbox))
        return inbox

    def create_consumer(self, callback: ConsumerCallback, **kwargs: Any) -> ConsumerT:
        inboxes = self.inboxes

        async def on_message(message: Message) -> None:
            inbox = inboxes.get(message.topic)
            if inbox is None:
                await callback(message)
            else:
                inbox.put(message)

        return super().create_consumer(on_message, **kwargs)

"""Faust's Kafka transport, handing a fetched record to the streams without tasks when nothing waits.

faust-streaming 0.15.3's fetcher (`Consumer._drain_messages`) hands every record on through
`Service.wait_first(callback(message), self.suspend_flow.wait())`, so that a callback blocked on a
full stream buffer gives way when a rebalance suspends the flow. `wait_first` makes four tasks (the
callback, the flow's event, the service's stopped and crashed events), an `asyncio.wait` and three
cancellations per record: about 8 % of a catching-up worker's samples. Almost always the callback
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
from collections.abc import Coroutine, Generator
from typing import Any

from faust.transport.drivers import aiokafka as driver
from mode.services import WaitResults

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


class Transport(driver.Transport):
    Consumer = Consumer

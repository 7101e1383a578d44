"""The private parts of faust-streaming and mode that streams/transport.py relies on, pinned: when an upgrade
changes one, this fails and names it, instead of the worker silently taking the slow path or mis-matching a call.

`Consumer.wait_first` (streams/transport.py) recognises the fetcher's one call by its shape: faust's private
`Consumer._drain_messages` awaiting `self.wait_first(callback(message), self.suspend_flow.wait())`, the second
coroutine told apart by its code object (`asyncio.Event.wait.__code__`), and answers with mode's `WaitResults`."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from faust.transport import consumer as faust_consumer
from mode.services import Service, WaitResults

from agentstream.streams import transport

pytestmark = pytest.mark.upstream


def test_the_fetcher_hands_each_record_on_through_wait_first_with_the_flow_event():
    source = inspect.getsource(faust_consumer.Consumer._drain_messages)
    assert "await self.wait_first(" in source and "callback(message), self.suspend_flow.wait()" in source


async def test_the_flow_events_wait_is_told_apart_by_its_code_object():
    assert "self.suspend_flow = Event()" in inspect.getsource(faust_consumer.Consumer.__init__)
    assert faust_consumer.Event is asyncio.Event, "the flow event is asyncio's, whose wait's code is matched"
    waiting = asyncio.Event().wait()
    try:
        assert waiting.cr_code is transport._FLOW_WAIT
    finally:
        waiting.close()


def test_mode_wait_first_and_its_results_keep_their_shape():
    parameters = inspect.signature(Service.wait_first).parameters
    assert list(parameters) == ["self", "coros", "timeout"]
    assert parameters["coros"].kind is inspect.Parameter.VAR_POSITIONAL
    assert WaitResults._fields == ("done", "results", "stopped")
    assert issubclass(transport.Consumer, faust_consumer.Consumer)

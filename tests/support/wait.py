"""Waiting on a condition with a deadline (the tests' only way to wait: no sleeps as synchronization)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll until `condition()` is truthy and return its value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


async def wait_for_async(condition: Callable[[], object], timeout: float = 30.0, interval: float = 0.05,
                         what: str = "condition"):
    """`wait_for` for coroutines: `condition` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)

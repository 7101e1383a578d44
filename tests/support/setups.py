"""The expensive set-ups a test run made, counted and reported at its end: vLLM servers (40 s to 2 min each to
start) and Kafka brokers started by this pytest process (its fixtures, and the demos and recipes its tests run
in it). A count, not a time: it says whether a change of fixtures saved starts whatever the machine's load.
Servers a test's subprocess starts (a CLI run as its own process) are not in it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from agentstream.stack import kafka, vllm

COUNTED = {"vLLM servers": vllm, "Kafka brokers": kafka}
"""what is counted: each module's `spawn`, which its `start` calls once per process it starts"""
STARTED: Counter[str] = Counter()
patches = pytest.MonkeyPatch()


def pytest_configure(config: pytest.Config) -> None:
    for what, module in COUNTED.items():
        patches.setattr(module, "spawn", _counting(what, module.spawn))


def pytest_unconfigure(config: pytest.Config) -> None:
    patches.undo()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    started = ", ".join(f"{STARTED[what]} {what}" for what in COUNTED)
    terminalreporter.write_line(f"set-ups started by this process: {started}")


def _counting(what: str, spawn: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        STARTED[what] += 1
        return spawn(*args, **kwargs)
    return counted

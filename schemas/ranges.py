"""A bounded range of a topic, as every reader of the log takes it: a record, the bounds of a range (offsets, times),
a scan's progress, and the operator's way of writing a range (`--since 10m`, `--from-offsets 0:100`)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

from agentstream.schemas.errors import ConfigurationError


class Record(NamedTuple):
    """One record of a topic, as Kafka holds it (the attributes of aiokafka's ConsumerRecord)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None



@dataclass(frozen=True)
class Bounds:
    """Where a scan starts and stops. Offsets are per partition; times are UTC ms (record timestamps)."""

    since_ms: int | None = None
    until_ms: int | None = None
    start_offsets: dict[int, int] = field(default_factory=dict)
    """first offset to read, per partition (e.g. where an interrupted replay stopped)"""
    end_offsets: dict[int, int] = field(default_factory=dict)
    """offset to stop before, per partition"""

    @classmethod
    def exactly(cls, ranges: dict[int, tuple[int, int]], partitions: Iterable[int]) -> Bounds:
        """These offsets of these partitions (partition → [first, stop before)), nothing of the others."""
        return cls(start_offsets={p: ranges.get(p, (0, 0))[0] for p in partitions},
                   end_offsets={p: ranges.get(p, (0, 0))[1] for p in partitions})



@dataclass
class ScanProgress:
    total: int
    done: int = 0
    positions: dict[int, int] = field(default_factory=dict)
    """next offset to read, per partition: a resume point"""



def parse_time(text: str, now_ms: int | None = None) -> int:
    """UTC ms from epoch milliseconds, an ISO-8601 time, or an age like `10m`, `2h`, `3d`."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    age = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if age:
        seconds = float(age[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[age[2]]
        return int((now_ms if now_ms is not None else time.time() * 1000) - seconds * 1000)
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigurationError(f"cannot read time {text!r}: give epoch ms, ISO-8601 (2026-12-02T10:00), "
                         "or an age such as 10m, 2h, 3d") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def parse_offsets(text: str) -> dict[int, int]:
    """`0:100,1:250` → {0: 100, 1: 250}."""
    try:
        pairs = [part.split(":") for part in text.split(",") if part.strip()]
        return {int(partition): int(offset) for partition, offset in pairs}
    except ValueError:
        raise ConfigurationError(f"cannot read offsets {text!r}: write PARTITION:OFFSET pairs, e.g. 0:100,1:250") from None


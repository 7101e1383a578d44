"""A replay's resume state: one JSON file, replaced atomically.

The state pins the range (as offsets, resolved when the replay first ran), says how far the source
has been read and how much output is durable. A replay writes its output first and this file
second, so a replay killed at any point resumes from the last state: the output written after it
is either cut off (files) or recognised and not written again (a topic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from agentstream.schemas.durable import write_atomically
from agentstream.schemas.errors import ConfigurationError

FORMAT = 1


class ReplayError(ConfigurationError):
    """What an operator can fix: the message says how."""


@dataclass
class ReplayState:
    job: dict[str, Any]
    """what the replay does (its signature): a resume must be the same job"""
    ranges: dict[str, dict[int, tuple[int, int]]]
    """topic → partition → (first offset, stop before), fixed at the first run"""
    plan: dict[str, Any] = field(default_factory=dict)
    """other values fixed at the first run (e.g. the time at which a rebuild closes the range)"""
    source: dict[str, Any] | None = None
    """the source's position after the last chunk whose output is durable; None: not started"""
    sink: dict[str, Any] = field(default_factory=dict)
    """how much output is durable (bytes, parts, or the output topic's end offsets)"""
    counts: dict[str, int] = field(default_factory=dict)
    done: bool = False

    def save(self, path: Path) -> None:
        """Write to a temporary file, flush it to disk, and rename it over the old state."""
        path.parent.mkdir(parents=True, exist_ok=True)
        body = orjson.dumps({
            "format": FORMAT, "job": self.job, "plan": self.plan, "source": self.source, "sink": self.sink,
            "counts": self.counts, "done": self.done,
            "ranges": {topic: {str(p): list(r) for p, r in parts.items()} for topic, parts in self.ranges.items()},
        }, option=orjson.OPT_NON_STR_KEYS)
        write_atomically(path, lambda tmp: tmp.write_bytes(body))

    @classmethod
    def load(cls, path: Path) -> ReplayState | None:
        if not path.is_file():
            return None
        try:
            raw = orjson.loads(path.read_bytes())
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')}, expected {FORMAT}")
            return cls(job=raw["job"], plan=raw["plan"], source=raw["source"], sink=raw["sink"],
                       counts=raw["counts"], done=raw["done"],
                       ranges={topic: {int(p): (r[0], r[1]) for p, r in parts.items()}
                               for topic, parts in raw["ranges"].items()})
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ReplayError(f"the resume state {path} is unreadable ({exc}); delete it, or pass --restart "
                              "to start this replay over") from None


def int_keys(mapping: dict[str, Any]) -> dict[int, Any]:
    """JSON object keys are strings; partitions are ints."""
    return {int(key): value for key, value in mapping.items()}

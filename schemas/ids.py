"""Event ids and timestamps.

Ids are UUIDv7: unique, and sortable by creation time. Events derived from other events
(a trajectory from an attempt, a scored reward from a trajectory) get *derived* ids, a UUIDv5
of their inputs, so a processor that runs twice over the same input emits the same id and
downstream consumers drop the repeat.
"""

from __future__ import annotations

import time
import uuid

import uuid_utils

_NAMESPACE = uuid.UUID("6f1c2a8e-4b3d-4e59-9a51-0d7c9b1e2f30")


def new_id() -> str:
    return str(uuid_utils.uuid7())


def derived_id(*parts: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, "\x1f".join(parts)))


def now_ms() -> int:
    return time.time_ns() // 1_000_000

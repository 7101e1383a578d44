"""A rebuild's settled rollouts, kept in files beside its resume state rather than in it.

The assembly keeps a settled attempt's event ids and marker for `retention_ms` (6 h by default): a
late event for it is deadlettered as late, a repeat dropped as a duplicate. A resumed rebuild must
decide those as the uninterrupted one did, so it needs them all; held in the resume position, they
would be dumped whole with every position, a cost that grows with the log read so far at every
checkpoint. Instead, each partition's
rollouts are appended to a file of its own as they become settled (or forgotten), once each, and the
position keeps only the rollouts with an attempt still open, and each file's length. A resume cuts a
file back to its length (what a killed run appended after its last saved state) and reads it first,
then the position's open rollouts over it. The files are per partition, so a state written by
`--jobs 2` resumes with `--jobs 1` and back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from agentstream.logs.replay.state import ReplayError
from agentstream.schemas.durable import fsync


class Tracked(dict[str, dict[str, Any]]):
    """An assembly's rollouts, noting which changed (`Assembly` assigns a rollout's state whole, or deletes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed: set[str] = set()

    def __setitem__(self, key: str, value: dict[str, Any]) -> None:
        super().__setitem__(key, value)
        self.changed.add(key)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.changed.add(key)


def folder(state: Path) -> Path:
    """Where the settled files of the replay whose state is `state` go."""
    return state.with_name(state.name + ".settled")


class SettledLog:
    """One partition's settled rollouts: a JSON line per change, `[id, state]`, or `[id, null]` once forgotten."""

    def __init__(self, directory: Path, partition: int, length: int):
        """Cut the file back to `length` (the saved state's), making it where there is none yet (length 0)."""
        self.path = directory / f"partition-{partition}.jsonl"
        directory.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists()
        size = self.path.stat().st_size if existed else 0
        if size < length:
            raise ReplayError(f"{self.path} is shorter than the resume state says ({size} < {length} bytes): it was "
                              "changed since; pass --restart to rebuild from the start")
        with self.path.open("ab") as file:
            file.truncate(length)
        if not existed:
            fsync(directory)  # (its entry durable before any state counts on it)
        self.length = length
        self.open: set[str] = set()
        """rollouts with an attempt not settled or events held, as of the last `sync` (the position holds them)"""

    def load(self) -> dict[str, dict[str, Any]]:
        """The rollouts as the file has them (the last line of each wins)."""
        rollouts: dict[str, dict[str, Any]] = {}
        with self.path.open("rb") as file:
            for line in file:
                rollout_id, state = orjson.loads(line)
                if state is None:
                    rollouts.pop(rollout_id, None)
                else:
                    rollouts[rollout_id] = state
        return rollouts

    def sync(self, rollouts: Tracked) -> int:
        """Append the rollouts settled or forgotten since the last sync, durably; note the open ones; the length."""
        lines = []
        for rollout_id in rollouts.changed:
            state = rollouts.get(rollout_id)
            if state is not None and (state.get("held") or not all(
                    attempt.get("settled") for attempt in state["attempts"].values())):  # (held: a session's events)
                self.open.add(rollout_id)
                continue
            self.open.discard(rollout_id)
            lines.append(orjson.dumps([rollout_id, state]) + b"\n")
        rollouts.changed.clear()
        if lines:
            with self.path.open("ab") as file:
                file.write(b"".join(lines))
                file.flush()
                os.fsync(file.fileno())
                self.length = file.tell()
        return self.length

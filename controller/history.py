"""What the `rollouts` topic says about this run: the controller's only state.

Every attempt starts with a `rollout.queued` event (published and acknowledged before the
agent is launched) and ends with one terminal event: `finished`, `failed` or `timed_out`. An
attempt with a queued event and no terminal one was interrupted (its controller died); the
next controller closes it with a `failed` event whose error starts with `INTERRUPTED` and runs
the rollout again as a new attempt. Interruptions are not the agent's fault, so they do not
count against `max_attempts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentstream.schemas.events import (
    TERMINAL_TYPES,
    Event,
    RolloutFailedEvent,
    RolloutQueuedEvent,
    RolloutStartedEvent,
)

INTERRUPTED = "interrupted"


@dataclass
class AttemptRecord:
    attempt_id: str
    attempt_number: int
    weight_version: int | None
    worker: str | None = None
    outcome: str | None = None
    """type of the terminal event, once there is one"""
    interrupted: bool = False


@dataclass
class RolloutRecord:
    attempts: dict[str, AttemptRecord] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return any(a.outcome == "rollout.finished" for a in self.attempts.values())

    @property
    def failures(self) -> int:
        """Attempts the agent failed or ran out of time on (interruptions excluded)."""
        return sum(1 for a in self.attempts.values() if a.outcome in TERMINAL_TYPES - {"rollout.finished"}
                   and not a.interrupted)

    @property
    def last_attempt_number(self) -> int:
        return max((a.attempt_number for a in self.attempts.values()), default=0)

    @property
    def open_attempts(self) -> list[AttemptRecord]:
        return [a for a in self.attempts.values() if a.outcome is None]

    @property
    def launch_version(self) -> int | None:
        """The weight version at the rollout's first launch."""
        first = min(self.attempts.values(), key=lambda a: a.attempt_number, default=None)
        return first.weight_version if first else None


class RunHistory:
    """Per-rollout records of one run, fed with the run's events (recovered or just published)."""

    def __init__(self, rollout_ids: set[str]):
        self.rollout_ids = rollout_ids
        self.records: dict[str, RolloutRecord] = {}
        self._seen: set[str] = set()

    def record(self, rollout_id: str) -> RolloutRecord:
        return self.records.get(rollout_id) or RolloutRecord()

    def apply(self, event: Event) -> None:
        if event.rollout_id not in self.rollout_ids or event.attempt_id is None or event.id in self._seen:
            return
        self._seen.add(event.id)
        record = self.records.setdefault(event.rollout_id, RolloutRecord())
        if isinstance(event, RolloutQueuedEvent):
            record.attempts.setdefault(event.attempt_id, AttemptRecord(
                event.attempt_id, event.data.attempt_number, event.data.weight_version))
            return
        attempt = record.attempts.get(event.attempt_id)
        if attempt is None:  # not an attempt this run queued (e.g. a stray gateway event): not ours to judge
            return
        if isinstance(event, RolloutStartedEvent):
            attempt.worker = event.data.worker
        elif event.type in TERMINAL_TYPES and attempt.outcome is None:
            attempt.outcome = event.type
            attempt.interrupted = isinstance(event, RolloutFailedEvent) and event.data.error.startswith(INTERRUPTED)

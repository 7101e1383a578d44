"""A replay as the operator asks for it (the `agentstream replay` flags, as text), made into a `Job` and its
`Options`: the range and selection parsed, and a rebuild timed as the live streams worker is."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from agentstream.logs.replay.rebuild import RebuildSpec
from agentstream.logs.replay.run import Job, Options, RangeSpec, default_state
from agentstream.logs.replay.selection import parse_rollouts, parse_versions
from agentstream.schemas.errors import ConfigurationError
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import KAFKA, Origin


@dataclass(frozen=True)
class Request:
    """What to replay and how; None: the streams worker's setting (its environment, else its default)."""

    topic_prefix: str = ""
    since: str | None = None
    until: str | None = None
    from_offsets: str | None = None
    to_offsets: str | None = None
    rollouts: str | None = None
    """ID,ID,… or @FILE"""
    versions: str | None = None
    """3 or 3,5-7"""
    reward_fn: str | None = None
    reward_policy: str | None = None
    session_idle_s: float | None = None
    feedback_window_s: float | None = None
    settle_s: float | None = None
    reward_grace_s: float | None = None
    idle_timeout_s: float | None = None
    lookback_s: float = 3600.0
    state: Path | None = None
    """the resume state file; None: next to the output"""
    restart: bool = False
    checkpoint_s: float = 5.0
    batch_size: int = 5000
    jobs: int = 0
    origin: Origin = KAFKA
    """where the range is read from (the CLI's default: `auto`, with its archive folder)"""

    @property
    def rescores(self) -> bool:
        """whether it asks for new rewards (which only a rebuild from the raw events gives)"""
        return bool(self.reward_fn or self.reward_policy)

    def source(self, given: str | None, default: str) -> str:
        """The source asked for (`--from`); else raw where it rescores, else `default`."""
        if given is None:
            return "raw" if self.rescores else default
        return given

    def job(self, source: str, sink: str, target: str) -> Job:
        from agentstream.streams.settings import StreamsSettings

        given: dict[str, Any] = {"settle_s": self.settle_s, "reward_grace_s": self.reward_grace_s,
                 "idle_timeout_s": self.idle_timeout_s, "reward_policy": self.reward_policy,
                 "session_idle_s": self.session_idle_s, "feedback_window_s": self.feedback_window_s}
        try:
            worker = StreamsSettings(**{name: value for name, value in given.items() if value is not None})
            return Job(source=source, sink=sink, target=target,
                       range=RangeSpec(self.since, self.until, self.from_offsets, self.to_offsets),
                       rollouts=parse_rollouts(self.rollouts) if self.rollouts else frozenset(),
                       versions=parse_versions(self.versions) if self.versions else frozenset(),
                       rebuild=RebuildSpec(self.reward_fn, worker.timing, int(self.lookback_s * 1000), worker.source,
                                           worker.reward_policy))
        except ValueError as exc:  # (pydantic's ValidationError is one)
            raise ConfigurationError(str(exc)) from None

    def options(self, settings: KafkaSettings, job: Job) -> Options:
        return Options(self.state or default_state(settings, job), self.restart, self.checkpoint_s, self.batch_size,
                       self.origin, jobs=self.jobs)

    def staging_file(self, source: str) -> Path:
        """Where `replay train` stages this selection for the trainer: one file per selection, so that the
        same command resumes its staging."""
        selection = orjson.dumps([self.topic_prefix, source, self.since, self.until, self.from_offsets,
                                  self.to_offsets, self.rollouts, self.versions, self.reward_fn, self.settle_s,
                                  self.reward_grace_s, self.idle_timeout_s, self.lookback_s, self.reward_policy,
                                  self.session_idle_s, self.feedback_window_s])
        return Path("runs") / "replay" / f"train-{hashlib.sha256(selection).hexdigest()[:10]}.jsonl"

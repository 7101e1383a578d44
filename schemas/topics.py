"""Topic names and settings.

Rollout-scoped topics are keyed by rollout id and share one partition count, so every event of
one rollout lands in one partition in order and the stream processors can join them without a
repartition. Raw topics keep everything (retention -1): they are the training data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FOREVER = -1
DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicSpec:
    base: str
    partitions: int
    retention_ms: int = FOREVER
    cleanup_policy: str = "delete"
    key: str = "rollout_id"
    extra_config: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, str]:
        return {"retention.ms": str(self.retention_ms), "cleanup.policy": self.cleanup_policy, **self.extra_config}


ROLLOUT_SCOPED = ("rollouts", "calls", "rewards", "trajectories")


def topic_specs(partitions: int) -> list[TopicSpec]:
    """Every topic agentstream uses; `partitions` applies to the rollout-scoped ones."""
    return [
        *(TopicSpec(base, partitions) for base in ROLLOUT_SCOPED),
        TopicSpec("weights", 1, key="model"),
        TopicSpec("pool", 1, key="model"),
        TopicSpec("releases", 1, key="model"),
        TopicSpec("deadletter", 1, retention_ms=30 * DAY_MS, key="original key"),
        TopicSpec("metrics", 1, retention_ms=7 * DAY_MS, key="window"),
    ]


@dataclass(frozen=True)
class Topics:
    """Full topic names under a prefix: `Topics("exp1.").calls == "exp1.calls"`."""

    prefix: str = ""

    def name(self, base: str) -> str:
        return f"{self.prefix}{base}"

    @property
    def rollouts(self) -> str:
        return self.name("rollouts")

    @property
    def calls(self) -> str:
        return self.name("calls")

    @property
    def rewards(self) -> str:
        return self.name("rewards")

    @property
    def trajectories(self) -> str:
        return self.name("trajectories")

    @property
    def weights(self) -> str:
        return self.name("weights")

    @property
    def pool(self) -> str:
        return self.name("pool")

    @property
    def releases(self) -> str:
        return self.name("releases")

    @property
    def deadletter(self) -> str:
        return self.name("deadletter")

    @property
    def metrics(self) -> str:
        return self.name("metrics")

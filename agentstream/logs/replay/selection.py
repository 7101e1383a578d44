"""What a replay keeps: the trajectories of some rollouts, made by some weight versions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from agentstream.schemas.events import Trajectory, TrajectoryEvent


@dataclass(frozen=True)
class Selection:
    rollouts: frozenset[str] = frozenset()
    """rollout ids to keep; empty: all"""
    versions: frozenset[int] = frozenset()
    """weight versions to keep (see `versions_of`); empty: all"""
    started_from_ms: int | None = None
    """keep only attempts that started at or after this time: a rebuild bounded by time reads some
    history before the range, so that attempts running across its start are not rebuilt from half
    their events, and leaves those attempts out"""

    @property
    def looks_inside(self) -> bool:
        """whether it looks at more of a trajectory than its rollout id (its start, its weight versions)"""
        return bool(self.versions) or self.started_from_ms is not None

    def wants_rollout(self, rollout_id: str | None) -> bool:
        return not self.rollouts or rollout_id in self.rollouts

    def wants(self, event: TrajectoryEvent) -> bool:
        data = event.data
        return self.wants_fields(event.rollout_id, data.started_at, lambda: versions_of(data))

    def wants_fields(self, rollout_id: str | None, started_at: int | None, versions: Callable[[], set[int]]) -> bool:
        """`wants`, of a trajectory's fields (read into columns); `versions` is asked only if needed."""
        if not self.wants_rollout(rollout_id):
            return False
        if self.started_from_ms is not None and (started_at is None or started_at < self.started_from_ms):
            return False
        return not self.versions or bool(versions() & self.versions)


def versions_of(trajectory: Trajectory) -> set[int]:
    """The weight versions that generated the trajectory's tokens; its launch version if no turn says."""
    return made_by((turn.weight_version for turn in trajectory.turns), trajectory.weight_version_launch)


def made_by(turn_versions: Iterable[int | None], launch: int | None) -> set[int]:
    """`versions_of`, of the turns' weight versions and the launch version."""
    made = {version for version in turn_versions if version is not None}
    if not made and launch is not None:
        made = {launch}
    return made


def parse_versions(text: str) -> frozenset[int]:
    """`3`, `3,5`, `3-6` (inclusive), or a mix: `1,4-6`."""
    versions: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            low, dash, high = part.partition("-")
            if dash:
                if int(high) < int(low):
                    raise ValueError
                versions.update(range(int(low), int(high) + 1))
            else:
                versions.add(int(low))
    except ValueError:
        raise ValueError(f"cannot read weight versions {text!r}: write versions and ranges, e.g. 3,5-7") from None
    return frozenset(versions)


def parse_rollouts(text: str) -> frozenset[str]:
    """Comma-separated rollout ids, or `@FILE` with one id per line."""
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise ValueError(f"rollout id file {path} does not exist (after @ give a file with one id per line)")
        ids = path.read_text().split()
    else:
        ids = [part.strip() for part in text.split(",")]
    ids = [rollout_id for rollout_id in ids if rollout_id]
    if not ids:
        raise ValueError(f"no rollout ids in {text!r}: give ids separated by commas, or @FILE")
    return frozenset(ids)

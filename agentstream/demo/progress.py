"""What a run shows while it runs: a fold over the trajectories, weights and pool topics, per weight version, and
the plot of its numbers by version."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from agentstream.schemas.events import Event, PoolUpdateEvent, TrajectoryEvent, WeightsEvent

if TYPE_CHECKING:
    from agentstream.demo.loop import Loop


@dataclass
class VersionRow:
    version: int
    rewards: list[float] = field(default_factory=list)
    trained: int | None = None
    pause_ms: float | None = None
    published_at: float | None = None

    @property
    def reward_mean(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


class Progress:
    """Per weight version: the rewards of answers it generated, the samples it was trained on, the
    pause its swap cost."""

    row_type: type[VersionRow] = VersionRow

    def __init__(self) -> None:
        self.rows: dict[int, VersionRow] = {}
        self.seen: set[str] = set()
        self.started = time.monotonic()
        self.loop: Loop | None = None
        """the loop the run launched: the settings each service ran with"""

    def row(self, version: int) -> VersionRow:
        return self.rows.setdefault(version, self.row_type(version))

    def add(self, event: Event) -> None:
        """Fold an event in, once (a topic may hold it twice)."""
        if event.id not in self.seen:
            self.seen.add(event.id)
            self.take(event)

    def take(self, event: Event) -> None:
        if isinstance(event, TrajectoryEvent) and event.data.reward is not None and event.data.split == "train":
            versions = [turn.weight_version for turn in event.data.turns if turn.weight_version is not None]
            self.row(min(versions) if versions else 0).rewards.append(event.data.reward)
        elif isinstance(event, WeightsEvent):
            row = self.row(event.data.version)
            row.trained = len(event.data.lineage)
            row.published_at = time.monotonic() - self.started
        elif isinstance(event, PoolUpdateEvent) and event.data.status == "ok" and event.data.pause_ms > 0:
            self.row(event.data.version).pause_ms = event.data.pause_ms

    def table(self) -> Table:
        table = Table(title="agentstream demo: reward of the answers each weight version wrote")
        for column in ("version", "answers", "reward mean", "trained on", "swap pause", "published at"):
            table.add_column(column, justify="right")
        for version in sorted(self.rows):
            row = self.rows[version]
            table.add_row(
                str(version), str(len(row.rewards)),
                f"{row.reward_mean:.3f}" if row.reward_mean is not None else "",
                "" if row.trained is None else f"{row.trained} samples",
                "" if row.pause_ms is None else f"{row.pause_ms:.0f} ms",
                "" if row.published_at is None else f"{row.published_at:.0f} s",
            )
        return table


Interval = Sequence[float] | None
"""(low, high) of a value, or None where it has none"""


def plot_by_version(path: Path, title: str, versions: list[int], lines: Mapping[str, Sequence[float | None]],
                    ylabel: str | None = None, ylim: tuple[float, float] = (-0.05, 1.05),
                    decorate: Callable[[Any], None] | None = None,
                    intervals: Mapping[str, Sequence[Interval]] | None = None) -> None:
    """One line per entry of `lines` (label → a value per version; unlabelled: no legend) into a PNG, each with its
    band where `intervals` gives one (label → a (low, high) per version, e.g. a 95 % interval); `decorate(axis)`
    adds to the axes last (markers, its own legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for (label, values), marker in zip(lines.items(), "os^v"):
        [line] = axis.plot(versions, [float("nan") if value is None else value for value in values], marker=marker,
                           label=label or None)
        if bands := (intervals or {}).get(label):
            low = [float("nan") if band is None else band[0] for band in bands]
            high = [float("nan") if band is None else band[1] for band in bands]
            axis.fill_between(versions, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
    axis.set_xlabel("weight version")
    if ylabel:
        axis.set_ylabel(ylabel)
    axis.set_ylim(*ylim)
    axis.set_xticks(versions)
    axis.set_title(title)
    if any(lines):
        axis.legend()
    if decorate:
        decorate(axis)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

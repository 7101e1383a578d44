"""A whole history folded at once: the trajectories a streams worker would emit for a list of events,
for tests and benchmarks that hold every event in memory."""

from __future__ import annotations

from collections.abc import Iterable

from agentstream.schemas.codec import encode
from agentstream.schemas.events import Event, TrajectoryEvent
from agentstream.streams.assembly import Assembly, Timing


def assemble(events: Iterable[Event], timing: Timing = Timing(), now_ms: int | None = None,
             source: str = "streams") -> list[TrajectoryEvent]:
    """The trajectories of every attempt in `events` (in log order) that is due by `now_ms`.

    Without `now_ms`, every attempt with an ending settles as if its grace periods had passed; those
    with none stay open.
    """
    assembly = Assembly({}, {}, timing, source)
    latest = 0
    for event in events:
        if event.rollout_id and event.type != "trajectory":
            assembly.add(event, encode(event), 0)
            latest = max(latest, event.time)
    if now_ms is None:
        now_ms = latest + max(timing.settle_ms, timing.reward_grace_ms)
    return assembly.settle_due(now_ms).trajectories

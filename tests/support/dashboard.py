"""A known set of events for the dashboard: rollouts over three weight versions, their calls, rewards,
trajectories (with token sequences), the weights that trained on them and the pool's swaps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import uvicorn

import agentstream.schemas as s
from agentstream.dashboard.app import create_app
from agentstream.dashboard.settings import DashboardSettings
from agentstream.stack.process import free_port
from samples.events import TASKS, UPSTREAMS, VERSIONS, prompt, rollout  # noqa: F401 (the tests' names)
from tests.support.wait import wait_for_async


@contextlib.asynccontextmanager
async def serving(settings: DashboardSettings) -> AsyncIterator[str]:
    """The dashboard in this process on a free port; its base URL."""
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=free_port(),
                                           log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    await wait_for_async(lambda: server.started, timeout=30, what="the dashboard to start")
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        await task


def generated_tokens(trajectory: s.TrajectoryEvent) -> int:
    return sum(sum(seq.mask) for seq in trajectory.data.sequences)


def known_events(now_ms: int) -> list[s.Event]:
    """24 attempts (3 versions × 3 tasks, train and validation), 2 versions trained, 4 swaps."""
    events: list[s.Event] = []
    base = now_ms - 60_000
    index = 0
    for version in VERSIONS:
        for task in TASKS:
            for split, reward in (("train", 0.25 * version), ("train", 1.0 if version == 2 else 0.0),
                                  ("validation", 0.5)):
                events += rollout(index, version, task, split, reward, turns=1 + index % 3, base_ms=base)
                index += 1
    events += rollout(index, 2, "add-2-3", "train", None, turns=2, status="failed", base_ms=base)
    trajectories = [e for e in events if isinstance(e, s.TrajectoryEvent)]
    for version in (1, 2):
        trained = [t.id for t in trajectories if t.data.weight_version_launch == version - 1 and t.data.split == "train"]
        events.append(s.WeightsEvent(source="trainer", time=base + 1000 * version, data=s.Weights(
            model="tiny", version=version, uri=f"/ckpt/v{version}", step=version, base_version=version - 1,
            lineage=trained)))
        for n, server in enumerate(UPSTREAMS):
            events.append(s.PoolUpdateEvent(source="gateway", time=base + 1000 * version + 100 + n, data=s.PoolUpdate(
                model="tiny", version=version, server=server, status="ok", pause_ms=40.0 * version + n,
                load_ms=30.0, held_ms=45.0, applied_by="gw-test")))
    return events

"""Weight versions and bounded staleness.

The controller follows the `weights` topic to tag each rollout with the version current at its
launch, and, when pacing is on, to keep the rollouts from running too far ahead of the trainer.

The lag, precisely. The trainer takes `train_batch_size` (B) train trajectories per weight
version. Let V0 be the version current when the run launched its first rollout (0 before any
`weights` event), V the current version, and A the number of train rollouts admitted so far
that can still reach the trainer (launched, and not given up after `max_attempts` failures).
The rollouts admitted so far are enough for ceil(A / B) versions after V0; the trainer is
behind by lag = A/B - (V - V0) versions of launched work. A new train rollout is admitted only
while A < (V - V0 + max_staleness + 1) * B, so no train rollout is launched more than
`max_staleness` versions before the version whose batch it will land in (AReaL's
`max_head_offpolicyness`, in rollouts). With max_staleness 0 this is synchronous on-policy RL:
one batch, wait for the next version, the next batch. Validation rollouts never feed the
trainer, so they are not paced. Retries of an admitted rollout need no new admission.
"""

from __future__ import annotations

import asyncio
import logging

from agentstream.controller.log import TopicReader
from agentstream.schemas.events import Event, WeightsEvent

log = logging.getLogger(__name__)


class WeightsFollower:
    """The newest weight version on the `weights` topic (of one model, or of any when unset) for one tenant's
    adapter, or for the shared policy (`tenant` None): another tenant's versions pace no one else's rollouts."""

    def __init__(self, reader: TopicReader, model: str | None, tenant: str | None = None):
        self.reader = reader
        self.model = model
        self.tenant = tenant
        self.version: int | None = None
        self.changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    def _apply(self, event: Event) -> None:
        if not isinstance(event, WeightsEvent) or (self.model and event.data.model != self.model) \
                or event.data.tenant != self.tenant:
            return
        if self.version is None or event.data.version > self.version:
            self.version = event.data.version

    async def start(self) -> None:
        """Read up to the current end (so the first launch sees the current version), then follow."""
        await self.reader.catch_up(self._apply)
        self._task = asyncio.create_task(self._follow(), name="weights-follower")

    async def _follow(self) -> None:
        while True:
            before = self.version
            try:
                await self.reader.read_batch(self._apply)
            except Exception:  # keep following: a stale version would hold pacing back for good
                log.exception("reading the weights topic failed; retrying")
                await asyncio.sleep(1.0)
            if self.version != before:
                log.info("weight version is now %s", self.version)
                async with self.changed:
                    self.changed.notify_all()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.reader.stop()


class Pacer:
    """Admits train rollouts under the bound above; without settings it admits everything."""

    def __init__(self, weights: WeightsFollower, max_staleness: int | None, batch_size: int | None,
                 admitted: int = 0, base_version: int | None = None):
        self.weights = weights
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.admitted = admitted
        self.base_version = base_version
        self.waiting = 0

    @property
    def limits(self) -> tuple[int, int] | None:
        """(max staleness, batch size), when pacing is on (both set)."""
        if self.max_staleness is None or self.batch_size is None:
            return None
        return self.max_staleness, self.batch_size

    @property
    def current(self) -> int:
        return self.weights.version or 0

    @property
    def budget(self) -> int | None:
        """Train rollouts that may be admitted in total at the current version."""
        if self.limits is None:
            return None
        max_staleness, batch_size = self.limits
        base = self.base_version if self.base_version is not None else self.current
        return (self.current - base + max_staleness + 1) * batch_size

    def _room(self) -> bool:
        budget = self.budget
        return budget is None or self.admitted < budget

    async def admit(self) -> None:
        """Wait until a new train rollout may launch, and count it."""
        if self.base_version is None:
            self.base_version = self.current
        async with self.weights.changed:
            self.waiting += 1
            try:
                await self.weights.changed.wait_for(self._room)
            finally:
                self.waiting -= 1
            self.admitted += 1

    async def release(self) -> None:
        """A train rollout was given up: it will never reach the trainer."""
        async with self.weights.changed:
            self.admitted -= 1
            self.weights.changed.notify_all()

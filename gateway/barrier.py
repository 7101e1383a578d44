"""The barrier before a pause: the applier pauses a server only once every live gateway replica holds the model.

A replica holds a model's new requests when the `weights` event (a canary's or a promotion's `releases` event)
reaches its own follower, and that is not the same moment everywhere. A replica that sees it after the applier
drained still sends requests: they reach the paused engine, wait there through the reload (keep mode freezes them;
if the applier dies there, until another replica takes the update over), and their call events carry the version
before while the new weights sample their tokens (`CallRecord.weight_version` is read when the request is sent).

So every replica, once it holds for an event and its own requests of the model drained (streamed ones excepted,
with partial rollouts), publishes a `pool.held` event naming that event; the applier learns the live replicas from
the broker (the members of the pool-sync group: each one's client id carries its replica id) and waits until each
other one said so, up to --barrier-timeout-s, then pauses anyway with a warning naming those that did not. A
replica that applies no updates (--no-apply-updates) is not a member, so it is not waited for; a replica alone in
the group waits for no one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

from aiokafka.errors import KafkaError

from agentstream.gateway.errors import GatewayError
from agentstream.gateway.logs import fields
from agentstream.gateway.pool import Pool
from agentstream.gateway.recorder import Recorder
from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas.events import PoolHeld, PoolHeldEvent
from agentstream.schemas.ids import derived_id
from agentstream.schemas.kafka import make_admin

log = logging.getLogger("gateway.barrier")

CLIENT_PREFIX = "agentstream-gateway."
"""the pool-sync consumer's client id is this and the replica id: the broker's list of members names replicas"""

KEPT = 256
"""events whose acknowledgements a replica remembers (an update taken over later finds them)"""


def client_id(replica_id: str) -> str:
    return CLIENT_PREFIX + replica_id


class Barrier:
    def __init__(self, settings: GatewaySettings, pool: Pool, recorder: Recorder):
        self.settings = settings
        self.pool = pool
        self.recorder = recorder
        self.acks: OrderedDict[str, set[str]] = OrderedDict()
        """id of the event held for -> the replicas that said they hold for it"""
        self._arrived = asyncio.Event()
        """set (and replaced) at each acknowledgement"""
        self._tasks: set[asyncio.Task[None]] = set()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- every replica: say it holds -----------------------------------------------------------

    def held(self, cause: str, model: str, version: int) -> None:
        """This replica holds `model` for the event `cause`: say so once its own requests of the model drained."""
        task = asyncio.create_task(self._acknowledge(cause, model, version))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _acknowledge(self, cause: str, model: str, version: int) -> None:
        if not await self.pool.drain(model, [], self.settings.drain_timeout_s,
                                     followed_go_on=self.settings.partial_rollouts):
            log.warning("own requests still in flight after the drain timeout: saying the model is held anyway (the "
                        "applier's drain waits on the servers' counts)", extra=fields(model=model, version=version))
        replica = self.settings.replica_id
        event = PoolHeldEvent(id=derived_id("pool.held", cause, replica), source=self.settings.source,
                              data=PoolHeld(model=model, version=version, cause=cause, replica=replica))
        try:
            await self.recorder.publish(event)
        except GatewayError as exc:  # the applier waits its bound, then pauses anyway
            log.warning("could not say the model is held", extra=fields(model=model, version=version,
                                                                        problem=exc.message))

    def observe(self, held: PoolHeld) -> None:
        """A replica's `pool.held` event (this one's too)."""
        self.acks.setdefault(held.cause, set()).add(held.replica)
        self.acks.move_to_end(held.cause)
        while len(self.acks) > KEPT:
            self.acks.popitem(last=False)
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()

    # --- the applier: wait for them ------------------------------------------------------------

    async def wait(self, cause: str, model: str, version: int) -> None:
        """Return once every other live replica holds for `cause`, or the bound passed (a warning names those
        that did not answer)."""
        bound = self.settings.barrier_timeout_s
        if bound <= 0:
            return
        start = time.monotonic()
        try:
            others = await asyncio.wait_for(self.members(), bound) - {self.settings.replica_id}
        except (KafkaError, OSError, TimeoutError) as exc:
            log.warning("could not learn the live replicas from the broker: pausing without their word",
                        extra=fields(model=model, version=version, problem=f"{type(exc).__name__}: {exc}"))
            return
        while missing := others - self.acks.get(cause, set()):
            arrived = self._arrived
            left = start + bound - time.monotonic()
            if left <= 0:
                log.warning("replicas did not say they hold the model in time: pausing anyway (their requests may "
                            "wait in the paused server)", extra=fields(model=model, version=version,
                                                                      replicas=sorted(missing), barrier_timeout_s=bound))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), left)
        if others:
            log.info("every live replica holds the model", extra=fields(
                model=model, version=version, replicas=sorted(others),
                waited_ms=round((time.monotonic() - start) * 1000, 1)))

    async def members(self) -> set[str]:
        """The replicas in the pool-sync group now, as the broker lists them."""
        admin = make_admin(self.settings)
        await admin.start()
        try:
            responses = await admin.describe_consumer_groups([self.settings.pool_group])
        finally:
            await admin.close()
        clients = [member["client_id"] for response in responses for group in response.to_object()["groups"]
                   for member in group["members"]]
        return {client.removeprefix(CLIENT_PREFIX) for client in clients if client.startswith(CLIENT_PREFIX)}

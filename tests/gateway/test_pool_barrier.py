"""The barrier before a pause (`gateway/barrier.py`), with real gateways and a real broker: the applier learns the
live replicas from the pool-sync group, waits for each one's `pool.held` event, and no longer than its bound."""

from __future__ import annotations

import logging
import time

import pytest

from agentstream.schemas import PoolHeldEvent
from tests.gateway.test_pool_sync import publish, weights
from tests.support.gateway import gateway_settings, pool_group_is, read_events, running_gateway
from tests.support.wait import wait_for_async

pytestmark = pytest.mark.slow  # consumer-group joins and a bound waited out: seconds of a real broker

BOUND_S = 3.0
SERVER = "http://127.0.0.1:9"
"""a server no one answers at: the update fails there, after the barrier (what this test is about)"""


async def test_the_applier_waits_for_every_live_replica_and_no_longer_than_its_bound(kafka, caplog):
    caplog.set_level(logging.INFO, logger="gateway.barrier")
    settings = {name: gateway_settings(kafka, [f"tiny={SERVER}"], replica_id=name, barrier_timeout_s=BOUND_S,
                                       drain_timeout_s=1, health_interval_s=60) for name in ("gw-a", "gw-b")}
    async with running_gateway(settings["gw-a"]) as a, running_gateway(settings["gw-b"]) as b:
        await wait_for_async(lambda: pool_group_is(kafka, {"gw-a", "gw-b"}), timeout=60, what="both in the group")
        update = weights("tiny", 1, "/nowhere")
        await publish(kafka, update)

        # each replica says it holds, and each sees the other say so
        held = [event.data for event in await read_events(kafka, kafka.topics.pool, count=2)
                if isinstance(event, PoolHeldEvent)]
        assert sorted((h.replica, h.cause, h.version) for h in held) == [("gw-a", update.id, 1), ("gw-b", update.id, 1)]
        for gw in (a, b):
            await wait_for_async(lambda gw=gw: gw.gateway.sync.barrier.acks.get(update.id) == {"gw-a", "gw-b"},
                                 timeout=30, what="both acknowledgements seen by each replica")
        started = time.monotonic()
        await a.gateway.sync.barrier.wait(update.id, "tiny", 1)
        assert time.monotonic() - started < BOUND_S, "the applier waited although every replica holds"

        # a replica that never says so is waited for up to the bound, and named
        caplog.clear()
        started = time.monotonic()
        await a.gateway.sync.barrier.wait("an event gw-b never held for", "tiny", 2)
        assert time.monotonic() - started >= BOUND_S
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "gateway.barrier"]
        assert warning.fields["replicas"] == ["gw-b"]

    # alone in the group, a replica waits for no one
    async with running_gateway(settings["gw-a"]) as a:
        await wait_for_async(lambda: pool_group_is(kafka, {"gw-a"}), timeout=60, what="gw-a alone in the group")
        caplog.clear()
        started = time.monotonic()
        await a.gateway.sync.barrier.wait("an event no one held for", "tiny", 3)
        assert time.monotonic() - started < BOUND_S
        assert not [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "gateway.barrier"]

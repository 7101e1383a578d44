"""Which adapter serves a tenant's call and which server it goes to (`gateway/lora.py`, `Pool.candidates`),
without a server: versions only move forward, a canary splits sessions by the keyed bucket and its decision moves
that tenant alone, and a tenant's calls go to the servers that hold its adapter, healthy first."""

from __future__ import annotations

from collections import OrderedDict

import aiohttp

from agentstream.gateway.lora import TenantAdapter
from agentstream.gateway.metrics import Metrics
from agentstream.gateway.pool import Pool, Upstream
from agentstream.schemas.events import Release
from agentstream.schemas.releases import in_canary

ARM_KEY = b"arm-secret"


def adapter(version: int, tenant: str = "agent-a") -> TenantAdapter:
    return TenantAdapter("tiny", tenant, version, f"/adapters/{tenant}-{version}")


async def test_a_tenants_version_only_moves_forward_and_the_replaced_one_is_returned_to_unload():
    async with aiohttp.ClientSession() as http:
        adapters = Pool([], http, Metrics()).adapters
        assert adapters.current("tiny", "agent-a", "s") is None  # no adapter yet: the base serves
        assert adapters.serve(adapter(1)) is None
        assert adapters.serve(adapter(3)) == adapter(1)
        assert adapters.serve(adapter(2)) is None and adapters.serve(adapter(3)) is None  # late or repeated
        assert adapters.current("tiny", "agent-a", "s") == adapter(3)
        assert adapters.current("tiny", "agent-b", "s") is None  # another tenant's adapter is not its


async def test_a_canary_serves_the_sessions_of_its_keyed_share_beside_the_stable_adapter():
    async with aiohttp.ClientSession() as http:
        adapters = Pool([], http, Metrics(), arm_key=ARM_KEY, canary_share=0.5).adapters
        adapters.serve(adapter(1))
        assert adapters.serve(adapter(2)) is None  # the stable one stays
        sessions = [f"session-{n}" for n in range(40)]
        served = {session: adapters.current("tiny", "agent-a", session) for session in sessions}
        assert served == {session: adapter(2) if in_canary(session, 5000, ARM_KEY) else adapter(1)
                          for session in sessions}
        assert set(served.values()) == {adapter(1), adapter(2)}
        assert adapters.current("tiny", "agent-a", None) == adapter(1)  # no session: the stable one
        assert adapters.serve(adapter(3)) == adapter(2)  # a newer version replaces the canary


async def test_a_tenants_calls_go_to_the_healthy_servers_that_hold_its_adapter_first():
    servers = [Upstream(f"http://server-{n}", {"tiny"}) for n in range(4)]
    async with aiohttp.ClientSession() as http:
        pool = Pool(servers, http, Metrics())
        first = pool.candidates("tiny", "session-1", adapter(1))
        # no server holds it: every session of the tenant goes to the tenant's first server
        assert all(pool.candidates("tiny", f"session-{n}", adapter(1))[0] is first[0] for n in range(20))
        holder = first[-1]
        pool.adapters.resident[holder.url] = OrderedDict({adapter(1).name: adapter(1)})
        assert pool.candidates("tiny", "session-1", adapter(1))[0] is holder
        holder.healthy = False
        assert pool.candidates("tiny", "session-1", adapter(1))[-1] is holder


def decision(action: str, version: int, tenant: str = "agent-a") -> Release:
    return Release(model="tiny", tenant=tenant, action=action, version=version, uri=f"/adapters/{tenant}-{version}",
                   stable_version=version - 1, stable_uri=f"/adapters/{tenant}-{version - 1}", share_bp=5000,
                   servers=["http://server-0"], started_at=1000)


async def test_a_tenants_canary_decision_moves_that_tenants_sessions_alone_in_either_order_of_the_topics():
    sessions = [f"session-{n}" for n in range(40)]
    async with aiohttp.ClientSession() as http:
        adapters = Pool([], http, Metrics(), arm_key=ARM_KEY, canary_share=0.5).adapters
        for version in (1, 2):
            adapters.serve(adapter(version))
            adapters.serve(adapter(version, "agent-b"))
        assert adapters.decide(decision("promote", 2)) == adapter(1)  # the old stable one: to unload once drained
        assert {adapters.current("tiny", "agent-a", session) for session in sessions} == {adapter(2)}
        # agent-b's canary (the same version numbers) still splits its sessions
        assert {adapters.current("tiny", "agent-b", session) for session in sessions} == {
            adapter(1, "agent-b"), adapter(2, "agent-b")}
        assert adapters.decide(decision("promote", 2)) is None  # decided already
        assert adapters.serve(adapter(3)) is None  # the next canary, against the promoted one
        assert adapters.decide(decision("rollback", 3)) == adapter(3)  # the canary: to unload
        assert {adapters.current("tiny", "agent-a", session) for session in sessions} == {adapter(2)}
        assert adapters.decide(decision("rollback", 2, "agent-b")) == adapter(2, "agent-b")
        assert {adapters.current("tiny", "agent-b", session) for session in sessions} == {adapter(1, "agent-b")}

        # a starting replica may fold a decision before the `weights` event of its version: the same routing
        fresh = Pool([], http, Metrics(), arm_key=ARM_KEY, canary_share=0.5).adapters
        fresh.decide(decision("promote", 2))
        fresh.decide(decision("rollback", 3))
        for version in (1, 2, 3):
            fresh.serve(adapter(version))
        assert fresh.tenants[("tiny", "agent-a")].canary is None
        assert {fresh.current("tiny", "agent-a", session) for session in sessions} == {adapter(2)}

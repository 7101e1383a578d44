"""Isolation (#48 item 5), by attack: a tenant's read key trying to read another tenant's trajectories through every
door of the dashboard (the list, its filters, its SQL condition with a UNION, a subquery, a table function over a
parquet file of the other tenant's rows, the detail by id and by record, the releases, the views over every tenant)
gets nothing of theirs; an operator key sees every tenant's. The export and the CLI over it: test_export.py."""

from __future__ import annotations

import time

import httpx
import polars as pl
import pytest

import agentstream.schemas as s
from agentstream.dashboard.app import create_app
from agentstream.dashboard.settings import DashboardSettings
from agentstream.schemas.releases import fold
from samples.events import trajectory
from samples.publish import publish_all
from tests.support.releases import release

OPERATOR, READ_A, READ_B = "operator-key-tenants", "read-key-of-agent-a", "read-key-of-agent-b"


def trajectories(tenant: str | None, count: int) -> list[s.TrajectoryEvent]:
    now = int(time.time() * 1000)
    events = [trajectory([1, 2], [3, 4], 1.0, f"{tenant}-group", i) for i in range(count)]
    for i, event in enumerate(events):
        event.rollout_id, event.data.tenant = f"{tenant}-rollout-{i}", tenant
        event.time = event.data.finished_at = now - 1_000 + i
    return events


@pytest.fixture
async def dashboard(kafka):
    settings = DashboardSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                                 api_keys=[OPERATOR], read_keys=[READ_A, READ_B],
                                 tenants={"agent-a": [READ_A], "agent-b": [READ_B]})
    transport = httpx.ASGITransport(create_app(settings))  # (no lifespan: these routes read the log on demand)
    async with httpx.AsyncClient(transport=transport, base_url="http://dashboard") as client:
        yield client


def as_(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_a_tenants_key_reads_its_own_trajectories_and_nothing_of_another_tenants(kafka, dashboard, tmp_path):
    await publish_all(kafka, [*trajectories("agent-a", 2), *trajectories("agent-b", 3), *trajectories(None, 1)])
    every = (await dashboard.get("/api/rollouts?since=all", headers=as_(OPERATOR))).json()["rows"]
    assert sorted(row["tenant"] or "-" for row in every) == ["-", "agent-a", "agent-a", *["agent-b"] * 3]
    theirs = [row for row in every if row["tenant"] == "agent-b"]
    stolen_file = tmp_path / "agent-b.parquet"  # what an archive of the other tenant's rows looks like on disk
    pl.DataFrame(theirs).write_parquet(stolen_file)

    async def rows_for_a(query: str) -> list[dict]:
        answer = await dashboard.get(f"/api/rollouts?since=all&{query}", headers=as_(READ_A))
        return answer.json()["rows"] if answer.status_code == 200 else []

    own = await rows_for_a("")
    assert sorted(row["rollout_id"] for row in own) == ["agent-a-rollout-0", "agent-a-rollout-1"]
    attacks = [
        "where=tenant = 'agent-b'", "where=tenant <> 'agent-a'", "where=tenant = 'agent-b' OR 1=1",
        "where=tenant IS NULL", "where=1=1) OR (tenant = 'agent-b'",
        "where=1=1 UNION ALL SELECT * FROM trajectories",
        "where=rollout_id IN (SELECT rollout_id FROM trajectories WHERE tenant = 'agent-b')",
        f"where=1=1 UNION ALL SELECT * FROM \"read_parquet\"('{stolen_file}')",
        f"where=1=1 UNION ALL SELECT * FROM read_parquet/**/('{stolen_file}')",
        f"where=1=1 UNION ALL SELECT * FROM READ_PARQUET%0A('{stolen_file}')",
        "q=agent-b", "task=agent-b", f"q={theirs[0]['rollout_id']}",
    ]
    for attack in attacks:
        assert all(row["tenant"] == "agent-a" for row in await rows_for_a(attack)), attack
    # the file attacks are refused outright, with the error shape
    refused = await dashboard.get("/api/rollouts", params={"where": f"1=1 UNION ALL SELECT * FROM \"read_parquet\"("
                                                            f"'{stolen_file}')"}, headers=as_(READ_A))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_filter"

    # the detail: by id, and by the exact record the other tenant's list row names, is a 404 like a missing one
    by_id = await dashboard.get(f"/api/rollouts/{theirs[0]['rollout_id']}", headers=as_(READ_A))
    by_record = await dashboard.get(f"/api/rollouts/{theirs[0]['rollout_id']}", headers=as_(READ_A), params={
        "partition": theirs[0]["kafka_partition"], "offset": theirs[0]["kafka_offset"]})
    assert by_id.status_code == by_record.status_code == 404
    assert by_id.json()["error"]["code"] == "rollout_not_found" and "agent-b" not in by_id.text.replace(
        theirs[0]["rollout_id"], "")
    mine = await dashboard.get("/api/rollouts/agent-a-rollout-0", headers=as_(READ_A))
    assert mine.status_code == 200 and mine.json()["trajectory"]["data"]["tenant"] == "agent-a"
    assert (await dashboard.get(f"/api/rollouts/{theirs[0]['rollout_id']}", headers=as_(OPERATOR))).status_code == 200

    # the views over every tenant are the operator's: a 403 for a tenant's key, before any read of the log
    for path in ("/api/overview", "/api/compare?a=0&b=1", "/api/events"):
        answer = await dashboard.get(path, headers=as_(READ_B))
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "key_scope", path


async def test_a_tenants_key_sees_its_own_canaries_and_an_operator_every_one():
    """The releases view per tenant: the base model's canary and each tenant's adapter's are cards of their own; a
    tenant's key gets its own tenant's only (the view reads the releases its live follower folded: no broker here)."""
    settings = DashboardSettings(bootstrap_servers="127.0.0.1:9", api_keys=[OPERATOR], read_keys=[READ_A, READ_B],
                                 tenants={"agent-a": [READ_A], "agent-b": [READ_B]})
    app = create_app(settings)
    for tenant in (None, "agent-a", "agent-b"):  # as the live view folds them from the `releases` topic
        fold(app.state.dashboard.live.releases, release("canary", tenant=tenant))
    fold(app.state.dashboard.live.releases, release("promote", tenant="agent-a", decided_by="rule"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://dashboard") as client:
        async def shown(key: str) -> list[tuple]:
            answer = await client.get("/api/releases", headers=as_(key))
            assert answer.status_code == 200, answer.text
            return [(r["model"], r["tenant"], r["phase"]) for r in answer.json()["releases"]]

        assert await shown(OPERATOR) == [("tiny", None, "running"), ("tiny", "agent-a", "promoted"),
                                         ("tiny", "agent-b", "running")]
        assert await shown(READ_A) == [("tiny", "agent-a", "promoted")]
        assert await shown(READ_B) == [("tiny", "agent-b", "running")]

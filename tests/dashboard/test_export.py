"""The log tools for a tenant (#48 item 5), by attack: the dashboard's export (`GET /api/export`, whole trajectories
as JSON lines or Parquet, a page at a time) gives a tenant's read key its own tenant's rows and nothing of another's
by any parameter (tenant, where, cursor, range, format); `agentstream sql --dashboard` and `agentstream export
--dashboard` read through it, so their answers hold only what the key may see; an operator key sees every tenant."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import httpx
import polars as pl
import pytest
from typer.testing import CliRunner

from agentstream.cli import app as cli
from agentstream.dashboard.app import create_app
from agentstream.dashboard.settings import DashboardSettings
from agentstream.logs.remote import NEXT_CURSOR
from samples.publish import publish_all
from tests.dashboard.test_tenants import OPERATOR, READ_A, READ_B, as_, trajectories
from tests.support.dashboard import serving

APP_KEY = "app-key-of-agent-a"
OWN = {"agent-a": 5, "agent-b": 3, None: 1}


def settings_of(kafka) -> DashboardSettings:
    return DashboardSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                             api_keys=[OPERATOR], read_keys=[READ_A, READ_B], app_keys=[APP_KEY],
                             tenants={"agent-a": [READ_A, APP_KEY], "agent-b": [READ_B]})


@pytest.fixture
async def published(kafka):
    await publish_all(kafka, [event for tenant, count in OWN.items() for event in trajectories(tenant, count)])


@pytest.fixture
async def dashboard(kafka, published):
    transport = httpx.ASGITransport(create_app(settings_of(kafka)))  # (no lifespan: the export reads on demand)
    async with httpx.AsyncClient(transport=transport, base_url="http://dashboard") as client:
        yield client


async def export_all(dashboard: httpx.AsyncClient, key: str, **params) -> list[dict]:
    """Every page, following the cursors; the rows of each as JSON lines."""
    rows: list[dict] = []
    cursor = None
    for _ in range(50):
        answer = await dashboard.get("/api/export", headers=as_(key),
                                     params={"since": "all", **params, **({"cursor": cursor} if cursor else {})})
        assert answer.status_code == 200, answer.text
        rows += [json.loads(line) for line in answer.text.splitlines()]
        cursor = answer.headers.get(NEXT_CURSOR)
        if not cursor:
            return rows
    raise AssertionError("the pages did not end")


def tenants_of(rows: list[dict]) -> list[str | None]:
    return sorted((row["tenant"] for row in rows), key=str)


async def test_a_tenants_export_holds_its_own_trajectories_only_whatever_it_asks(dashboard, tmp_path):
    every = await export_all(dashboard, OPERATOR, limit=4)
    assert tenants_of(every) == tenants_of([{"tenant": t} for t, n in OWN.items() for _ in range(n)])
    assert len({row["id"] for row in every}) == 9  # pages neither repeat nor skip a row
    assert tenants_of(await export_all(dashboard, OPERATOR, tenant="agent-b")) == ["agent-b"] * 3

    own = await export_all(dashboard, READ_A, limit=2)  # three pages
    assert sorted(row["rollout_id"] for row in own) == [f"agent-a-rollout-{n}" for n in range(5)]
    assert all(row["turns"] and row["sequences"] for row in own)  # whole trajectories, tokens and all
    assert tenants_of(await export_all(dashboard, READ_B)) == ["agent-b"] * 3

    # parameters that would widen the view: the tenant's rows or nothing, never another's
    stolen = tmp_path / "agent-b.parquet"
    pl.DataFrame([row for row in every if row["tenant"] == "agent-b"]).select("rollout_id", "tenant").write_parquet(stolen)
    narrowing = [
        {"where": "tenant = 'agent-b'"}, {"where": "tenant <> 'agent-a'"}, {"where": "tenant = 'agent-b' OR 1=1"},
        {"where": "tenant IS NULL"}, {"where": "1=1) OR (tenant = 'agent-b'"}, {"tenant": "agent-a"},
        {"cursor": "99999999999999:0:99999999"}, {"cursor": "99999999999999:-1:-1"}, {"until": "2999-01-01T00:00:00Z"},
        {"since": "all", "until": "all"}, {"format": "parquet"}, {"limit": "1"},
    ]
    for params in narrowing:
        answer = await dashboard.get("/api/export", headers=as_(READ_A), params={"since": "all", **params})
        assert answer.status_code in (200, 400), (params, answer.text)
        if params.get("format") == "parquet":
            rows = pl.read_parquet(io.BytesIO(answer.content)).to_dicts()
        else:
            rows = [json.loads(line) for line in answer.text.splitlines()] if answer.status_code == 200 else []
        assert all(row["tenant"] == "agent-a" for row in rows), params
        assert "agent-b-rollout" not in answer.text, params

    refused = {  # the API's error shape, naming what is wrong
        (("tenant", "agent-b"),): (403, "key_scope"),
        (("where", "rollout_id IN (SELECT rollout_id FROM trajectories WHERE tenant = 'agent-b')"),): (400, "invalid_filter"),
        (("where", f"1=1 UNION ALL SELECT * FROM \"read_parquet\"('{stolen}')"),): (400, "invalid_filter"),
        (("where", "no_such_column > 1"),): (400, "invalid_filter"),
        (("format", "csv"),): (400, "invalid_filter"),
        (("limit", "0"),): (400, "invalid_filter"),
        (("limit", "100000"),): (400, "invalid_limit"),
        (("cursor", "not-a-cursor"),): (400, "invalid_filter"),
        (("since", "yesterday-ish"),): (400, "invalid_time"),
    }
    for params, (status, code) in refused.items():
        answer = await dashboard.get("/api/export", headers=as_(READ_A), params={"since": "all", **dict(params)})
        assert answer.status_code == status and answer.json()["error"]["code"] == code, (params, answer.text)
        assert set(answer.json()["error"]) == {"message", "type", "code"}
    for key, code in ((None, "missing_api_key"), (APP_KEY, "invalid_api_key"), ("made-up", "invalid_api_key")):
        answer = await dashboard.get("/api/export", headers=as_(key) if key else {})
        assert answer.status_code == 401 and answer.json()["error"]["code"] == code




async def run_cli(key: str, *args: str):
    """`agentstream …` as a tenant runs it: no broker address, the key in the environment."""
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env={
        "AGENTSTREAM_DASHBOARD_KEY": key, "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})


@pytest.mark.slow
async def test_sql_and_export_read_through_the_dashboard_with_the_keys_view(kafka, published, tmp_path: Path):
    async with serving(settings_of(kafka)) as url:
        async def sql(key: str, query: str) -> list[dict]:
            result = await run_cli(key, "sql", query, "--dashboard", url, "--format", "json")
            assert result.exit_code == 0, result.output
            return json.loads(result.output)

        count = "SELECT tenant, COUNT(*) AS n FROM trajectories GROUP BY tenant ORDER BY n DESC"
        assert await sql(READ_A, count) == [{"tenant": "agent-a", "n": 5}]
        assert await sql(READ_B, count) == [{"tenant": "agent-b", "n": 3}]
        assert await sql(OPERATOR, count) == [{"tenant": t, "n": n} for t, n in OWN.items()]
        assert await sql(READ_A, "SELECT rollout_id FROM trajectories WHERE tenant = 'agent-b'") == []
        other = await run_cli(READ_A, "sql", "SELECT COUNT(*) FROM calls", "--dashboard", url)
        assert other.exit_code == 1 and "trajectories table only" in other.output
        wrong = await run_cli("made-up", "sql", count, "--dashboard", url)
        assert wrong.exit_code == 1 and "401" in wrong.output and "operator key" in wrong.output

        lines, table = tmp_path / "mine.jsonl", tmp_path / "mine.parquet"
        for output, form in ((lines, "jsonl"), (table, "parquet")):
            result = await run_cli(READ_A, "export", "--dashboard", url, "--output", str(output), "--format", form)
            assert result.exit_code == 0 and "Wrote 5 trajectories" in result.output, result.output
        rows = [json.loads(line) for line in lines.read_text().splitlines()]
        assert sorted(row["rollout_id"] for row in rows) == [f"agent-a-rollout-{n}" for n in range(5)]
        frame = pl.read_parquet(table)
        assert frame.height == 5 and set(frame["tenant"]) == {"agent-a"} and "turns" in frame.columns

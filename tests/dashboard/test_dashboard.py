"""The dashboard in a real headless browser (Debian's chromium, driven by Playwright) against a real
broker filled with a known set of events; its API's answers to missing keys and malformed filters.

Screenshots go to runs/test-artifacts/dashboard/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

import agentstream.schemas as s
from agentstream.cli import app as cli
from agentstream.dashboard.app import create_app
from agentstream.dashboard.settings import DashboardSettings
from agentstream.logs.query import NAMED_QUERIES
from agentstream.schemas.tokens import mint_rollout_token
from samples.publish import publish_all
from tests.support.dashboard import generated_tokens, known_events, rollout, serving

KEY = "op-key-dashboard"
ARTIFACTS = Path(__file__).parents[2] / "runs" / "test-artifacts" / "dashboard"


def serve(kafka) -> contextlib.AbstractAsyncContextManager[str]:
    return serving(DashboardSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                                     api_keys=[KEY], overview_cache_s=0.5))


async def sql(kafka, query: str) -> list[dict]:
    """`agentstream sql QUERY --format json` on the same topics, as a person would run it."""
    result = await asyncio.to_thread(CliRunner().invoke, cli, [
        "sql", query, "--prefix", kafka.topic_prefix, "--format", "json"], env={
        "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers})
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


async def stat(page, name: str) -> float:
    return float(await page.get_attribute(f'[data-stat="{name}"]', "data-value"))


async def test_the_dashboard_in_a_browser(kafka, chromium):
    from playwright.async_api import async_playwright, expect

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    events = known_events(int(time.time() * 1000))
    await publish_all(kafka, events)
    trajectories = {e.rollout_id: e for e in events if isinstance(e, s.TrajectoryEvent)}
    async with serve(kafka) as url, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1440, "height": 1000})
        try:
            # the key first: nothing is shown without it
            await page.goto(url)
            await expect(page.locator("#login")).to_be_visible()
            await page.fill("#key", KEY)
            await page.click("#login button")

            # the overview's numbers are the SQL layer's on the same data
            await page.wait_for_selector('[data-stat="calls"]')
            calls = (await sql(kafka, "SELECT COUNT(*) AS n, SUM(usage_prompt_tokens) + SUM(usage_completion_tokens) "
                                      "AS tokens FROM calls"))[0]
            assert await stat(page, "calls") == calls["n"] == sum(isinstance(e, s.CallEvent) for e in events)
            assert await stat(page, "tokens") == calls["tokens"]
            assert await stat(page, "rollouts") == (await sql(kafka, "SELECT COUNT(*) AS n FROM trajectories"))[0]["n"]
            by_version = await sql(kafka, "SELECT weight_version_launch AS v, split, AVG(reward) AS r FROM trajectories "
                                          "GROUP BY weight_version_launch, split ORDER BY v, split")
            shown = page.locator("text=Reward by weight version >> xpath=.. >> tbody tr")
            assert await shown.count() == len(by_version) == 6
            for i, row in enumerate(by_version):
                cells = await shown.nth(i).locator("td").all_inner_texts()
                assert (int(cells[0]), cells[1], float(cells[3])) == (row["v"], row["split"], round(row["r"], 3))
            flagged = await sql(kafka, NAMED_QUERIES["flagged-rewards-by-version"])
            shown = page.locator("text=Flagged gradings by weight version >> xpath=.. >> tbody tr")
            assert await shown.count() == len(flagged) > 0 and sum(row["flagged"] for row in flagged) > 0
            for i, row in enumerate(flagged):
                cells = await shown.nth(i).locator("td").all_inner_texts()
                assert (int(cells[0]), int(cells[1]), int(cells[2])) == (row["weight_version"], row["graded"], row["flagged"])
            upstreams = await sql(kafka, "SELECT upstream, COUNT(*) AS n FROM calls GROUP BY upstream")
            for row in upstreams:
                cells = page.locator(f'td[data-col="upstream"]:has-text("{row["upstream"]}") >> xpath=..')
                assert await cells.locator('td[data-col="calls"]').inner_text() == str(row["n"])
            servers = page.locator("text=Weight version per server >> xpath=.. >> tbody tr")
            assert await servers.count() == 2
            assert await servers.nth(0).locator('td[data-col="version"]').inner_text() == "2"
            await page.screenshot(path=ARTIFACTS / "overview.png", full_page=True)

            # search finds one rollout among many
            wanted = trajectories["r-1-mul-4-5-13"]
            await page.click('nav a[data-nav="rollouts"]')
            await page.fill('input[name="q"]', "mul-4-5-13")
            await page.click('#filters button[type="submit"]')
            await expect(page.locator("#rollouts tbody tr")).to_have_count(1)
            assert await page.get_attribute("#rollouts tbody tr", "data-rollout") == wanted.rollout_id
            await page.screenshot(path=ARTIFACTS / "rollouts.png", full_page=True)

            # its trajectory: the conversation, every generated token, the reward's details, the lineage
            await page.click("#rollouts tbody tr")
            await expect(page.locator(".msg.assistant").first).to_contain_text("answer 0 to mul-4-5")
            await page.screenshot(path=ARTIFACTS / "conversation.png", full_page=True)
            await page.click('.tabs button[data-tab="tokens"]')
            generated = generated_tokens(wanted)
            assert generated == 7  # two turns of 3 and 4 model tokens
            await expect(page.locator(".tok.gen")).to_have_count(generated)
            assert await page.get_attribute("[data-generated]", "data-generated") == str(generated)
            assert await page.locator('.tok.gen[data-v="1"]').count() == generated
            await page.screenshot(path=ARTIFACTS / "tokens.png", full_page=True)
            await page.click('.tabs button[data-tab="rewards"]')
            await expect(page.locator("#tab-body")).to_contain_text("tests_passed")
            await page.click('.tabs button[data-tab="lineage"]')
            assert await page.get_attribute("[data-trained-by]", "data-trained-by") == "2"
            await page.click('.tabs button[data-tab="lifecycle"]')
            await expect(page.locator("#tab-body")).to_contain_text("done mul-4-5")

            # a malformed filter: a message, not a traceback
            await page.goto(f"{url}/#/rollouts?reward_min=abc")
            await expect(page.locator(".banner")).to_contain_text("reward_min: Input should be a valid number")

            # compare: the same tasks under two versions
            await page.goto(f"{url}/#/compare?a=0&b=2")
            assert await stat(page, "tasks") == 3
            await page.screenshot(path=ARTIFACTS / "compare.png", full_page=True)

            # live: new events show up in the feed and in the numbers, with no reload
            await page.goto(f"{url}/#/overview")
            await page.wait_for_selector('[data-stat="calls"]')
            await expect(page.locator("#live")).to_have_class("live on")
            before = await stat(page, "calls")
            fresh = rollout(99, 2, "add-2-3", "train", 1.0, turns=2, base_ms=int(time.time() * 1000))
            await publish_all(kafka, fresh)
            await expect(page.locator('#feed [data-feed-rollout="r-2-add-2-3-99"]').first).to_be_visible(timeout=20_000)
            await expect(page.locator('[data-stat="calls"]')).to_have_attribute("data-value", str(int(before) + 2),
                                                                               timeout=20_000)
            await page.screenshot(path=ARTIFACTS / "live.png", full_page=True)

            # what agents wrote is shown as text, never run as markup: an attack in every field it controls
            attack = '<img src=x onerror="window.pwned=1">'
            hostile = rollout(7, 1, attack, "train", 1.0, turns=1, base_ms=int(time.time() * 1000))
            for event in hostile:
                if isinstance(event, s.CallEvent):
                    event.data.request["messages"][1]["content"] = attack
                    event.data.response["choices"][0]["message"]["content"] = f"<script>window.pwned=2</script>{attack}"
            await publish_all(kafka, hostile)
            await page.goto(f"{url}/#/rollouts?task=onerror")
            await expect(page.locator("#rollouts tbody tr")).to_have_count(1)
            await page.click("#rollouts tbody tr")
            await expect(page.locator(".msg.assistant").first).to_contain_text("<script>window.pwned=2</script>")
            for tab in ("tokens", "rewards", "lifecycle", "lineage", "conversation"):
                await page.click(f'.tabs button[data-tab="{tab}"]')
            assert await page.evaluate("window.pwned") is None
            assert await page.locator("#view img").count() == 0
        finally:
            await browser.close()


async def test_the_api_needs_an_operator_key_and_explains_bad_filters(kafka):
    await publish_all(kafka, known_events(int(time.time() * 1000))[:20])
    async with serve(kafka) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        # the page and its assets hold no data and load from here only (no CDN)
        page = await client.get("/")
        assert page.status_code == 200 and "/static/app.js" in page.text
        for asset in ("app.js", "charts.js", "style.css"):
            text = (await client.get(f"/static/{asset}")).text
            assert "https://" not in text and "http://" not in text.replace("http://www.w3.org/2000/svg", "")

        token = mint_rollout_token("secret", "r-1", "a-1")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {token}"},
                        {"x-api-key": "wrong"}):
            for path in ("/api/overview", "/api/rollouts", "/api/rollouts/r-1", "/api/compare?a=0&b=1", "/api/events"):
                response = await client.get(path, headers=headers)
                assert response.status_code == 401, (path, headers)
                error = response.json()["error"]  # the gateway's shape and codes (schemas.api_errors)
                assert error["type"] == "authentication_error" and "operator key" in error["message"]
                assert error["code"] == ("invalid_api_key" if headers else "missing_api_key")

        key = {"Authorization": f"Bearer {KEY}"}
        for query, words in (("reward_min=abc", "reward_min: Input should be a valid number"),
                             ("status=done", "status.0: Input should be 'finished'"),
                             ("where=reward >>> 1", "cannot apply where="),
                             ("where=no_such_column = 1", "cannot apply where="),
                             ("where=rollout_id IN (SELECT column_1 FROM read_csv('/etc/passwd'))", "not allowed"),
                             ("cursor=yesterday", "cannot read cursor"),
                             ("since=last tuesday", "since: cannot read time"),
                             ("limit=100000", "limit: at most"),
                             ("reward_min=2&reward_max=1", "is above reward_max")):
            response = await client.get(f"/api/rollouts?{query}", headers=key)
            assert response.status_code == 400, (query, response.text)
            error = response.json()["error"]
            assert words in error["message"] and "Traceback" not in response.text, (query, error)
        assert (await client.get("/api/rollouts/r-1?partition=99&offset=0", headers=key)).status_code == 400
        missing = await client.get("/api/rollouts/no-such-rollout", headers=key)
        assert missing.status_code == 404 and "no trajectory" in missing.json()["error"]["message"]
        assert (await client.get("/api/overview?since=soon", headers=key)).status_code == 400


def test_it_refuses_to_start_without_a_key():
    with pytest.raises(ValueError, match="AGENTSTREAM_API_KEYS"):
        create_app(DashboardSettings(api_keys=[]))


@pytest.mark.parametrize(("setting", "keys"), [("api_keys", "ours-0123456789,change-me-too"), ("read_keys", "change-me")])
def test_open_to_other_hosts_it_refuses_a_placeholder_key(setting, keys):
    """The placeholders compose once shipped: beyond loopback anyone who read the file would read every prompt."""
    given = {"api_keys": "ours-0123456789", setting: keys}
    with pytest.raises(ValueError, match=f"AGENTSTREAM_{setting.upper()} holds the placeholder .* listens on 0.0.0.0"):
        create_app(DashboardSettings.model_validate({**given, "host": "0.0.0.0"}))
    create_app(DashboardSettings.model_validate({**given, "host": "127.0.0.1"}))  # the local stack: only this machine


async def test_the_list_pages_newest_first_reading_only_what_a_page_needs(kafka):
    from agentstream.dashboard.rollouts import Cursor, Filters, search

    base = int(time.time() * 1000)
    published = [e for i in range(120) for e in rollout(i, i // 40, f"t{i % 3}", "train", (i % 5) / 4, turns=1,
                                                       status="failed" if i % 4 == 0 else "finished", base_ms=base)
                 if isinstance(e, s.TrajectoryEvent)]
    for start in range(0, len(published), 20):  # in six moments, as a live log fills
        await publish_all(kafka, published[start:start + 20])

    async def walk(filters: Filters) -> tuple[list[dict], list[int]]:
        rows, scanned, cursor = [], [], None
        while True:
            page = await search(kafka, filters, None, None, limit=10, cursor=cursor, first_chunk=4)
            rows += page.rows
            scanned.append(page.scanned)
            if page.next_cursor is None:
                return rows, scanned
            cursor = Cursor.parse(page.next_cursor)

    rows, scanned = await walk(Filters())
    assert sorted(r["rollout_id"] for r in rows) == sorted(e.rollout_id for e in published)  # each once
    keys = [(r["kafka_timestamp"], r["kafka_partition"], r["kafka_offset"]) for r in rows]
    assert keys == sorted(keys, reverse=True)  # newest first, across partitions
    assert scanned[0] < len(published)  # the first page read the log's end, not all of it

    failed, _ = await walk(Filters(statuses=("failed",), reward_min=0.5))
    expected = {e.rollout_id for e in published if e.data.status == "failed" and e.data.reward >= 0.5}
    assert {r["rollout_id"] for r in failed} == expected and len(failed) == len(expected) > 0


async def test_a_rollout_is_read_from_its_own_partition_only(kafka):
    """The rollout view reads one partition through Bounds that end every other one before it starts."""
    from agentstream.dashboard.rollouts import find_trajectories, only, partition_of, related
    from agentstream.schemas.kafka import partitions_of
    from agentstream.schemas.scan import resolve, scan

    events = known_events(int(time.time() * 1000))
    await publish_all(kafka, events)
    topic = kafka.topics.trajectories
    count = len(await partitions_of(kafka, topic))
    wanted = next(e for e in events if isinstance(e, s.TrajectoryEvent) and e.rollout_id == "r-1-mul-4-5-13")
    mine = partition_of(wanted.rollout_id, count)
    ranges = await resolve(kafka, topic)
    assert sum(end - start for p, (start, end) in ranges.items() if p != mine) > 0  # the others hold records

    records = [r async for batch in scan(kafka, topic, only(mine, count)) for r in batch]
    assert {r.partition for r in records} == {mine}
    assert len(records) == ranges[mine][1] - ranges[mine][0]
    one = [r async for batch in scan(kafka, topic, only(mine, count, 1, 2)) for r in batch]
    assert [(r.partition, r.offset) for r in one] == [(mine, 1)]

    found, read = await find_trajectories(kafka, wanted.rollout_id)
    assert [t.id for t in found] == [wanted.id] and read <= len(records)
    around = await related(kafka, found[0])
    for base in ("rollouts", "calls", "rewards"):
        expected = sorted(e.id for e in events if e.topic == base and e.rollout_id == wanted.rollout_id)
        assert sorted(e.id for e in around[base]) == expected and expected, base


async def test_the_canaries_page_shows_each_canary_live(kafka, chromium):
    from agentstream.schemas.kafka import ensure_topics
    from tests.support.releases import release

    await ensure_topics(kafka)
    await publish_all(kafka, [release("canary", started_at=1000)])  # history, before the dashboard starts
    async with serve(kafka) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await client.get("/api/releases")).status_code == 401
        key = {"Authorization": f"Bearer {KEY}"}

        async def shown(condition) -> dict:
            deadline = time.monotonic() + 20
            while True:
                releases = (await client.get("/api/releases", headers=key)).json()["releases"]
                if releases and condition(releases[0]):
                    assert len(releases) == 1
                    return releases[0]
                assert time.monotonic() < deadline, releases
                await asyncio.sleep(0.1)

        first = await shown(lambda r: True)
        assert (first["model"], first["phase"], first["version"], first["share"]) == ("tiny", "running", 2, 0.25)
        arms = [s.ArmNumbers(version=1, sessions=12, mean_reward=0.3, calls=30),
                s.ArmNumbers(version=2, sessions=11, mean_reward=0.7, calls=28, errors=1)]
        await publish_all(kafka, [release("measure", started_at=1000, arms=arms, p_value=0.02, reason="no decision yet")])
        now = await shown(lambda r: r["p_value"] == 0.02)
        assert [arm["sessions"] for arm in now["arms"]] == [12, 11] and now["phase"] == "running"

        # the page: the canary's card, then its decision as it comes (no reload)
        from playwright.async_api import async_playwright, expect

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = await browser.new_page()
            try:
                await page.goto(url)
                await page.fill("#key", KEY)
                await page.click("#login button")
                await page.click('nav a[data-nav="canaries"]')
                card = page.locator('[data-canary="tiny"]')
                await expect(card).to_contain_text("running")
                canary = await card.locator('tr[data-arm="canary"] td').all_inner_texts()
                assert canary[:3] == ["canary v2", "11", "0.700"], canary
                await publish_all(kafka, [release("promote", started_at=1000, arms=arms, p_value=0.001,
                                                  decided_by="rule", reason="mean reward higher")])
                await expect(card).to_contain_text("promoted", timeout=20_000)
                await expect(card).to_contain_text("decided by rule")
                await expect(card.locator("[data-p]")).to_have_text("0.0010")
            finally:
                await browser.close()
        now = await shown(lambda r: r["phase"] == "promoted")
        assert (now["decided_by"], now["p_value"], now["reason"]) == ("rule", 0.001, "mean reward higher")

"""Dashboard: time to first render with a large log, against the same SQL run from the command line.

    uv run python -m bench.dashboard [--events 1000000]

The log: rollouts of 4 turns each (queued, started, 4 calls, finished, a reward, a trajectory: nine
events a rollout). The dashboard runs as its own process (`python -m agentstream.dashboard`); headless chromium
opens each view and the clock stops when its numbers (or rows, or tokens) are on the screen. The
baselines, measured in the same run: the same SQL through `agentstream.logs.query.run_sql` in this process
(what `agentstream sql` does after it starts), and `agentstream sql` itself, a new process each time
as a person would run it (its start-up alone: `agentstream sql --list`).

Measured 2026-12-03, 999,999 events (111,111 rollouts), on the shared 2-core machine at a load
average near 30 (absolute times are slow; the ratios are the figures): overview 336 s, 1.25× the same
SQL in process (269 s), 0.83× `agentstream sql` (403 s); the rollouts list's first page 6.1 s,
0.06× (94 s) and 0.03× (181 s); a rollout id searched over the whole range 76 s, 1.11× (68 s); its
trajectory by the list's link, tokens drawn, 17.6 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from agentstream.logs.query import NAMED_QUERIES, run_sql
from agentstream.schemas.kafka import KafkaSettings, ensure_topics
from agentstream.schemas.scan import Bounds, parse_time
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import free_port, spawn, stop_pid, tail
from bench.report import Report
from samples.events import rollout
from samples.publish import publish_all

KEY = "bench-key"
PREFIX = "bench."
TASKS = [f"task-{i}" for i in range(50)]
EVENTS_PER_ROLLOUT = 9


def events(count: int):
    base = int(time.time() * 1000)
    for i in range(count // EVENTS_PER_ROLLOUT):
        yield from rollout(i, i // 5000, TASKS[i % len(TASKS)], "validation" if i % 10 == 0 else "train",
                           (i % 7) / 6, turns=4, base_ms=base)


async def in_process(settings: KafkaSettings, sql: str) -> float:
    start = time.perf_counter()
    await run_sql(settings, sql, Bounds(since_ms=parse_time("1h")))
    return time.perf_counter() - start


def cli(bootstrap: str, *args: str) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "agentstream", *args, "--prefix", PREFIX],
                            capture_output=True, text=True, env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap})
    took = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    return took


async def browse(url: str, report: Report, sql_s: dict[str, float], cli_s: dict[str, float], sample: str) -> None:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = await browser.new_page(viewport={"width": 1440, "height": 1000})
        await page.goto(url)
        await page.evaluate(f"sessionStorage.setItem('agentstream-key', '{KEY}')")

        async def render(hash_: str, selector: str) -> float:
            await page.goto("about:blank")
            start = time.perf_counter()
            await page.goto(f"{url}/{hash_}")
            await page.wait_for_selector(selector, timeout=600_000)
            return time.perf_counter() - start

        views = (
            ("overview", "#/overview", '[data-stat="calls"]', "overview"),
            ("rollouts list, first page", "#/rollouts", "#rollouts tbody tr", "list"),
            ("rollouts list, one id searched", f"#/rollouts?q={sample}", "#rollouts tbody tr", "search"),
        )
        for label, hash_, selector, baseline in views:
            took = await render(hash_, selector)
            report.add(f"dashboard: {label} (first render)", f"{took:.2f} s", took / sql_s[baseline])
            report.add("   … against agentstream sql (with its start-up)", "", took / cli_s[baseline])
            report.details[f"dashboard_{baseline}_s"] = took
        link = await page.get_attribute("#rollouts tbody tr", "data-href")
        took = await render(link + "&tab=tokens", ".tok.gen")
        report.add("dashboard: its trajectory, tokens drawn", f"{took:.2f} s", took / sql_s["search"])
        report.details["dashboard_trajectory_s"] = took
        await page.screenshot(path=str(Path(tempfile.gettempdir()) / "bench-dashboard-overview.png"), full_page=True)
        await browser.close()


async def main(count: int) -> None:
    report = Report("dashboard")
    with tempfile.TemporaryDirectory() as tmp:
        broker = LocalKafka(Path(tmp) / "kafka", default_port=None)
        state = broker.start()
        process = None
        try:
            settings = KafkaSettings(bootstrap_servers=state.url, topic_prefix=PREFIX, partitions=4)
            await ensure_topics(settings)
            print(f"publishing {count:,} events…", flush=True)
            start = time.perf_counter()
            published = await publish_all(settings, events(count))
            print(f"published {published:,} in {time.perf_counter() - start:.0f} s", flush=True)
            rollouts = published // EVENTS_PER_ROLLOUT
            sample = f"r-{(rollouts // 2) // 5000}-{TASKS[(rollouts // 2) % len(TASKS)]}-{rollouts // 2}"
            report.details.update(events=published, rollouts=rollouts)

            startup = cli(state.url, "sql", "--list")
            report.add("agentstream sql --list (CLI start-up only)", f"{startup:.2f} s")
            queries = {
                "overview": [NAMED_QUERIES["latency-by-upstream"], NAMED_QUERIES["reward-by-version"]],
                "list": ["SELECT rollout_id, task_id, status, split, reward, weight_version_launch, finished_at "
                         "FROM trajectories ORDER BY kafka_timestamp DESC LIMIT 50"],
                "search": [f"SELECT rollout_id, task_id, status, reward FROM trajectories WHERE rollout_id "
                           f"LIKE '%{sample}%' LIMIT 50"],
            }
            sql_s, cli_s = {}, {}
            for name, texts in queries.items():
                print(f"{name}: the same SQL in this process and by agentstream sql…", flush=True)
                sql_s[name] = sum([await in_process(settings, text) for text in texts])
                cli_s[name] = sum(cli(state.url, "sql", text, "--since", "1h") for text in texts)
                report.add(f"SQL for the {name} (run_sql, in process)", f"{sql_s[name]:.2f} s", 1.0)
                report.add(f"SQL for the {name} (agentstream sql, {len(texts)} command(s))", f"{cli_s[name]:.2f} s",
                           cli_s[name] / sql_s[name])
            report.details.update(sql_s=sql_s, cli_s=cli_s, cli_startup_s=startup)

            port = free_port()
            log = Path(tmp) / "dashboard.log"
            process = spawn([sys.executable, "-m", "agentstream.dashboard", "--port", str(port)], log, env={
                **os.environ, "KAFKA_BOOTSTRAP_SERVERS": state.url, "AGENTSTREAM_TOPIC_PREFIX": PREFIX,
                "AGENTSTREAM_API_KEYS": KEY})
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"the dashboard did not start: {tail(log)}")
                await asyncio.sleep(0.5)
            await browse(url, report, sql_s, cli_s, sample)
        finally:
            if process is not None:
                stop_pid(process.pid)
            broker.stop()
    report.print("ratio: time over the in-process SQL's for the same question (overview: latency-by-upstream plus "
                  "reward-by-version; the dashboard's overview runs nine queries over one read of each table)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    args = parser.parse_args()
    asyncio.run(main(args.events))

"""The overview: throughput, latency by upstream, versions per server, swaps, reward by version, flagged
gradings by version, staleness, lag.

Every number is a SQL query over the log within the chosen time range (`QUERIES`, also sent to the page
so a reader can run the same with `agentstream sql`); rates are counts divided by the range. The
streams lag is the streams worker's consumer group: end offsets less its committed offsets.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition

from agentstream.dashboard.sql import load_tables, run_on
from agentstream.logs.query import NAMED_QUERIES
from agentstream.schemas.kafka import KafkaSettings, make_admin
from agentstream.schemas.scan import Bounds, resolve

PASSED = "CASE WHEN reward IS NULL THEN NULL WHEN reward >= 1 THEN 1.0 ELSE 0.0 END"

QUERIES: dict[str, str] = {
    "calls": """SELECT COUNT(*) AS calls, SUM(usage_prompt_tokens) AS tokens_in,
                SUM(usage_completion_tokens) AS tokens_out, SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS errors,
                MIN(time) AS first_ms FROM calls""",
    "rollouts": "SELECT COUNT(*) AS rollouts, AVG(reward) AS reward_mean, MIN(time) AS first_ms FROM trajectories",
    "latency": NAMED_QUERIES["latency-by-upstream"],
    "servers": """SELECT server, model, MAX(version) AS version, MAX(time) AS updated_ms
                  FROM pool WHERE status = 'ok' GROUP BY server, model ORDER BY server""",
    "swaps": """SELECT time, model, version, server, status, pause_ms, load_ms, held_ms, error
                FROM pool WHERE type = 'pool.update' AND time >= {since} AND time < {until}
                ORDER BY time DESC LIMIT 500""",
    "versions": "SELECT version, base_version, step, time FROM weights ORDER BY version",
    "reward": f"""SELECT weight_version_launch AS weight_version, split, COUNT(*) AS trajectories,
                  AVG(reward) AS reward_mean, AVG({PASSED}) AS pass_rate,
                  SUM(CASE WHEN reward_missing THEN 1 ELSE 0 END) AS reward_missing
                  FROM trajectories GROUP BY weight_version_launch, split ORDER BY weight_version, split""",
    "staleness": NAMED_QUERIES["staleness"],
    "flagged": NAMED_QUERIES["flagged-rewards-by-version"],
    "settle": """SELECT QUANTILE_CONT(kafka_timestamp - finished_at, 0.5) AS p50_ms,
                 QUANTILE_CONT(kafka_timestamp - finished_at, 0.99) AS p99_ms FROM trajectories""",
}


@dataclass(frozen=True)
class Range:
    since_ms: int | None
    until_ms: int

    @property
    def bounds(self) -> Bounds:
        return Bounds(since_ms=self.since_ms, until_ms=self.until_ms)


async def overview(settings: KafkaSettings, span: Range, group: str | None = None) -> dict[str, Any]:
    queries = {key: sql.format(since=span.since_ms or 0, until=span.until_ms) for key, sql in QUERIES.items()}
    started = time.perf_counter()
    tables, lag = await asyncio.gather(load_tables(settings, queries, span.bounds), streams_lag(settings, group))
    answers = run_on(tables, queries)
    result: dict[str, Any] = {key: {"rows": a.rows, "error": a.error} for key, a in answers.items()}
    first = [a.rows[0]["first_ms"] for a in (answers["calls"], answers["rollouts"]) if a.rows and a.rows[0]["first_ms"]]
    start = span.since_ms if span.since_ms is not None else min(first, default=span.until_ms)
    seconds = max(1e-3, (span.until_ms - start) / 1000)
    calls = answers["calls"].rows[0] if answers["calls"].rows else {}
    rollouts = answers["rollouts"].rows[0] if answers["rollouts"].rows else {}
    result["rates"] = {
        "seconds": seconds,
        "calls_per_s": (calls.get("calls") or 0) / seconds,
        "rollouts_per_s": (rollouts.get("rollouts") or 0) / seconds,
        "tokens_per_s": ((calls.get("tokens_in") or 0) + (calls.get("tokens_out") or 0)) / seconds,
        "tokens_out_per_s": (calls.get("tokens_out") or 0) / seconds,
    }
    result["lag"] = lag
    result["range"] = {"since_ms": span.since_ms, "until_ms": span.until_ms}
    result["sql"] = queries
    result["took_ms"] = round((time.perf_counter() - started) * 1000, 1)
    return result


async def streams_lag(settings: KafkaSettings, group: str | None = None) -> dict[str, Any]:
    """Records of the streams worker's input topics it has not committed yet, per topic."""
    group = group or f"{settings.topic_prefix}agentstream-streams"
    admin = make_admin(settings)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    except Exception as exc:  # coordinator not available: say so on the page
        return {"group": group, "topics": {}, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        await admin.close()
    if not committed:
        return {"group": group, "topics": {}, "error": "no offsets committed: is a streams worker running with this "
                "topic prefix (agentstream streams)?"}
    topics: dict[str, int] = {}
    for base in ("rollouts", "calls", "rewards"):
        topic = settings.topics.name(base)
        for partition, (_, end) in (await resolve(settings, topic)).items():
            meta = committed.get(TopicPartition(topic, partition))
            done = meta.offset if meta is not None and meta.offset >= 0 else 0
            topics[topic] = topics.get(topic, 0) + max(0, end - done)
    return {"group": group, "topics": topics, "error": None}

"""Scan and query speed: Kafka → polars frame, and SQL on one million call events.

    uv run python -m bench.query [--events 200000] [--rows 1000000]

Baselines measured in the same run: a raw scan that only counts records (what Kafka and
aiokafka cost), and `SELECT COUNT(*)` on the same frame (what touching the table costs).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import polars as pl

import schemas as s
from agentstream.query import NAMED_QUERIES, columns_in, load_table
from agentstream.scan import scan
from agentstream.stack.kafka import LocalKafka
from bench.load import publish_all
from bench.report import Report
from schemas.kafka import KafkaSettings, ensure_topics


def call_event(i: int, rng: random.Random) -> s.CallEvent:
    prompt = [rng.randrange(256) for _ in range(200)]
    completion = [rng.randrange(256) for _ in range(50)]
    return s.CallEvent(source="bench", rollout_id=f"r{i // 4}", attempt_id="a", data=s.Call(
        api="chat.completions", model="tiny", upstream=f"http://10.0.0.{i % 4}:8000", weight_version=i // 10_000,
        request={"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 50},
        response={"choices": [{"message": {"role": "assistant", "content": "y" * 50}}]},
        prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-rng.random() for _ in completion],
        finish_reason="stop", usage=s.Usage(prompt_tokens=200, completion_tokens=50, total_tokens=250),
        status=200 if i % 50 else 502, started_at=i, latency_ms=rng.expovariate(1 / 40)))


async def fill(settings: KafkaSettings, count: int) -> None:
    rng = random.Random(0)
    await publish_all(settings, (call_event(i, rng) for i in range(count)))


async def raw_scan(settings: KafkaSettings) -> int:
    return sum([len(batch) async for batch in scan(settings, settings.topics.calls)])


async def frame_scan(settings: KafkaSettings, sql: str | None = None) -> pl.DataFrame:
    df, unreadable = await load_table(settings, "calls", columns=columns_in(sql) if sql else None)
    assert unreadable == 0
    return df


def synthetic_calls(rows: int) -> pl.DataFrame:
    """The calls table's query-relevant columns at scale, built without Kafka."""
    rng = pl.int_range(0, rows, eager=True)
    return pl.DataFrame({
        "rollout_id": ("r" + (rng // 4).cast(pl.String)),
        "upstream": ("http://10.0.0." + (rng % 4).cast(pl.String) + ":8000"),
        "weight_version": rng // 10_000,
        "status": pl.Series([200] * rows).scatter(list(range(0, rows, 50)), 502),
        "latency_ms": pl.Series(range(rows)).cast(pl.Float64) % 97.0,
        "usage_prompt_tokens": pl.Series([200] * rows),
        "usage_completion_tokens": (rng % 64),
    })


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


async def main(events: int, rows: int) -> None:
    report = Report("query")
    with tempfile.TemporaryDirectory() as tmp:
        broker = LocalKafka(Path(tmp), default_port=None)
        state = broker.start()
        try:
            settings = KafkaSettings(bootstrap_servers=state.url, topic_prefix="bench.", partitions=4)
            await ensure_topics(settings)
            print(f"publishing {events:,} call events…", flush=True)
            await fill(settings, events)

            start = time.perf_counter()
            counted = await raw_scan(settings)
            raw_s = time.perf_counter() - start
            report.add("raw scan (count only)", f"{events / raw_s:,.0f} events/s", 1.0)
            assert counted == events
            for label, sql in (("all columns", None), ("columns of latency-by-upstream",
                                                        NAMED_QUERIES["latency-by-upstream"])):
                start = time.perf_counter()
                df = await frame_scan(settings, sql)
                frame_s = time.perf_counter() - start
                assert df.height == events
                report.add(f"scan into polars frame, {label}", f"{events / frame_s:,.0f} events/s", raw_s / frame_s)
        finally:
            broker.stop()

    calls = synthetic_calls(rows)
    context = pl.SQLContext({"calls": calls}, eager=True)
    _, base_s = timed(lambda: context.execute("SELECT COUNT(*) FROM calls"))
    report.add(f"SELECT COUNT(*) on {rows:,} calls", f"{base_s * 1000:.1f} ms", 1.0)
    for name in ("latency-by-upstream", "tokens-by-rollout"):
        _, query_s = timed(lambda: context.execute(NAMED_QUERIES[name]))
        report.add(f"{name} on {rows:,} calls", f"{query_s * 1000:.1f} ms", query_s / base_s)
    report.print("ratio vs. the baseline above it (scan: throughput ratio; query: time ratio)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    asyncio.run(main(args.events, args.rows))

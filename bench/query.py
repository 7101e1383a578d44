"""Scan and query speed: call events from Kafka and from the Parquet archive into polars, and SQL.

    uv run python -m bench.query [--events 1000000] [--rows 1000000] [--rounds 3] [--bootstrap HOST:PORT --prefix P]

Baselines measured in the same run: a raw scan of Kafka that only counts records (librdkafka, as
scans read now; aiokafka's, as they read before, beside it): the Kafka scans (into a frame, SQL end
to end) in rounds, each between two raw scans and against the faster of them, their median reported
(the machine's load drifts within a run), and `SELECT COUNT(*)` on a frame in
memory (what touching the table costs). The archive is written by `Archiver` (agentstream archive)
and read back for replay (records) and for queries (the table it stored).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import polars as pl

import agentstream.schemas as s
from agentstream.archive import Archiver
from agentstream.logs.query import NAMED_QUERIES, columns_in, decode, event_row, frame, load_table, run_sql
from agentstream.schemas.kafka import KafkaSettings, ensure_topics, make_consumer, partitions_of
from agentstream.schemas.scan import KAFKA, Manifest, Origin, resolve, scan
from agentstream.stack.kafka import LocalKafka
from bench.report import Report


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


def call_values(start: int, count: int) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of call events `start`… as `call_event` makes them, built without pydantic: one
    event is validated and dumped, and the others are that dict with their own fields (a million
    pydantic events take longer to build than the benchmark takes to read them)."""
    template = call_event(start, random.Random(start)).model_dump(mode="python")
    rng = np.random.default_rng(start)
    now = s.now_ms()
    for i in range(start, start + count):
        event = dict(template, id=s.new_id(), time=now + i, rollout_id=f"r{i // 4}")
        event["data"] = dict(template["data"], upstream=f"http://10.0.0.{i % 4}:8000", weight_version=i // 10_000,
                             prompt_token_ids=rng.integers(0, 256, 200).tolist(),
                             completion_token_ids=rng.integers(0, 256, 50).tolist(),
                             logprobs=(-rng.random(50)).tolist(), status=200 if i % 50 else 502, started_at=i,
                             latency_ms=float(rng.exponential(40)))
        yield event["rollout_id"].encode(), orjson.dumps(event)


def fill(settings: KafkaSettings, count: int, start: int = 0) -> None:
    """Publish `count` call events with librdkafka's producer (its murmur2 partitioner, as Kafka's own)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": settings.bootstrap_servers, "enable.idempotence": True,
                         "linger.ms": 50, "partitioner": "murmur2_random", "compression.type": "none"})
    topic = settings.topics.calls
    for n, (key, value) in enumerate(call_values(start, count), 1):
        while True:
            try:
                producer.produce(topic, value, key)
                break
            except BufferError:  # the producer's queue is full: let it send
                producer.poll(0.5)
        if n % 50_000 == 0:
            producer.poll(0)
            print(f"  {n:,} published", flush=True)
    if producer.flush(120) != 0:
        raise RuntimeError("the broker did not acknowledge every call event within 2 minutes")


async def raw_scan(settings: KafkaSettings, origin: Origin = KAFKA) -> int:
    """The baseline: records read and counted, nothing decoded (librdkafka, as scans read now)."""
    return sum([len(batch) async for batch in scan(settings, settings.topics.calls, batch_size=20_000, origin=origin)])


async def aiokafka_scan(settings: KafkaSettings) -> int:
    """What a raw scan cost before: aiokafka's consumer, counting records."""
    topic = settings.topics.calls
    partitions = await partitions_of(settings, topic)
    consumer = make_consumer(settings, group_id=None, max_poll_records=5000)
    await consumer.start()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        count = 0
        pending = set(partitions)
        while pending:
            count += sum(len(r) for r in (await consumer.getmany(timeout_ms=1000, max_records=5000)).values())
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
        return count
    finally:
        await consumer.stop()


async def frame_scan(settings: KafkaSettings, sql: str | None = None, origin: Origin = KAFKA) -> pl.DataFrame:
    df, unreadable = await load_table(settings, "calls", columns=columns_in(sql) if sql else None, origin=origin)
    assert unreadable == 0
    return df


def kafka_bytes(data_dir: Path, topic: str) -> int:
    return sum(f.stat().st_size for f in data_dir.glob(f"kraft/{topic}-*/*.log"))


class Shown(Report):
    """The report, each row also printed as it is measured (a long run shows its progress)."""

    def add(self, what: str, figure: str, ratio: float | None = None) -> None:
        super().add(what, figure, ratio)
        print(f"  {what}: {figure}" + (f" ({ratio:.2f}x)" if ratio is not None else ""), flush=True)


KAFKA_SCANS = {
    "scan into a polars frame, all columns": lambda settings: frame_scan(settings),
    "scan into a polars frame, columns of latency-by-upstream":
        lambda settings: frame_scan(settings, NAMED_QUERIES["latency-by-upstream"]),
    "sql --query latency-by-upstream (end to end)": lambda settings: run_sql(settings, NAMED_QUERIES["latency-by-upstream"]),
    "sql --query tokens-latency-by-upstream-version (end to end)":
        lambda settings: run_sql(settings, NAMED_QUERIES["tokens-latency-by-upstream-version"]),
}


async def measure(report: Report, settings: KafkaSettings, events: int, data_dir: Path | None, root: Path,
                  rounds: int = 3) -> None:
    # The machine is shared and its load drifts within a run: each round measures every Kafka scan between
    # two raw scans, each against the faster of those two (the first scan after publishing may also meet a
    # broker still busy writing); the report gives each scan's median over the rounds.
    raw_rates, rates, ratios = [], {name: [] for name in KAFKA_SCANS}, {name: [] for name in KAFKA_SCANS}
    for n in range(1, rounds + 1):
        counted, before_s = await timed_async(raw_scan(settings))
        assert counted == events, (counted, events)
        took = {}
        for name, run in KAFKA_SCANS.items():
            df, took[name] = await timed_async(run(settings))
            if name.startswith("scan"):
                assert df.height == events
            del df
        counted, after_s = await timed_async(raw_scan(settings))
        raw_s = min(before_s, after_s)
        raw_rates.append(events / raw_s)
        for name, took_s in took.items():
            rates[name].append(events / took_s)
            ratios[name].append(raw_s / took_s)
        print(f"  round {n}/{rounds}: raw {events / raw_s:,.0f}/s; "
              + "; ".join(f"{name.split(' (')[0]} {ratios[name][-1]:.2f}x" for name in KAFKA_SCANS), flush=True)
    raw_s = events / statistics.median(raw_rates)
    report.add(f"Kafka: raw scan (count only, librdkafka): the baseline, median of {rounds} rounds",
               f"{events / raw_s:,.0f} events/s", 1.0)
    for name in KAFKA_SCANS:
        report.add(f"Kafka: {name}, median of {rounds} (ratio: median of each round's)",
                   f"{statistics.median(rates[name]):,.0f} events/s", statistics.median(ratios[name]))
    report.details["kafka_rounds"] = {"raw": raw_rates, **{name: {"events_per_s": rates[name], "ratio": ratios[name]}
                                                          for name in KAFKA_SCANS}}
    counted, aio_s = await timed_async(aiokafka_scan(settings))
    report.add("Kafka: raw scan with aiokafka (how scans read before)", f"{events / aio_s:,.0f} events/s", raw_s / aio_s)
    sample = min(events, 50_000)
    old_s, new_s = await decoding_only(settings, sample)
    report.add(f"decoding only, all columns, {sample:,} records in memory: row dicts (as before), CPU s",
               f"{sample / old_s:,.0f} events/s per core", 1.0)
    report.add("decoding only, all columns, the same records: native, Rust → Arrow (scans now), CPU s",
               f"{sample / new_s:,.0f} events/s per core", old_s / new_s)

    archiver = Archiver(settings, root, tables=("calls",), say=lambda _: None)
    _, archive_s = await timed_async(archiver.cycle())
    report.add("archive: Kafka → Parquet (zstd, by hour), exactly once", f"{events / archive_s:,.0f} events/s",
               raw_s / archive_s)
    manifest = Manifest.load(root, settings.topics.calls)
    parquet = sum(e["bytes"] for e in manifest.files)
    if data_dir is not None:
        in_kafka = kafka_bytes(data_dir, settings.topics.calls)
        report.add("bytes per call event in Kafka (uncompressed batches on disk)", f"{in_kafka / events:,.0f} B", 1.0)
        report.add("bytes per call event in the Parquet archive (table + record)", f"{parquet / events:,.0f} B",
                   parquet / in_kafka)
    report.details["parquet_bytes_per_event"] = parquet / events
    archive = Origin("archive", root)
    counted, arch_raw_s = await timed_async(raw_scan(settings, archive))
    assert counted == events
    report.add("archive: records read back for replay (count only)", f"{events / arch_raw_s:,.0f} events/s",
               raw_s / arch_raw_s)
    for label, sql in (("all columns", None), ("columns of latency-by-upstream", NAMED_QUERIES["latency-by-upstream"])):
        df, frame_s = await timed_async(frame_scan(settings, sql, archive))
        assert df.height == events
        report.add(f"archive: scan into a polars frame, {label}", f"{events / frame_s:,.0f} events/s", raw_s / frame_s)
    for name in ("latency-by-upstream", "tokens-latency-by-upstream-version"):
        _, sql_s = await timed_async(run_sql(settings, NAMED_QUERIES[name], origin=archive))
        report.add(f"archive: sql --query {name} ({events:,} calls, end to end)",
                   f"{events / sql_s:,.0f} events/s", raw_s / sql_s)


async def decoding_only(settings: KafkaSettings, limit: int) -> tuple[float, float]:
    """CPU seconds to decode the first `limit` records into a frame of all columns: a dict per row,
    then polars (as queries decoded before), and `decode` (as they do now). CPU time, not wall: on a
    busy machine it is the figure that does not depend on what the neighbours run."""
    records = []
    batches = scan(settings, settings.topics.calls, batch_size=20_000)
    async for batch in batches:
        records += batch
        if len(records) >= limit:
            break
    await batches.aclose()  # its consumer closed: no fetching on librdkafka's threads while timed
    records = records[:limit]
    start = time.process_time()
    frame(event_row(r) for r in records)
    old_s = time.process_time() - start
    start = time.process_time()
    decode(records, "calls")
    return old_s, time.process_time() - start


async def timed_async(coroutine):
    start = time.perf_counter()
    result = await coroutine
    return result, time.perf_counter() - start


def synthetic_calls(rows: int) -> pl.DataFrame:
    """The calls table's query-relevant columns at scale, built without Kafka."""
    rng = pl.int_range(0, rows, eager=True)
    return pl.DataFrame({
        "rollout_id": ("r" + (rng // 4).cast(pl.String)),
        "upstream": ("http://10.0.0." + (rng % 4).cast(pl.String) + ":8000"),
        "weight_version": rng // 10_000,
        "status": pl.Series([200] * rows).scatter(list(range(0, rows, 50)), 502),
        "latency_ms": pl.Series(range(rows)).cast(pl.Float64) % 97.0,
        "ttft_ms": pl.Series(range(rows)).cast(pl.Float64) % 13.0,
        "usage_prompt_tokens": pl.Series([200] * rows),
        "usage_completion_tokens": (rng % 64),
    })


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


async def main(events: int, rows: int, bootstrap: str | None, prefix: str, kafka_data: Path | None,
               rounds: int = 3) -> None:
    report = Shown("query")
    with tempfile.TemporaryDirectory() as tmp:
        broker, data_dir = None, kafka_data
        if bootstrap is None:
            broker = LocalKafka(Path(tmp) / "kafka", default_port=None)
            bootstrap = broker.start().url
            data_dir = Path(tmp) / "kafka"
        try:
            settings = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=4)
            await ensure_topics(settings)
            have = sum(end - start for start, end in (await resolve(settings, settings.topics.calls)).values())
            if have < events:
                print(f"publishing {events - have:,} call events…", flush=True)
                await asyncio.to_thread(fill, settings, events - have, have)
            elif have > events:
                events = have
            await measure(report, settings, events, data_dir, Path(tmp) / "archive", rounds)
        finally:
            if broker is not None:
                broker.stop()

    calls = synthetic_calls(rows)
    context = pl.SQLContext({"calls": calls}, eager=True)
    _, base_s = timed(lambda: context.execute("SELECT COUNT(*) FROM calls"))
    report.add(f"SELECT COUNT(*) on {rows:,} calls in memory", f"{base_s * 1000:.1f} ms", 1.0)
    for name in ("latency-by-upstream", "tokens-by-rollout", "tokens-latency-by-upstream-version"):
        _, query_s = timed(lambda name=name: context.execute(NAMED_QUERIES[name]))
        report.add(f"{name} on {rows:,} calls in memory", f"{query_s * 1000:.1f} ms", query_s / base_s)
    report.print("ratio: scans, throughput vs. the raw scan (count only) in the same run; "
                 "bytes, Parquet vs. Kafka; in-memory queries, time vs. COUNT(*)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--bootstrap", help="use this broker (and its topics, filled up to --events) instead of "
                                            "a throwaway one; then Kafka's bytes on disk are not measured")
    parser.add_argument("--prefix", default="bench.")
    parser.add_argument("--kafka-data", type=Path, help="with --bootstrap: the broker's data folder (for its bytes)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the Kafka scans, each between two raw scans")
    args = parser.parse_args()
    asyncio.run(main(args.events, args.rows, args.bootstrap, args.prefix, args.kafka_data, args.rounds))

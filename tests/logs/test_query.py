"""SQL over the log, on a known event set published to a real broker."""

from __future__ import annotations

import asyncio

import polars as pl
import pytest
from typer.testing import CliRunner

import agentstream.schemas as s
from agentstream.cli import app
from agentstream.logs.query import NAMED_QUERIES, decode, load_table, run_sql
from agentstream.schemas.kafka import make_producer
from agentstream.schemas.scan import Bounds, parse_offsets, parse_time, resolve, scan
from tests.support.logs import KNOWN, call, trajectory
from tests.support.streams import publish


async def test_ready_made_queries_on_known_events(kafka):
    await publish(kafka, KNOWN)

    by_version = await run_sql(kafka, NAMED_QUERIES["reward-by-version"])
    assert by_version.select("weight_version", "trajectories", "reward_mean", "reward_missing").rows() == [
        (0, 2, 0.5, 0), (1, 2, 1.0, 1)]

    latency = await run_sql(kafka, NAMED_QUERIES["latency-by-upstream"])
    rows = {r["upstream"]: r for r in latency.to_dicts()}
    assert rows["http://a"]["calls"] == 3 and rows["http://a"]["latency_p50_ms"] == 20.0
    assert rows["http://b"]["errors"] == 1 and rows["http://b"]["error_rate"] == 0.5

    tokens = await run_sql(kafka, NAMED_QUERIES["tokens-by-rollout"])
    assert dict(tokens.select("rollout_id", "completion_tokens").rows()) == {"r1": 7, "r2": 2, "r3": 2}


async def test_token_lists_stay_lists(kafka):
    await publish(kafka, KNOWN[:1])
    result = await run_sql(kafka, "SELECT prompt_token_ids, completion_token_ids FROM calls")
    assert result.schema["prompt_token_ids"] == pl.List(pl.Int64)
    assert result.row(0) == ([1, 2, 3], [0, 1])


async def test_scan_bounds_by_offsets_and_time(kafka):
    events = [call("same", "http://a", float(i)) for i in range(10)]
    await publish(kafka, events)
    partition = (await _partition_of(kafka, "same"))
    got = [r async for batch in scan(kafka, kafka.topics.calls, Bounds(start_offsets={partition: 3},
                                                                      end_offsets={partition: 7})) for r in batch]
    assert [r.offset for r in got] == [3, 4, 5, 6]
    future = [r async for batch in scan(kafka, kafka.topics.calls, Bounds(since_ms=parse_time("0s") + 60_000))
              for r in batch]
    assert future == []


async def test_a_table_from_kafka_keeps_its_range_and_reads_around_a_bad_record(kafka):
    """The columnar scan (librdkafka's messages handed over in bulk, no `Record` each) keeps what `scan` keeps:
    the range's offsets only; a record in it that is not an event costs only itself (its fetch is read row by
    row), as decoding `scan`'s records gives. (Messages fetched past a partition's end: test_decode's `take`.)"""
    await publish(kafka, [call("bounded", "http://a", float(i)) for i in range(6)])
    producer = make_producer(kafka)
    await producer.start()
    try:
        await producer.send_and_wait(kafka.topics.calls, b"not json", key=b"bounded")
    finally:
        await producer.stop()
    await publish(kafka, [call("bounded", "http://a", float(i)) for i in range(6, 10)])
    partition = await _partition_of(kafka, "bounded")
    offsets = [r.offset async for batch in scan(kafka, kafka.topics.calls) for r in batch
               if r.partition == partition and r.key == b"bounded"]
    bounds = Bounds.exactly({partition: (offsets[2], offsets[9])}, await resolve(kafka, kafka.topics.calls))

    table, unreadable = await load_table(kafka, "calls", bounds)

    assert table["kafka_offset"].to_list() == offsets[2:6] + offsets[7:9]
    assert table["latency_ms"].to_list() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0] and unreadable == 1
    records = [r async for batch in scan(kafka, kafka.topics.calls, bounds) for r in batch]
    assert table.equals(decode(records, "calls")[0])


async def _partition_of(settings, rollout):
    async for batch in scan(settings, settings.topics.calls):
        for record in batch:
            if record.key == rollout.encode():
                return record.partition


def test_parsers_explain_bad_input():
    assert parse_offsets("0:10,3:4") == {0: 10, 3: 4}
    assert parse_time("1700000000000") == 1700000000000
    assert parse_time("2023-11-14T22:13:20") == 1700000000000
    assert parse_time("10m", now_ms=1_000_000) == 400_000
    for bad, parse in (("x", parse_offsets), ("yesterday", parse_time)):
        try:
            parse(bad)
        except ValueError as exc:
            assert "e.g." in str(exc) or "give" in str(exc)
        else:
            raise AssertionError(bad)


async def test_sql_command_writes_csv_and_parquet(kafka, tmp_path, monkeypatch):
    await publish(kafka, KNOWN)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    runner = CliRunner()

    def invoke(args):  # the command runs its own event loop, so not on this one
        return asyncio.to_thread(runner.invoke, app, args)

    csv = await invoke(["sql", "SELECT rollout_id, prompt_token_ids FROM calls ORDER BY latency_ms LIMIT 1",
                              "--prefix", kafka.topic_prefix, "--format", "csv"])
    assert csv.exit_code == 0, csv.output
    assert csv.output.splitlines() == ["rollout_id,prompt_token_ids", 'r1,"[1,2,3]"']
    parquet = tmp_path / "out.parquet"
    result = await invoke(["sql", "--query", "reward-by-version", "--prefix", kafka.topic_prefix,
                                 "--format", "parquet", "--output", str(parquet)])
    assert result.exit_code == 0, result.output
    assert pl.read_parquet(parquet).height == 2
    missing = await invoke(["sql", "SELECT 1 FROM calls", "--prefix", "no-such-prefix."])
    assert missing.exit_code == 1 and "does not exist" in missing.output


def weights(version: int, base: int, lineage: list[str]) -> s.WeightsEvent:
    return s.WeightsEvent(source="test", data=s.Weights(model="tiny", version=version, uri=f"/ckpt/v{version}",
                                                        step=version, base_version=base, lineage=lineage))


async def test_staleness_of_trained_samples(kafka):
    launched = [trajectory(f"s{i}", version, reward) for i, (version, reward) in
                enumerate([(0, 0.0), (0, 1.0), (0, 1.0), (1, 0.5)])]
    # version 1 trained from 0 on two fresh samples; version 2 from 1 on one sample a version old and one fresh
    await publish(kafka, launched + [weights(1, 0, [launched[0].id, launched[1].id]),
                                     weights(2, 1, [launched[2].id, launched[3].id])])
    result = await run_sql(kafka, NAMED_QUERIES["staleness"])
    assert result.rows() == [(1, 0, 2, 0.5), (2, 0, 1, 0.5), (2, 1, 1, 1.0)]


def graded(rollout: str, task: str, split: str, version: int, reward: float, duration_ms: int) -> s.TrajectoryEvent:
    return s.TrajectoryEvent(source="test", rollout_id=rollout, attempt_id="a", data=s.Trajectory(
        task_id=task, split=split, status="finished", reward=reward, turns=[], sequences=[], merged=True,
        weight_version_launch=version, finished_at=0, duration_ms=duration_ms, lineage=[]))


async def test_questions_people_ask(kafka):
    pool = [s.PoolUpdateEvent(source="test", time=1000 * v, data=s.PoolUpdate(
        model="tiny", version=v, server="http://a", status="ok", pause_ms=100.0 * v, applied_by="g")) for v in (2, 1)]
    pool.append(s.PoolHeldEvent(source="test", time=1500, data=s.PoolHeld(model="tiny", version=2, cause="w2",
                                                                          replica="g")))  # no swap: not a pause
    retried = call("r5", "http://a", 15.0)
    retried.data.retry_count = 1  # the agent's SDK sent it again
    split = s.TrajectoryEvent(source="test", rollout_id="r5", attempt_id="a", data=s.Trajectory(
        status="finished", reward=0.0, turns=[], sequences=[], merged=False, merge_mismatches=1, superseded=2,
        weight_version_launch=3, finished_at=0, lineage=[]))
    await publish(kafka, KNOWN + pool + [retried, split] + [
        graded("g1", "t1", "train", 1, 1.0, 500), graded("g2", "t1", "train", 1, 0.0, 900),
        graded("g3", "t1", "validation", 1, 1.0, 100), graded("g4", "t2", "train", 2, 0.5, 300)])

    passed = await run_sql(kafka, NAMED_QUERIES["pass-rate-by-version-task"].replace(
        "FROM trajectories", "FROM trajectories WHERE task_id IS NOT NULL"))
    assert passed.select("weight_version", "split", "task_id", "attempts", "passed", "pass_rate").rows() == [
        (1, "train", "t1", 2, 1, 0.5), (1, "validation", "t1", 1, 1, 1.0), (2, "train", "t2", 1, 0, 0.0)]
    grades = [("g1", {"flagged": False, "graded_reward": 1.0}, 1.0), ("g2", {"flagged": True, "graded_reward": 0.0}, 0.0),
              ("g3", {"flagged": True, "graded_reward": 1.0, "penalized_by": ["always-equal"]}, 0.0),
              ("g4", {"flagged": False, "graded_reward": 0.0}, 0.0)]
    await publish(kafka, [s.RewardEvent(source="grader", rollout_id=rollout, attempt_id="a", data=s.Reward(
        value=value, details=details, reward_fn="recipes.swe.grader")) for rollout, details, value in grades]
                  + [s.RewardEvent(source="agent", rollout_id="g4", attempt_id="a", data=s.Reward(value=1.0))])
    flagged = await run_sql(kafka, NAMED_QUERIES["flagged-rewards-by-version"])
    assert flagged.select("weight_version", "graded", "flagged", "tests_passed", "penalized").rows() == [
        (1, 3, 2, 2, 1), (2, 1, 0, 0, 0)]
    assert flagged["flagged_rate"].to_list() == [pytest.approx(2 / 3), 0.0]
    slowest = await run_sql(kafka, NAMED_QUERIES["slowest-rollouts"])
    assert slowest["rollout_id"].to_list() == ["g2", "g1", "g4", "g3"]
    pauses = await run_sql(kafka, NAMED_QUERIES["pool-pauses"])
    assert pauses.select("version", "pause_ms").rows() == [(1, 100.0), (2, 200.0)]
    by_version = await run_sql(kafka, NAMED_QUERIES["tokens-latency-by-upstream-version"])
    assert by_version.select("upstream", "calls", "completion_tokens", "errors").rows() == [
        ("http://a", 4, 11, 0), ("http://b", 2, 2, 1)]
    retries = await run_sql(kafka, NAMED_QUERIES["retries-by-version"])
    assert retries.select("weight_version", "calls", "retried_calls", "failed_calls").rows() == [(1, 6, 1, 1)]
    assert retries["retry_rate"].to_list() == [pytest.approx(1 / 6)]
    superseded = await run_sql(kafka, NAMED_QUERIES["superseded-by-version"])
    assert superseded.filter(pl.col("weight_version") == 3).rows() == [(3, 1, 2, 1, 1)]
    assert superseded.filter(pl.col("weight_version") != 3)["superseded_calls"].sum() == 0

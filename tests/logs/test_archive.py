"""The Parquet archive on a real broker: exactly once through SIGKILLs, and the same SQL answers from
Kafka, from the archive, and from the archive plus Kafka's tail."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
from typer.testing import CliRunner

import agentstream.schemas as s
from agentstream.archive import Archiver
from agentstream.cli import app
from agentstream.logs.query import NAMED_QUERIES, run_sql
from agentstream.schemas.scan import Manifest, Origin, scan
from tests.support import faults
from tests.support.logs import KNOWN, call, trajectory
from tests.support.streams import publish
from tests.support.wait import wait_for


def archived_ids(root: Path, topic: str) -> list[str]:
    manifest = Manifest.load(root, topic)
    paths = [manifest.folder / entry["path"] for entry in manifest.files]
    return pl.read_parquet(paths)["id"].to_list() if paths else []


def archive_process(kafka, root: Path, *args: str, fault: str | None = None) -> subprocess.Popen:
    """`agentstream archive` as a real process, SIGKILLed at `fault` if given (tests/support/faults.py)."""
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    args = ("archive", "--prefix", kafka.topic_prefix, "--archive", str(root), *args)
    command = faults.command(fault, "agentstream", *args) if fault else [sys.executable, "-m", "agentstream", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


async def test_archive_killed_mid_run_keeps_every_record_once(kafka, tmp_path):
    events = [call(f"r{i % 7}", "http://a", float(i)) for i in range(400)]
    await publish_fast(kafka, events)
    root = tmp_path / "archive"
    topic = kafka.topics.calls

    # killed between writing a commit's files and its manifest: the worst moment
    with archive_process(kafka, root, "--once", "--commit-records", "40", fault="archive.after_files:3") as crashed:
        assert crashed.wait(timeout=300) == -signal.SIGKILL, crashed.stdout.read()
    manifest = Manifest.load(root, topic)
    named = {manifest.folder / entry["path"] for entry in manifest.files}
    on_disk = {path for path in manifest.folder.rglob("*.parquet")}
    assert manifest.commits == 2 and on_disk - named, "the killed commit's files are on disk, not in the manifest"

    # killed from outside, wherever it is, while it archives continuously
    with archive_process(kafka, root, "--commit-records", "25", "--interval", "0.2") as running:
        wait_for(lambda: (m := Manifest.load(root, topic)) is not None and m.commits >= 6, timeout=300,
                 what="six commits")
        running.send_signal(signal.SIGKILL)
        assert running.wait(timeout=60) == -signal.SIGKILL

    with archive_process(kafka, root, "--once", "--commit-records", "60") as finished:
        assert finished.wait(timeout=300) == 0, finished.stdout.read()
    ids = archived_ids(root, topic)
    assert sorted(ids) == sorted(e.id for e in events) and len(set(ids)) == len(ids)
    manifest = Manifest.load(root, topic)
    assert {manifest.folder / e["path"] for e in manifest.files} == set(manifest.folder.rglob("*.parquet"))
    # files are by hour and zstd-compressed Parquet with the record as Kafka holds it
    first = pl.read_parquet(manifest.folder / manifest.files[0]["path"])
    assert {"value", "key", "id", "kafka_offset", "completion_token_ids"} <= set(first.columns)
    assert all(e["path"].startswith("hour=") for e in manifest.files)

    # replaying from the archive gives the records Kafka gives, in the same order per partition
    from_kafka = [r async for batch in scan(kafka, topic) for r in batch]
    from_archive = [r async for batch in scan(kafka, topic, origin=Origin("archive", root)) for r in batch]
    assert sorted(from_archive) == sorted(from_kafka)


async def publish_fast(settings, events):
    from samples.publish import publish_all

    await publish_all(settings, events)


QUERIES = [
    "SELECT * FROM calls ORDER BY kafka_partition, kafka_offset",
    "SELECT id, rollout_id, request, completion_token_ids FROM calls ORDER BY id",
    *(NAMED_QUERIES[name] for name in ("reward-by-version", "latency-by-upstream", "tokens-by-rollout",
                                       "tokens-latency-by-upstream-version", "pass-rate-by-version-task")),
    "SELECT rollout_id, ARRAY_LENGTH(turns) AS turns, reward, lineage FROM trajectories ORDER BY rollout_id",
]


def same(got: pl.DataFrame, expected: pl.DataFrame) -> bool:
    """Equal rows, columns and types; rows that tie under a query's ORDER BY may come in either order."""
    sortable = [c for c, t in expected.schema.items() if not isinstance(t, (pl.List, pl.Struct))]
    return got.schema == expected.schema and got.sort(sortable).equals(expected.sort(sortable))


async def test_same_sql_from_kafka_archive_and_archive_with_tail(kafka, tmp_path):
    root = tmp_path / "archive"
    archiver = Archiver(kafka, root, commit_records=3, say=lambda _: None)
    await publish(kafka, KNOWN)
    await archiver.cycle()
    later = [call("r9", "http://c", 5.0, completion=3), trajectory("r9", 2, 1.0)]
    await publish(kafka, later)

    auto, kafka_only = Origin("auto", root), Origin("kafka")
    for sql in QUERIES:
        expected = await run_sql(kafka, sql, origin=kafka_only)
        assert expected.height > 0, sql
        assert same(await run_sql(kafka, sql, origin=auto), expected), sql  # archive + Kafka's tail
    archived_only = await run_sql(kafka, "SELECT COUNT(*) AS n FROM calls", origin=Origin("archive", root))
    assert archived_only.item() == sum(1 for e in KNOWN if isinstance(e, s.CallEvent))

    await archiver.cycle()
    for sql in QUERIES:
        expected = await run_sql(kafka, sql, origin=kafka_only)
        assert same(await run_sql(kafka, sql, origin=Origin("archive", root)), expected), sql


async def test_bad_queries_explain_themselves(kafka, monkeypatch, tmp_path):
    await publish(kafka, KNOWN)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    runner = CliRunner()

    def invoke(*args):
        return asyncio.to_thread(runner.invoke, app, ["sql", *args, "--prefix", kafka.topic_prefix])

    for args, says in [
        (["SELEC latency_ms FROM calls"], "query failed"),
        (["SELECT nothing_here FROM calls"], "nothing_here"),
        (["SELECT * FROM nosuch"], "names no topic table"),
        (["SELECT c.id FROM calls c JOIN nosuch n ON c.id = n.id"], "nosuch"),
        (["SELECT * FROM calls", "--source", "archive", "--archive", str(tmp_path)], "holds nothing"),
        (["SELECT * FROM calls", "--source", "lake"], "unknown source"),
    ]:
        result = await invoke(*args)
        said = " ".join(result.output.split())  # the console wraps long messages at its width
        assert result.exit_code == 1 and says in said, (args, result.output)
        assert "Traceback" not in result.output
    empty = await invoke("SELECT rollout_id, latency_ms FROM calls", "--since", "2099-01-01", "--format", "csv")
    assert empty.exit_code == 0, empty.output
    assert empty.output.splitlines() == ["rollout_id,latency_ms"]
    nothing = await invoke("SELECT upstream, COUNT(*) AS n FROM calls GROUP BY upstream", "--since", "2099-01-01",
                           "--format", "csv")
    assert nothing.exit_code == 0 and nothing.output.splitlines() == ["upstream,n"], nothing.output

"""The log's commands: SQL over the topics, the live view, and the Parquet archive (agentstream/logs/)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agentstream.cli.options import (
    ArchiveDir,
    EndOffsets,
    ReadFrom,
    Since,
    StartOffsets,
    TopicPrefix,
    Until,
    bounds,
    kafka_settings,
    origin,
)
from agentstream.cli.output import console, fail

if TYPE_CHECKING:
    from agentstream.logs.remote import Dashboard

DashboardUrl = Annotated[str | None, typer.Option(
    "--dashboard", help="read through this dashboard's HTTP API (e.g. http://127.0.0.1:8090) with --key, not Kafka: "
                        "a tenant's key gets its own tenant's trajectories only")]
DashboardKey = Annotated[str | None, typer.Option(
    "--key", envvar="AGENTSTREAM_DASHBOARD_KEY", show_envvar=True,
    help="the key for --dashboard (prefer the environment: flags show in process listings)")]


def sql(
    query: Annotated[str | None, typer.Argument(help="polars SQL; tables: rollouts, calls, rewards, "
                                                   "trajectories, weights, pool, deadletter, metrics")] = None,
    named: Annotated[str | None, typer.Option("--query", "-q", help="a ready-made query (see --list)")] = None,
    list_queries: Annotated[bool, typer.Option("--list", help="list the ready-made queries")] = False,
    output_format: Annotated[str, typer.Option("--format", help="table, csv, json or parquet")] = "table",
    output: Annotated[Path | None, typer.Option(help="write to this file instead of the terminal")] = None,
    topic_prefix: TopicPrefix = "",
    since: Since = None,
    until: Until = None,
    from_offsets: StartOffsets = None,
    to_offsets: EndOffsets = None,
    source: ReadFrom = "auto",
    archive: ArchiveDir = Path("runs/archive"),
    dashboard: DashboardUrl = None,
    key: DashboardKey = None,
) -> None:
    """Query the topics with SQL, each topic a table of flattened event fields (with --dashboard: your tenant's
    trajectories table, read through the dashboard)."""
    from agentstream.logs import results
    from agentstream.logs.query import NAMED_QUERIES

    if list_queries:
        for name, text in NAMED_QUERIES.items():
            console.print(f"[bold]{name}[/bold]\n{text.strip()}\n")
        return
    if named:
        if named not in NAMED_QUERIES:
            fail(f"no ready-made query {named!r}; choose one of: {', '.join(NAMED_QUERIES)}")
        query = NAMED_QUERIES[named]
    if not query:
        fail("give a query, e.g. agentstream sql \"SELECT model, COUNT(*) FROM calls GROUP BY model\", "
             "or --query NAME (see --list)")
    results.check_format(output_format, output)
    if dashboard is not None:
        if from_offsets or to_offsets or source != "auto":
            fail("--dashboard reads by time (--since, --until): offsets and --source are for Kafka and the archive")
        frame = _through(dashboard, key).query(query, since, until)
        results.write(frame, output_format, output, console)
        return
    settings = kafka_settings(topic_prefix)
    frame = asyncio.run(results.read(settings, query, bounds(since, until, from_offsets, to_offsets),
                                     origin(source, archive), console))
    results.write(frame, output_format, output, console)


def top(
    topic_prefix: TopicPrefix = "",
    window: Annotated[int | None, typer.Option(help="window size in seconds [default: the smallest published]")] = None,
    history: Annotated[str, typer.Option(help="how far back to start: an age (15m, 2h) or a time")] = "15m",
    refresh: Annotated[float, typer.Option(help="seconds between screen updates")] = 2.0,
    once: Annotated[bool, typer.Option(help="print the view once and exit")] = False,
) -> None:
    """Live view of the streams' windowed analytics: throughput, latency, reward by version, pool pauses."""
    from agentstream.logs.top import show_live, show_once
    from agentstream.schemas.scan import parse_time

    settings = kafka_settings(topic_prefix)
    try:
        since = parse_time(history)
    except ValueError as exc:
        fail(str(exc))
    try:
        if once:
            asyncio.run(show_once(settings, since, window, console))
        else:
            asyncio.run(show_live(settings, since, window, refresh, console))
    except LookupError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


def archive_topics(
    topic_prefix: TopicPrefix = "",
    archive: ArchiveDir = Path("runs/archive"),
    interval: Annotated[float, typer.Option(help="seconds between rounds once caught up")] = 10.0,
    once: Annotated[bool, typer.Option(help="archive up to the topics' current end, then exit")] = False,
    commit_records: Annotated[int, typer.Option(help="the most records per commit (bounds memory)")] = 200_000,
) -> None:
    """Compact every topic into Parquet files by topic and hour (zstd), exactly once; kill it any time.

    sql and replay read the archive for what it holds and Kafka for the rest (--source auto).
    """
    from agentstream.archive import Archiver, run

    if commit_records < 1:
        fail("--commit-records must be at least 1")
    archiver = Archiver(kafka_settings(topic_prefix), archive, commit_records, say=console.print)
    console.print(f"Archiving topics under {topic_prefix or '(no prefix)'!r} into {archive} …")
    asyncio.run(run(archiver, interval, once))
    total = sum(archiver.archived.values())
    console.print(f"Archive up to date: {total:,} records archived by this run." if once else "Archive stopped.")


def export_trajectories(
    dashboard: DashboardUrl = None,
    key: DashboardKey = None,
    output: Annotated[Path, typer.Option(help="the file to write")] = Path("trajectories.jsonl"),
    output_format: Annotated[str, typer.Option("--format", help="jsonl or parquet")] = "jsonl",
    since: Since = None,
    until: Until = None,
    where: Annotated[str | None, typer.Option(help="a SQL condition over the trajectories' columns")] = None,
) -> None:
    """Export trajectories through the dashboard: a tenant's key its own tenant's, an operator's every one, whole
    (the columns of `agentstream sql`'s trajectories table), as JSON lines or Parquet."""
    if output_format not in ("jsonl", "parquet"):
        fail(f"unknown --format {output_format!r}: use jsonl or parquet")
    count = _through(dashboard, key).export(output, "parquet" if output_format == "parquet" else "jsonl", since,
                                            until, where)
    console.print(f"Wrote {count:,} trajectories to {output}")


def _through(dashboard: str | None, key: str | None) -> Dashboard:
    from agentstream.logs.remote import Dashboard

    if not dashboard:
        fail("name the dashboard: --dashboard URL (and the key: --key or AGENTSTREAM_DASHBOARD_KEY)")
    if not key:
        fail("the dashboard needs a key: AGENTSTREAM_DASHBOARD_KEY (or --key)")
    return Dashboard(dashboard, key)

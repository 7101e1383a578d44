"""Several SQL queries over one read of the topics they name, through `agentstream.logs.query`.

Each table is read once (its columns: the union of what the queries use), then every query runs on
the same frames. A table the log has no rows of gives its queries an empty answer, not an error.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from agentstream.logs.query import columns_in, load_table, tables_in
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import Bounds

WHOLE = frozenset({"pool", "weights"})
"""small topics (an event per swap or version) read whole, whatever the range: the current version
of a server may be older than the range, and lineage needs every version"""


@dataclass
class Answer:
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


async def load_tables(settings: KafkaSettings, queries: dict[str, str], bounds: Bounds) -> dict[str, pl.DataFrame]:
    names = sorted({table for sql in queries.values() for table in tables_in(sql)})
    wanted: dict[str, frozenset[str] | None] = {}
    for name in names:
        used = [columns_in(sql) for sql in queries.values() if name in tables_in(sql)]
        # `id` always: a query of COUNT(*) alone names no column, and a row needs one to count
        named = [columns for columns in used if columns is not None]
        wanted[name] = None if len(named) < len(used) else frozenset[str]().union(*named) | {"id"}
    loaded = await asyncio.gather(*(load_table(settings, name, Bounds() if name in WHOLE else bounds,
                                               columns=wanted[name]) for name in names))
    return {name: frame for name, (frame, _) in zip(names, loaded)}


def run_on(tables: dict[str, pl.DataFrame], queries: dict[str, str]) -> dict[str, Answer]:
    answers = {}
    for key, sql in queries.items():
        used = tables_in(sql)
        if any(tables[name].height == 0 for name in used):
            answers[key] = Answer()
            continue
        context = pl.SQLContext({name: tables[name] for name in used}, eager=True)
        try:
            answers[key] = Answer(context.execute(sql).to_dicts())
        except Exception as exc:  # polars' SQL and column errors have types of their own
            answers[key] = Answer(error=f"{type(exc).__name__}: {exc}")
    return answers


async def run_many(settings: KafkaSettings, queries: dict[str, str], bounds: Bounds) -> dict[str, Answer]:
    return run_on(await load_tables(settings, queries, bounds), queries)

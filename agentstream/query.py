"""SQL over the log: each topic a polars table, its events' fields flattened.

Columns: the envelope (id, type, schema_version, time, source, rollout_id, attempt_id), the Kafka
position (kafka_partition, kafka_offset, kafka_timestamp), then the event's data fields. Typed
sub-records are flattened with `_` (`usage_prompt_tokens`, `task_id`); token lists stay lists;
lists of records stay lists of structs; free-form JSON (request, response, details, metadata,
metrics, the task input) is kept as a JSON string, queryable with polars' JSON functions.
"""

from __future__ import annotations

import asyncio
import re
import types
import typing
from collections.abc import Iterable
from functools import cache

import orjson
import polars as pl
from aiokafka import ConsumerRecord
from pydantic import BaseModel

from agentstream.repeats import drop_repeats
from agentstream.scan import Bounds, ScanProgress, scan
from schemas.events import EVENT_TYPES, Payload
from schemas.kafka import KafkaSettings

ENVELOPE = ("id", "type", "schema_version", "time", "source", "rollout_id", "attempt_id")
TABLES = ("rollouts", "calls", "rewards", "trajectories", "weights", "pool", "deadletter", "metrics")


def _unwrap_optional(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


@cache
def _shape(model: type[BaseModel]) -> dict[str, object]:
    """For each field: "json" (free-form), a nested shape (flattened sub-record), or None (as is)."""
    shape: dict[str, object] = {}
    for name, info in model.model_fields.items():
        annotation = _unwrap_optional(info.annotation)
        if isinstance(annotation, type) and issubclass(annotation, Payload):
            shape[name] = _shape(annotation)
        elif typing.get_origin(annotation) is dict or annotation is typing.Any:
            shape[name] = "json"
        else:
            shape[name] = None
    return shape


@cache
def _data_shapes() -> dict[str, dict[str, object]]:
    return {cls.model_fields["type"].default: _shape(cls.model_fields["data"].annotation) for cls in EVENT_TYPES}


def _flatten(data: dict, shape: dict[str, object], prefix: str, row: dict) -> None:
    for name, value in data.items():
        kind = shape.get(name)
        if kind == "json":
            row[prefix + name] = orjson.dumps(value).decode() if value is not None else None
        elif isinstance(kind, dict):
            if value is None:
                continue
            _flatten(value, kind, f"{prefix}{name}_", row)
        else:
            row[prefix + name] = value


def event_row(record: ConsumerRecord, columns: frozenset[str] | None = None) -> dict | None:
    """One table row for a record, or None if it is not a readable event.

    With `columns`, only those columns are kept: building lists of token ids is most of the cost.
    """
    try:
        event = orjson.loads(record.value)
        shape = _data_shapes()[event["type"]]
        row = {name: event.get(name) for name in ENVELOPE}
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    row.update(kafka_partition=record.partition, kafka_offset=record.offset, kafka_timestamp=record.timestamp)
    _flatten(event.get("data") or {}, shape, "", row)
    if columns is not None:
        row = {name: value for name, value in row.items() if name in columns}
    return row


def frame(rows: Iterable[dict]) -> pl.DataFrame:
    rows = list(rows)
    return pl.from_dicts(rows, infer_schema_length=None) if rows else pl.DataFrame()


async def load_table(settings: KafkaSettings, table: str, bounds: Bounds = Bounds(), on_progress=None,
                     columns: frozenset[str] | None = None) -> tuple[pl.DataFrame, int]:
    """The table for one topic within bounds (each event id once), and how many records were unreadable."""
    if columns is not None:
        columns = columns | {"id"}  # repeats are dropped by id
    rows, unreadable = [], 0
    async for batch in scan(settings, settings.topics.name(table), bounds, on_progress=on_progress):
        for record in batch:
            row = event_row(record, columns)
            if row is None:
                unreadable += 1
            else:
                rows.append(row)
    return drop_repeats(frame(rows)), unreadable


def _words(sql: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z_][a-z0-9_]*", sql.lower()))


def tables_in(sql: str) -> list[str]:
    """The topic tables a query mentions (so only those are read)."""
    words = _words(sql)
    return [table for table in TABLES if table in words]


def columns_in(sql: str) -> frozenset[str] | None:
    """The column names a query may use (every word in it), or None for all (`*`)."""
    return None if "*" in re.sub(r"count\s*\(\s*\*\s*\)", "", sql, flags=re.IGNORECASE) else _words(sql)


async def run_sql(settings: KafkaSettings, sql: str, bounds: Bounds = Bounds(), on_progress=None) -> pl.DataFrame:
    names = tables_in(sql)
    if not names:
        raise ValueError(f"the query names no topic table; tables are: {', '.join(TABLES)}")
    columns = columns_in(sql)
    loaded = await asyncio.gather(*(load_table(settings, name, bounds, on_progress, columns) for name in names))
    context = pl.SQLContext({name: df for name, (df, _) in zip(names, loaded)}, eager=True)
    return context.execute(sql)


# Ready-made queries for the common questions.
NAMED_QUERIES: dict[str, str] = {
    "reward-by-version": """
        SELECT t.weight_version_launch AS weight_version, COUNT(*) AS trajectories,
               AVG(t.reward) AS reward_mean, MIN(t.reward) AS reward_min, MAX(t.reward) AS reward_max,
               SUM(CASE WHEN t.reward_missing THEN 1 ELSE 0 END) AS reward_missing
        FROM trajectories t GROUP BY t.weight_version_launch ORDER BY weight_version""",
    "latency-by-upstream": """
        SELECT upstream, COUNT(*) AS calls,
               QUANTILE_CONT(latency_ms, 0.5) AS latency_p50_ms, QUANTILE_CONT(latency_ms, 0.99) AS latency_p99_ms,
               SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS errors,
               AVG(CASE WHEN status >= 400 THEN 1.0 ELSE 0.0 END) AS error_rate
        FROM calls GROUP BY upstream ORDER BY calls DESC""",
    "tokens-by-rollout": """
        SELECT rollout_id, COUNT(*) AS calls, SUM(usage_prompt_tokens) AS prompt_tokens,
               SUM(usage_completion_tokens) AS completion_tokens
        FROM calls WHERE rollout_id IS NOT NULL GROUP BY rollout_id ORDER BY completion_tokens DESC""",
    "staleness": """
        SELECT w.version AS trained_into, w.base_version - t.weight_version_launch AS staleness,
               COUNT(*) AS samples, AVG(t.reward) AS reward_mean
        FROM (SELECT version, base_version, UNNEST(lineage) AS trajectory_id FROM weights) AS w
        JOIN trajectories AS t ON t.id = w.trajectory_id
        GROUP BY w.version, staleness ORDER BY trained_into, staleness""",
}

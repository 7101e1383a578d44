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
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import orjson
import polars as pl
from agentstream_native import Decoder
from pydantic import BaseModel

from agentstream.logs.repeats import drop_repeats
from agentstream.schemas import collector
from agentstream.schemas.events import EVENT_TYPES, Payload
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import (
    KAFKA,
    Bounds,
    Fetch,
    Origin,
    Record,
    ScanProgress,
    archive_table,
    plan_scan,
    scan_fetches,
)

if TYPE_CHECKING:
    from polars._typing import PolarsDataType

OnProgress = Callable[[ScanProgress], None]

ENVELOPE = ("id", "type", "schema_version", "time", "source", "rollout_id", "attempt_id")
DECODING = 2
"""fetches of a scan decoded at once, each on a thread of its own, while the next is fetched"""
TABLES = ("rollouts", "calls", "rewards", "trajectories", "weights", "pool", "deadletter", "metrics")


def _unwrap_optional(annotation: Any) -> Any:
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
    return {cls.model_fields["type"].default: _shape(_data_model(cls)) for cls in EVENT_TYPES}


def _data_model(event_type: type[BaseModel]) -> type[BaseModel]:
    """The payload model of an event type (its `data` field's)."""
    model = event_type.model_fields["data"].annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{event_type.__name__}.data is not a model")
    return model


def _flatten(data: dict[str, Any], shape: dict[str, object], prefix: str, row: dict[str, Any]) -> None:
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


def event_row(record: Record, columns: frozenset[str] | None = None) -> dict[str, Any] | None:
    """One table row for a record, or None if it is not a readable event.

    With `columns`, only those columns are kept: building lists of token ids is most of the cost.
    """
    try:
        event = orjson.loads(record.value or b"")
        shape = _data_shapes()[event["type"]]
        row = {name: event.get(name) for name in ENVELOPE}
        row.update(kafka_partition=record.partition, kafka_offset=record.offset, kafka_timestamp=record.timestamp)
        _flatten(event.get("data") or {}, shape, "", row)
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):  # AttributeError: a sub-record
        # (data, usage) that is not an object
        return None
    if columns is not None:
        row = {name: value for name, value in row.items() if name in columns}
    return row


def frame(rows: Iterable[dict[str, Any]]) -> pl.DataFrame:
    listed = list(rows)
    return pl.from_dicts(listed, infer_schema_length=None) if listed else pl.DataFrame()


# --- decoding a batch straight into columns ------------------------------------------------------
# polars' own JSON reader parses a batch of values into typed columns (the schema comes from the
# event models, so it is the same for every batch, and an empty range still has its columns).
# Free-form JSON fields are the exception: polars would render them as text that is not JSON, so
# they are encoded with orjson, and only when the query names them.

KAFKA_COLUMNS: dict[str, PolarsDataType] = {"kafka_partition": pl.Int64, "kafka_offset": pl.Int64, "kafka_timestamp": pl.Int64}
_ENVELOPE_TYPES: dict[str, PolarsDataType] = {"id": pl.String, "type": pl.String, "schema_version": pl.Int64, "time": pl.Int64,
                   "source": pl.String, "rollout_id": pl.String, "attempt_id": pl.String}
_KNOWN_TYPES = frozenset(cls.model_fields["type"].default for cls in EVENT_TYPES)


def _dtype(annotation: Any) -> pl.DataType:
    annotation = _unwrap_optional(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal or annotation is str:
        return pl.String()
    if annotation is bool:
        return pl.Boolean()
    if annotation is int:
        return pl.Int64()
    if annotation is float:
        return pl.Float64()
    if origin is list:
        (item,) = typing.get_args(annotation)
        return pl.List(_dtype(item))
    if isinstance(annotation, type) and issubclass(annotation, Payload):
        return pl.Struct({name: _dtype(info.annotation) for name, info in annotation.model_fields.items()})
    return pl.String()  # free-form JSON


@dataclass(frozen=True)
class _Field:
    column: str
    path: tuple[str, ...]
    """where it is under `data`"""
    dtype: pl.DataType
    json: bool


def _fields(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[_Field]:
    out: list[_Field] = []
    for name, kind in _shape(model).items():
        annotation = _unwrap_optional(model.model_fields[name].annotation)
        if isinstance(kind, dict):
            out += _fields(annotation, (*path, name))
        else:
            out.append(_Field("_".join((*path, name)), (*path, name),
                              pl.String() if kind == "json" else _dtype(annotation), kind == "json"))
    return out


@cache
def table_fields(table: str) -> tuple[_Field, ...]:
    """The data columns of a topic's table: every event type written to it, in the models' order."""
    seen: dict[str, _Field] = {}
    for cls in EVENT_TYPES:
        if cls.topic == table:
            for f in _fields(_data_model(cls)):
                seen.setdefault(f.column, f)
    return tuple(seen.values())


def table_schema(table: str) -> pl.Schema:
    """The columns of a table, as `decode` makes them."""
    return pl.Schema({**_ENVELOPE_TYPES, **KAFKA_COLUMNS, **{f.column: f.dtype for f in table_fields(table)}})


def _reader_schema(fields: list[_Field], envelope: list[str]) -> dict[str, PolarsDataType]:
    """The nested schema for polars' JSON reader: the envelope, and `data` with the fields asked for."""
    tree: dict[str, Any] = {}
    for f in fields:
        node = tree
        for part in f.path[:-1]:
            node = node.setdefault(part, {})
        node[f.path[-1]] = f.dtype

    def struct(node: dict[str, Any]) -> pl.Struct:
        return pl.Struct({k: struct(v) if isinstance(v, dict) else v for k, v in node.items()})

    schema: dict[str, PolarsDataType] = {name: _ENVELOPE_TYPES[name] for name in envelope}
    schema.setdefault("type", pl.String())
    if tree:
        schema["data"] = struct(tree)
    return schema


def decode(records: list[Record] | Fetch, table: str, columns: frozenset[str] | None = None) -> tuple[pl.DataFrame, int]:
    """A batch of records (or a scan's fetch) as table rows (only `columns`, if given), and how many were
    unreadable."""
    df = decode_aligned(records, table, columns)
    readable = df["readable"]
    unreadable = df.height - int(readable.sum())
    return (df.filter(readable) if unreadable else df).drop("readable"), unreadable


def decode_aligned(records: list[Record] | Fetch, table: str, columns: frozenset[str] | None = None) -> pl.DataFrame:
    """One row per record, in order, with a `readable` column: False (and the other columns null) for
    a record that is not an event (what the archive keeps too, as the log holds it)."""
    schema = table_schema(table)
    wanted = [name for name in schema if columns is None or name in columns]
    envelope = tuple(n for n in _ENVELOPE_TYPES if n in wanted and n != "type")
    fields = tuple(f for f in table_fields(table) if f.column in wanted)
    try:
        out = _columns(records, envelope, fields, _sub_records(table))
    except ValueError:  # a record the fast way cannot read (off the models' types, not JSON): the batch goes
        # the careful way
        return _decode_rows(records.records() if isinstance(records, Fetch) else records, schema, wanted)
    known = out["type_"].is_in(list(_KNOWN_TYPES)).fill_null(False).alias("readable")
    frame = pl.DataFrame([*(out["type_"].alias(n) if n == "type" else out[n] for n in wanted), known],
                         schema={**{n: schema[n] for n in wanted}, "readable": pl.Boolean})
    if not known.all():  # a record that is not an event has no columns but its position
        frame = frame.with_columns(pl.when(pl.col("readable")).then(pl.col(n)).otherwise(None).alias(n)
                                   for n in wanted if n not in KAFKA_COLUMNS)
    return frame


# The fast way: one pass in Rust (native/, `agentstream_native`) parses each record straight into
# Arrow columns of exactly the fields asked for, checking and skipping the rest, strictly typed; polars
# takes the columns without a copy (the Arrow C data interface). It lets go of the GIL, so a batch
# decodes on one core while the next is fetched on the other. Free-form JSON comes as its text, which
# is what `orjson.dumps(value)` wrote unless the text has spaces, floats, other escapes or a repeated
# key: those values (the decoder names them) orjson encodes again. Anything that does not fit the models (a
# wrong type, a record that is not JSON) raises ValueError, and its batch is decoded row by row instead.


def _kind(dtype: PolarsDataType, json: bool = False) -> str | tuple[str, Any]:
    """A column's type as the native decoder names it."""
    if json:
        return "json"
    if isinstance(dtype, pl.List):
        return ("list", _kind(dtype.inner))
    if isinstance(dtype, pl.Struct):
        return ("struct", [(f.name, _kind(f.dtype)) for f in dtype.fields])
    scalars: dict[PolarsDataType, str] = {pl.String: "str", pl.Int64: "int", pl.Float64: "float", pl.Boolean: "bool"}
    return scalars[dtype.base_type()]


@cache
def _decoder(envelope: tuple[str, ...], fields: tuple[_Field, ...],
             objects: tuple[tuple[str, ...], ...] = ()) -> Decoder:
    """The native decoder of the envelope names and the data fields asked for; the type always (as `type_`).

    `objects`: the sub-records (`("data", "usage")`) that must be objects or null even when no column in
    them is asked, since row by row a record with `"usage": []` is unreadable whatever the query."""
    return Decoder([("type_", ["type"], "str"),
                    *((n, [n], _kind(_ENVELOPE_TYPES[n])) for n in envelope),
                    *((f.column, ["data", *f.path], _kind(f.dtype, f.json)) for f in fields)],
                   [list(path) for path in objects])


@cache
def _sub_records(table: str) -> tuple[tuple[str, ...], ...]:
    """`data` and every sub-record under it in the table's events."""
    return (("data",),
            *dict.fromkeys(("data", *f.path[:n]) for f in table_fields(table) for n in range(1, len(f.path))))


def _columns(records: list[Record] | Fetch, envelope: tuple[str, ...], fields: tuple[_Field, ...],
             objects: tuple[tuple[str, ...], ...] = ()) -> pl.DataFrame:
    """The records' columns (`type_`, those asked for, their positions); ValueError if a record does not fit
    the models."""
    decoder = _decoder(envelope, fields, objects)
    columns, recode = decoder.decode_fetched(records.taken) if isinstance(records, Fetch) else decoder.decode(records)
    out = pl.DataFrame(columns)
    for name, rows in recode:  # JSON text orjson writes otherwise (spaces, floats, other escapes): as it does
        out = out.with_columns(out[name].scatter(rows, _json_text(out[name].gather(rows).to_list())))
    return out


def _json_text(texts: list[str | None]) -> list[str | None]:
    return [None if text is None else orjson.dumps(orjson.loads(text)).decode() for text in texts]


def _decode_rows(records: list[Record], schema: pl.Schema, wanted: list[str]) -> pl.DataFrame:
    rows: list[dict[str, Any]] = []
    for record in records:
        row = event_row(record, frozenset(wanted)) if record.value else None
        if row is None:
            row = {"kafka_partition": record.partition, "kafka_offset": record.offset,
                   "kafka_timestamp": record.timestamp, "readable": False}
        else:
            row["readable"] = True
        rows.append(row)
    types: dict[str, PolarsDataType] = {**{name: schema[name] for name in wanted}, "readable": pl.Boolean}
    chosen = pl.Schema(types)
    if not rows:
        return pl.DataFrame(schema=chosen)
    try:
        return pl.from_dicts(rows, schema=chosen, strict=False)
    except Exception:
        # for token ids): that record is unreadable, its neighbours are not
        return pl.concat([_one_row(row, chosen) for row in rows])


def _one_row(row: dict[str, Any], schema: pl.Schema) -> pl.DataFrame:
    try:
        return pl.from_dicts([row], schema=schema, strict=False)
    except Exception:
        position = {n: row[n] for n in KAFKA_COLUMNS if n in row}
        return pl.from_dicts([{**position, "readable": False}], schema=schema)


async def load_table(settings: KafkaSettings, table: str, bounds: Bounds = Bounds(), on_progress: OnProgress | None = None,
                     columns: frozenset[str] | None = None, origin: Origin = KAFKA) -> tuple[pl.DataFrame, int]:
    """The table for one topic within bounds (each event id once), and how many records were unreadable.

    From the archive, the table is read as the archive stored it (decoded once, when archived);
    the tail after it is read from Kafka and decoded here, the same way.
    """
    if columns is not None:
        columns = columns | {"kafka_offset", "id"}  # COUNT(*) needs a column; repeats are dropped by id
    topic = settings.topics.name(table)
    plan = await plan_scan(settings, topic, bounds, origin)
    parts: list[pl.DataFrame] = []
    unreadable = 0
    if plan.old and plan.manifest is not None:  # (an archive serves a part: its manifest is known)
        old = archive_table(plan.manifest, plan.old, [n for n in table_schema(table) if columns is None or n in columns])
        if old is not None:
            parts.append(old)
    if plan.tail:
        with collector.paused():
            tail, unreadable = await _kafka_parts(settings, topic, plan.tail, table, columns, on_progress)
        parts += tail
    if not parts:
        return decode([], table, columns)[0], 0
    whole = pl.concat(parts, how="vertical_relaxed") if len(parts) > 1 else parts[0]
    return drop_repeats(whole), unreadable


async def _kafka_parts(settings: KafkaSettings, topic: str, ranges: dict[int, tuple[int, int]], table: str,
                       columns: frozenset[str] | None, on_progress: OnProgress | None = None
                       ) -> tuple[list[pl.DataFrame], int]:
    """The table's rows in `ranges` from Kafka, a frame per fetch, and how many records were unreadable.

    Fetches are decoded on threads (the native decoder lets go of the GIL) while the next is fetched."""
    parts: list[pl.DataFrame] = []
    unreadable = 0
    decoding: deque[asyncio.Future[tuple[pl.DataFrame, int]]] = deque()
    fetches = scan_fetches(settings, topic, ranges, batch_size=20_000, on_progress=on_progress)
    try:
        async with aclosing(fetches):  # a decoding that fails closes the scan's consumer at once
            async for fetch in fetches:
                decoding.append(asyncio.ensure_future(asyncio.to_thread(decode, fetch, table, columns)))
                if len(decoding) > DECODING:
                    df, bad = await decoding.popleft()
                    parts.append(df)
                    unreadable += bad
        while decoding:
            df, bad = await decoding.popleft()
            parts.append(df)
            unreadable += bad
    finally:
        # a scan that failed partway: the decodings under way run on to their end on their threads (a thread
        # cannot be stopped); wait for them, so none outlives the scan and no error of theirs goes unread
        await asyncio.gather(*decoding, return_exceptions=True)
    return parts, unreadable


def _words(sql: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z_][a-z0-9_]*", sql.lower()))


def tables_in(sql: str) -> list[str]:
    """The topic tables a query mentions (so only those are read)."""
    words = _words(sql)
    return [table for table in TABLES if table in words]


def columns_in(sql: str) -> frozenset[str] | None:
    """The column names a query may use (every word in it), or None for all (`*`)."""
    return None if "*" in re.sub(r"count\s*\(\s*\*\s*\)", "", sql, flags=re.IGNORECASE) else _words(sql)


async def run_sql(settings: KafkaSettings, sql: str, bounds: Bounds = Bounds(), on_progress: OnProgress | None = None,
                  origin: Origin = KAFKA) -> pl.DataFrame:
    names = tables_in(sql)
    if not names:
        raise ValueError(f"the query names no topic table; tables are: {', '.join(TABLES)}")
    columns = columns_in(sql)
    loaded = await asyncio.gather(*(load_table(settings, name, bounds, on_progress, columns, origin)
                                    for name in names))
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
    # `agentstream eval` records one eval event per measured version (validation tasks only); a probe's
    # (`tasks swe probe`, run id probe-…) measures train tasks and is left out
    "pass-rate-by-version": """
        SELECT weight_version, model, tasks, k, samples, pass_at_1, pass_at_k, solved_tasks, run_id
        FROM metrics WHERE type = 'eval' AND run_id NOT LIKE 'probe-%' ORDER BY weight_version, time""",
    "tokens-latency-by-upstream-version": """
        SELECT upstream, weight_version, COUNT(*) AS calls,
               SUM(usage_prompt_tokens) AS prompt_tokens, SUM(usage_completion_tokens) AS completion_tokens,
               AVG(usage_completion_tokens) AS completion_tokens_mean,
               QUANTILE_CONT(latency_ms, 0.5) AS latency_p50_ms, QUANTILE_CONT(latency_ms, 0.99) AS latency_p99_ms,
               QUANTILE_CONT(ttft_ms, 0.5) AS ttft_p50_ms,
               SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS errors
        FROM calls GROUP BY upstream, weight_version ORDER BY upstream, weight_version""",
    # a graded task's reward is 1 when its tests pass (the SWE recipe's grader): pass rate = reward >= 1
    "pass-rate-by-version-task": """
        SELECT weight_version_launch AS weight_version, split, task_id, COUNT(*) AS attempts,
               SUM(CASE WHEN reward >= 1 THEN 1 ELSE 0 END) AS passed,
               AVG(CASE WHEN reward >= 1 THEN 1.0 ELSE 0.0 END) AS pass_rate,
               AVG(reward) AS reward_mean, SUM(CASE WHEN reward_missing THEN 1 ELSE 0 END) AS reward_missing
        FROM trajectories GROUP BY weight_version_launch, split, task_id
        ORDER BY weight_version, split, task_id""",
    # the SWE grader's details: `flagged` (a refused change or a scan finding), `graded_reward` (what the
    # tests said) beside the reward paid (0 when a penalized flag was raised: `--reward-penalties`)
    "flagged-rewards-by-version": """
        SELECT t.weight_version_launch AS weight_version, COUNT(*) AS graded,
               SUM(CASE WHEN r.details LIKE '%"flagged":true%' THEN 1 ELSE 0 END) AS flagged,
               AVG(CASE WHEN r.details LIKE '%"flagged":true%' THEN 1.0 ELSE 0.0 END) AS flagged_rate,
               SUM(CASE WHEN r.details LIKE '%"graded_reward":1%' THEN 1 ELSE 0 END) AS tests_passed,
               SUM(CASE WHEN r.details LIKE '%"graded_reward":1%' AND r.value < 1 THEN 1 ELSE 0 END) AS penalized,
               AVG(r.value) AS reward_mean
        FROM rewards r JOIN trajectories t ON t.rollout_id = r.rollout_id AND t.attempt_id = r.attempt_id
        WHERE r.reward_fn = 'recipes.swe.grader'
        GROUP BY t.weight_version_launch ORDER BY weight_version""",
    "slowest-rollouts": """
        SELECT rollout_id, attempt_id, task_id, weight_version_launch AS weight_version, status, duration_ms,
               ARRAY_LENGTH(turns) AS turns, reward
        FROM trajectories WHERE duration_ms IS NOT NULL ORDER BY duration_ms DESC LIMIT 20""",
    # retry_count (calls) and superseded (trajectories) come with schema version 2 of the events
    "retries-by-version": """
        SELECT weight_version, COUNT(*) AS calls,
               SUM(CASE WHEN retry_count > 0 THEN 1 ELSE 0 END) AS retried_calls,
               AVG(CASE WHEN retry_count > 0 THEN 1.0 ELSE 0.0 END) AS retry_rate,
               SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END) AS failed_calls
        FROM calls GROUP BY weight_version ORDER BY weight_version""",
    "superseded-by-version": """
        SELECT weight_version_launch AS weight_version, COUNT(*) AS trajectories,
               SUM(superseded) AS superseded_calls, SUM(merge_mismatches) AS merge_mismatches,
               SUM(CASE WHEN merged THEN 0 ELSE 1 END) AS split_trajectories
        FROM trajectories GROUP BY weight_version_launch ORDER BY weight_version""",
    "pool-pauses": """
        SELECT time, model, version, server, status, pause_ms, load_ms, held_ms, error
        FROM pool WHERE type = 'pool.update' ORDER BY time""",
}

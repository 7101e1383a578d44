"""Stored trajectories a batch at a time into columns, without a pydantic model for each.

A batch is first checked against the trajectory event's shape (`schemas.shapes`, in Rust): where
every record fits, pydantic would take each as it is, so the native decoder reads the fields a
replay needs straight into columns (the ids, what the selection looks at, and for dataset rows the
sequences). A batch with a record that does not fit (`Misfit`) is decoded row by row with
pydantic, which says which records are bad and why.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import polars as pl
from agentstream_native import Decoder
from pydantic_core import PydanticUndefined

from agentstream.logs.replay import dataset
from agentstream.schemas.events import Trajectory, TrajectoryEvent
from agentstream.schemas.scan import Fetch, Record
from agentstream.schemas.shapes import shape

ROW_FIELDS = {"task_id": "str", "group_id": "str", "split": "str", "epoch": "int", "sample_index": "int",
              "model": "str", "status": "str", "reward": "float", "reward_missing": "bool"}
"""the trajectory's fields in a dataset row (dataset.rows), as the native decoder names their kinds"""
SEQUENCE = [("token_ids", ("list", "int")), ("mask", ("list", "int")), ("logprobs", ("list", "float")),
            ("weight_versions", ("list", "int")), ("prompt_length", "int"), ("turns", ("list", "int"))]


class Misfit(Exception):
    """A batch the columns cannot serve as pydantic and `dataset.rows` would: it goes row by row."""


TAKEN = ("id", "rollout_id")
"""what the check itself returns: all an export of the events needs where its selection looks at no more"""


@cache
def _decoder(rows: bool) -> Decoder:
    columns: list[tuple[str, list[str], Any]] = [
        ("id", ["id"], "str"), ("rollout_id", ["rollout_id"], "str"), ("attempt_id", ["attempt_id"], "str"),
        ("started_at", ["data", "started_at"], "int"),
        ("weight_version_launch", ["data", "weight_version_launch"], "int"),
        ("turn_versions", ["data", "turns"], ("list", ("struct", [("weight_version", "int")]))),
    ]
    if rows:
        columns += [(name, ["data", name], kind) for name, kind in ROW_FIELDS.items()]
        columns.append(("sequences_", ["data", "sequences"], ("list", ("struct", SEQUENCE))))
    return Decoder(columns)


def _defaults() -> list[pl.Expr]:
    """A key left out takes its field's default, as pydantic gives it (the shape let through no null
    where the field takes none)."""
    fields = Trajectory.model_fields
    return [pl.col(name).fill_null(fields[name].default) for name in ROW_FIELDS
            if fields[name].default not in (None, PydanticUndefined)]


def columns(batch: list[Record] | Fetch, rows: bool, fields: bool = True) -> pl.DataFrame:
    """The batch's trajectories, a row each: id, rollout_id; with `fields` or `rows` also attempt_id,
    started_at, weight_version_launch, turn_versions (each turn's weight version); with `rows` the
    dataset rows' fields and `sequences_`. Misfit if a record is not a trajectory event as pydantic reads it."""
    shaped = shape(TrajectoryEvent, take=TAKEN)
    if isinstance(batch, Fetch):
        misfits, taken = shaped.check_fetched(batch.taken)
    else:
        misfits, taken = shaped.check([record.value for record in batch])
    if misfits:
        raise Misfit(f"{len(misfits)} records do not fit, the first at {misfits[0]}")
    if not (rows or fields):
        return pl.DataFrame(dict(zip(TAKEN, taken)), schema={name: pl.String for name in TAKEN})
    decoder = _decoder(rows)
    try:
        found, _ = decoder.decode_fetched(batch.taken) if isinstance(batch, Fetch) else decoder.decode(batch)
    except ValueError as exc:
        raise Misfit(str(exc)) from None
    frame = pl.DataFrame(found)
    return frame.with_columns(_defaults()) if rows else frame


def turn_versions(frame: pl.DataFrame) -> list[list[int | None]]:
    return frame["turn_versions"].list.eval(pl.element().struct.field("weight_version")).to_list()


def dataset_rows(frame: pl.DataFrame) -> pl.DataFrame:
    """`dataset.rows` of every trajectory in `frame` (made by `columns(…, rows=True)`), in order, with the
    trajectory's row in `frame` as `index`: a row per sequence, no messages (a stored trajectory has no
    calls). The mask as Int64, as the JSON lines write it (the Parquet schema narrows it). Misfit where
    `dataset.rows` would fail: a sequence naming a turn the trajectory lacks."""
    counted = frame.with_row_index("index").with_columns(
        pl.col("sequences_").list.len().cast(pl.Int64).alias("sequences"),
        pl.col("turn_versions").list.len().cast(pl.Int64).alias("turn_count"))
    exploded = (counted.filter(pl.col("sequences") > 0)
                .with_columns(pl.int_ranges(0, pl.col("sequences"), dtype=pl.Int64).alias("sequence"))
                .explode(["sequences_", "sequence"]).unnest("sequences_"))
    last = pl.col("turns").list.last()
    if exploded.select((last.is_not_null() & ((last >= pl.col("turn_count")) | (last < -pl.col("turn_count"))))
                       .any()).item():
        raise Misfit("a sequence names a turn the trajectory lacks")
    made = {name: pl.col(name).cast(dtype) for name, dtype in dataset.SCHEMA.items()}
    made.update(trajectory_id=pl.col("id").cast(pl.String), messages=pl.lit(None, pl.String),
                mask=pl.col("mask").cast(pl.List(pl.Int64)))
    return exploded.select("index", *(expr.alias(name) for name, expr in made.items()))

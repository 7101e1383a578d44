"""A query's result as the operator asked for it: read with a live count of the records, then shown as a
table on the terminal, or written as CSV, JSON or Parquet (to the terminal, or to a file)."""

from __future__ import annotations

from pathlib import Path

import orjson
import polars as pl
from rich.console import Console

from agentstream.logs.query import run_sql
from agentstream.schemas.errors import ConfigurationError
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import Bounds, Origin, ScanProgress

FORMATS = ("table", "csv", "json", "parquet")


class QueryFailed(ConfigurationError):
    """The query itself is wrong (polars names what, in its own exception types)."""


def check_format(output_format: str, output: Path | None) -> None:
    if output_format not in FORMATS:
        raise ConfigurationError(f"unknown --format {output_format!r}: use table, csv, json or parquet")
    if output_format == "parquet" and output is None:
        raise ConfigurationError("--format parquet needs --output FILE")


async def read(settings: KafkaSettings, sql: str, bounds: Bounds, origin: Origin, console: Console) -> pl.DataFrame:
    """Run the query, counting the records read on the console while it reads."""
    with console.status("Reading the log…") as status:
        def progress(p: ScanProgress) -> None:
            status.update(f"Reading the log… {p.done:,}/{p.total:,} records")

        try:
            return await run_sql(settings, sql, bounds, on_progress=progress, origin=origin)
        except (LookupError, ValueError) as exc:
            raise ConfigurationError(str(exc)) from exc
        except Exception as exc:
            raise QueryFailed(f"query failed: {exc}") from exc


def write(result: pl.DataFrame, output_format: str, output: Path | None, console: Console) -> None:
    """The result in `output_format` (FORMATS), to `output` or the terminal."""
    if output_format == "table":
        with pl.Config(tbl_rows=50, tbl_cols=20, fmt_str_lengths=60):
            console.print(str(result)) if output is None else output.write_text(str(result))
        return
    if output_format == "parquet":
        assert output is not None  # (check_format)
        result.write_parquet(output)
    elif output_format == "csv":
        text = _nested_as_json(result).write_csv()
        output.write_text(text) if output else print(text, end="")
    else:
        text = result.write_json()
        output.write_text(text) if output else print(text)
    if output:
        console.print(f"Wrote {result.height} rows to {output}")


def _nested_as_json(frame: pl.DataFrame) -> pl.DataFrame:
    """CSV has no lists or structs: write those columns as JSON text."""
    nested = [name for name, dtype in frame.schema.items() if isinstance(dtype, (pl.List, pl.Struct))]
    return frame.with_columns(
        pl.Series(name, [orjson.dumps(v).decode() if v is not None else None for v in frame[name].to_list()])
        for name in nested
    )

"""CPU per call event to decode records into a polars frame of all columns, and where it goes.

    POLARS_MAX_THREADS=1 uv run python -m bench.decode [--events 20000]

No broker: call events as `bench.query` publishes them (200 prompt and 50 completion token ids, 50
logprobs, a short request and response), held in memory as Kafka hands them over. CPU time of this
process (all its threads), best of three, each figure against the row-by-row decoding (a dict per
record, then polars: how queries decoded first) measured in the same run. Besides the way scans
decode now (`agentstream.logs.query.decode`: one pass in Rust straight into Arrow columns, `native/`),
and its Rust pass alone, the whole-batch JSON readers of polars and pyarrow, given the schema of the
typed columns (the free-form JSON fields left out: they would still need a pass of their own):
- polars' `read_ndjson` over the batch's values joined by newlines;
- pyarrow's `read_json` (C++), where pyarrow is installed (it is not a dependency of the core).
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable

import polars as pl

from agentstream.logs.query import ENVELOPE, _decoder, _reader_schema, decode, event_row, frame, table_fields
from agentstream.schemas.scan import Record
from bench.query import call_values
from bench.report import Report


def cpu_s(fn: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def pyarrow_reader(joined: bytes, schema: dict) -> Callable[[], object] | None:
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        return None

    def arrow(dtype: pl.DataType) -> pa.DataType:
        if isinstance(dtype, pl.Struct):
            return pa.struct([(f.name, arrow(f.dtype)) for f in dtype.fields])
        if isinstance(dtype, pl.List):
            return pa.list_(arrow(dtype.inner))
        return {pl.String: pa.string(), pl.Int64: pa.int64(), pl.Float64: pa.float64(),
                pl.Boolean: pa.bool_()}[dtype.base_type()]

    options = pj.ParseOptions(explicit_schema=pa.schema([(k, arrow(v)) for k, v in schema.items()]),
                              unexpected_field_behavior="ignore")
    return lambda: pl.from_arrow(pj.read_json(io.BytesIO(joined), parse_options=options))


def main(events: int) -> None:
    records = [Record("calls", i % 4, i, 1_700_000_000_000 + i, key, value)
               for i, (key, value) in enumerate(call_values(0, events))]
    report = Report("decode")
    per_event = lambda seconds: f"{seconds / events * 1e6:.1f} µs ({events / seconds:,.0f} events/s per core)"  # noqa: E731

    rows_s = cpu_s(lambda: frame(event_row(r) for r in records))
    report.add("row by row: a dict per record, then polars (the baseline)", per_event(rows_s), 1.0)
    now_s = cpu_s(lambda: decode(records, "calls"))
    report.add("native: agentstream.logs.query.decode (scans now)", per_event(now_s), rows_s / now_s)

    # where decode's time goes
    fields = table_fields("calls")
    decoder = _decoder(tuple(n for n in ENVELOPE if n != "type"), fields)
    values = records
    report.add("  of which the Rust pass: each record parsed into Arrow columns",
               per_event(cpu_s(lambda: decoder.decode(values))), None)
    report.add("  … and into a polars frame (the Arrow C data interface)",
               per_event(cpu_s(lambda: pl.DataFrame(decoder.decode(values)[0]))), None)

    joined = b"\n".join(r.value or b"{}" for r in records)
    schema = _reader_schema([f for f in fields if not f.json], list(ENVELOPE))
    ndjson_s = cpu_s(lambda: pl.read_ndjson(io.BytesIO(joined), schema=schema))
    report.add("polars read_ndjson, typed columns only (free-form JSON not included)", per_event(ndjson_s),
               rows_s / ndjson_s)
    arrow = pyarrow_reader(joined, schema)
    if arrow is not None:
        arrow_s = cpu_s(arrow)
        report.add("pyarrow read_json, typed columns only (free-form JSON not included)", per_event(arrow_s),
                   rows_s / arrow_s)
    report.print("ratio: the row-by-row decoding's CPU time / this one's, in the same run (higher is faster)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    main(parser.parse_args().events)

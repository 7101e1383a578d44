"""A batch of JSON event records parsed straight into Arrow columns, in one pass, without the GIL (src/lib.rs)."""

from collections.abc import Sequence
from typing import Any, TypeAlias

Kind: TypeAlias = str | tuple[str, Any]
""""int", "float", "bool", "str", "json" (any JSON value, as its text), ("list", kind),
("struct", [(name, kind), ...])"""

class Columns:
    """An Arrow struct array of the columns, handed over once: `pl.DataFrame(columns)`."""

    def __arrow_c_array__(self, requested_schema: object | None = None) -> tuple[object, object]: ...

class Decoder:
    """Reads records into these columns: (name, path of keys in the record, kind); the keys at `objects`
    (paths) must hold an object or null, even where no column in them is asked."""

    def __init__(self, columns: Sequence[tuple[str, Sequence[str], Kind]],
                 objects: Sequence[Sequence[str]] = ()) -> None: ...
    def decode(self, records: Sequence[tuple[str, int, int, int, bytes | None, bytes | None]]
               ) -> tuple[Columns, list[tuple[str, list[int]]]]:
        """Records as `schemas.scan.Record` holds them (topic, partition, offset, timestamp, key, value;
        a list): the columns, then kafka_partition, kafka_offset, kafka_timestamp; and per JSON column
        the rows whose text orjson would write otherwise. Raises ValueError (naming the record and
        byte) if a record does not fit."""

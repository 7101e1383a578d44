"""A batch of JSON event records parsed straight into Arrow columns, in one pass, without the GIL (src/lib.rs)."""

from collections.abc import Sequence
from typing import Any, TypeAlias

Kind: TypeAlias = str | tuple[str, Any]
""""int", "float", "bool", "str", "json" (any JSON value, as its text), ("list", kind),
("struct", [(name, kind), ...])"""

class Columns:
    """An Arrow struct array of the columns, handed over once: `pl.DataFrame(columns)`."""

    def __arrow_c_array__(self, requested_schema: object | None = None) -> tuple[object, object]: ...

class Fetched:
    """One fetch's messages in range, as `take` kept them: their values and places in the log."""

    def __len__(self) -> int: ...

def take(messages: list[Any], ends: dict[int, int]) -> tuple[list[Any], Fetched, list[Any], dict[int, int]]:
    """Sorts one `Consumer.consume`'s confluent-kafka messages: those of a partition in `ends` (partition →
    offset to stop before) before its end kept (the list itself when all are), and as a `Fetched`; the
    messages carrying an error (a partition's end among them); per partition the offset after the last
    message kept."""

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
    def decode_fetched(self, fetched: Fetched) -> tuple[Columns, list[tuple[str, list[int]]]]:
        """Like `decode`, for what `take` kept of one fetch."""

Form: TypeAlias = str | tuple[Any, ...]
""""int", "float", "bool", "str", "any", ("range", low, high), ("literal", [texts]), ("optional", form),
("list", form), ("dict", form), ("object", [(key, form, required), ...]) (src/shapes.rs)"""

class Shape:
    """A model's shape, to check records against: never looser than pydantic's strict validation."""

    def __init__(self, form: Form, take: Sequence[str] = ()) -> None:
        """`take`: keys of the root (a str or optional str each) whose texts `check` returns."""
    def misfits(self, values: list[bytes | None]) -> list[int]:
        """The indices of the values (bytes, or None for an empty record) that do not fit."""
    def misfits_fetched(self, fetched: Fetched) -> list[int]:
        """Like `misfits`, for what `take` kept of one fetch."""
    def check(self, values: list[bytes | None]) -> tuple[list[int], list[list[str | None]]]:
        """The indices of the values that do not fit, and per key taken its text in each (None where it
        does not fit)."""
    def check_fetched(self, fetched: Fetched) -> tuple[list[int], list[list[str | None]]]:
        """Like `check`, for what `take` kept of one fetch."""

"""Bytes on the wire <-> event models, with orjson.

`decode` is strict: it raises `DecodeError` whose message names the offending field, and
`UnsupportedSchemaVersion` (a `DecodeError`) for events written by a newer agentstream, so a
consumer can deadletter them and keep going rather than guess at their meaning.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

# re-exported: consumers catch them where they decode
from agentstream.schemas.errors import DecodeError as DecodeError
from agentstream.schemas.errors import UnsupportedSchemaVersion as UnsupportedSchemaVersion
from agentstream.schemas.events import EVENT_TYPES, SCHEMA_VERSION, AnyEvent, Event, TrajectoryEvent

E = TypeVar("E", bound=Event)

_any_event: TypeAdapter[Event] = TypeAdapter(AnyEvent)
_TYPE_TAGS = frozenset(cls.model_fields["type"].default for cls in EVENT_TYPES)


def encode(event: Event) -> bytes:
    """The event as JSON: the bytes `orjson.dumps(event.model_dump())` gives, written by pydantic's own
    serializer without the dict in between (a third less time for a trajectory).

    A trajectory, the largest event and one of every few a worker or a rebuild writes, is written by
    orjson from the models' fields as they are (40 % less time than pydantic's serializer): its
    models hold only typed fields, no free-form JSON, and the values in them are what validation
    made (a float field holds a float: pydantic would write an int there as `1.0`, orjson as `1`),
    so the bytes are the same (`tests/schemas/test_schemas.py` compares them).
    """
    if type(event) is TrajectoryEvent:
        return orjson.dumps(event, default=_fields)
    return event.__pydantic_serializer__.to_json(event)


def _fields(model: object) -> dict[str, Any]:
    """A model's fields for orjson, in their order (a model without extras or excluded fields)."""
    if isinstance(model, BaseModel):
        return model.__dict__
    raise TypeError(f"{type(model).__name__} is not JSON")


def decode(raw: bytes | str, expect: type[E] | None = None) -> E:
    """Decode one event; with `expect`, also require that type.

    pydantic parses the JSON itself first (about twice as fast as orjson's dict then validating it:
    the streams worker decodes every event); an event it refuses, or one that names no schema
    version or a version not understood, is decoded again the slow way for the error that says why.
    """
    adapter = _adapter(expect) if expect else _any_event
    try:
        event = adapter.validate_json(raw, strict=True)
    except ValidationError:
        return _decode_explained(raw, adapter)  # type: ignore[return-value]
    if "schema_version" not in event.model_fields_set or not 1 <= event.schema_version <= SCHEMA_VERSION:
        return _decode_explained(raw, adapter)  # type: ignore[return-value]
    return event  # type: ignore[return-value]


def _decode_explained(raw: bytes | str, adapter: TypeAdapter[Event]) -> Event:
    """`decode` over orjson's dict: raises the DecodeError that names the offending field."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError(f"an event is a JSON object, got {type(obj).__name__}")
    _check_version(obj)
    try:
        event = adapter.validate_python(obj, strict=True)
    except ValidationError as exc:
        raise _explain(exc) from None
    return event


@cache
def _adapter(cls: type[Event]) -> TypeAdapter[Event]:
    return TypeAdapter(cls)


def _check_version(obj: dict[str, Any]) -> None:
    version = obj.get("schema_version")
    if type(version) is not int:
        raise DecodeError(f"schema_version: expected an integer, got {version!r}", "schema_version")
    if version > SCHEMA_VERSION:
        raise UnsupportedSchemaVersion(
            f"schema_version {version} is newer than this agentstream understands ({SCHEMA_VERSION}); "
            "upgrade the consumer, then replay the deadlettered events",
            "schema_version",
        )
    if version < 1:
        raise DecodeError(f"schema_version: must be at least 1, got {version}", "schema_version")


def _explain(exc: ValidationError) -> DecodeError:
    first = exc.errors(include_url=False)[0]
    loc = list(first["loc"])
    # the discriminated union puts the event type first in the location; drop it
    if loc and loc[0] in _TYPE_TAGS:
        loc = loc[1:]
    field = ".".join(str(part) for part in loc) or "type"
    message = first["msg"]
    if first["type"] == "union_tag_invalid":
        message = f"unknown event type {first['input'].get('type')!r}" if isinstance(first["input"], dict) else message
    elif first["type"] not in ("missing", "extra_forbidden"):
        message = f"{message} (got {first['input']!r:.60})"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return DecodeError(f"{field}: {message}{more}", field)

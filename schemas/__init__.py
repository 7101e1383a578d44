"""Event types, their encoding, topic names and Kafka client helpers shared by every service."""

from schemas.codec import DecodeError, UnsupportedSchemaVersion, decode, encode
from schemas.events import *  # noqa: F403
from schemas.events import EVENT_TYPES, SCHEMA_VERSION, Event
from schemas.ids import derived_id, new_id, now_ms

__all__ = ["DecodeError", "UnsupportedSchemaVersion", "decode", "encode", "EVENT_TYPES", "SCHEMA_VERSION",
           "Event", "derived_id", "new_id", "now_ms"]

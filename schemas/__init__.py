"""Event types, their encoding, topic names and Kafka client helpers shared by every service."""

from agentstream.schemas.codec import DecodeError, UnsupportedSchemaVersion, decode, encode
from agentstream.schemas.events import *  # noqa: F403
from agentstream.schemas.events import EVENT_TYPES, SCHEMA_VERSION, Event
from agentstream.schemas.ids import derived_id, new_id, now_ms

__all__ = [
           "EVENT_TYPES",
           "SCHEMA_VERSION",
           "DecodeError",
           "Event",
           "UnsupportedSchemaVersion",
           "decode",
           "derived_id",
           "encode",
           "new_id",
           "now_ms",
]

"""JSON Schema for every event type, so consumers in other languages can read the topics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentstream.schemas.events import EVENT_TYPES, SCHEMA_VERSION


def event_schemas() -> dict[str, dict[str, Any]]:
    """`{event type: JSON Schema}`; each schema also names the topic its events are written to."""
    schemas = {}
    for cls in EVENT_TYPES:
        schema = cls.model_json_schema()
        schema["$id"] = f"agentstream/v{SCHEMA_VERSION}/{cls.model_fields['type'].default}"
        schema["x-topic"] = cls.topic
        schemas[cls.model_fields["type"].default] = schema
    return schemas


def export(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in event_schemas().items():
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written

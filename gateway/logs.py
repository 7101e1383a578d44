"""Structured logs: one JSON object per line on stderr, with the fields a message is about."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiokafka logs every failed reconnect at error level; ours say what it means for calls
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("aiohttp").setLevel(max(logging.WARNING, root.level))


def fields(**values: Any) -> dict[str, Any]:
    """`log.info("message", extra=fields(upstream=url))`."""
    return {"fields": values}

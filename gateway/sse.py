"""Server-sent events, as much of them as the model APIs use: `data:` lines, blank-line separated, and
(Responses, Anthropic Messages) an `event:` line naming each event."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

DONE = b"[DONE]"


async def data_of(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data` of each event in a byte stream (multi-line data joined with newlines)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        while (end := buffer.find(b"\n\n")) >= 0:
            block, buffer = buffer[:end], buffer[end + 2:]
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                yield b"\n".join(data)
    if buffer.strip():
        data = [line[5:].removeprefix(b" ") for line in buffer.split(b"\n") if line.startswith(b"data:")]
        if data:
            yield b"\n".join(data)


def event(payload: dict[str, Any], name: str | None = None) -> bytes:
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data


DONE_EVENT = b"data: [DONE]\n\n"

"""Reading the upstream's answer: whole, or as a stream forwarded chunk by chunk (`Relay`), and the 502s
for what it gets wrong."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from agentstream.gateway import sse
from agentstream.gateway.adapter import StreamAssembler
from agentstream.gateway.call_record import CallRecord
from agentstream.gateway.errors import ErrorCode, GatewayError, UpstreamFailed
from agentstream.gateway.pool import Lease

TRANSPORT = (aiohttp.ClientError, TimeoutError)
"""what fails under a request once the upstream has it"""


def describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def body_of(response: aiohttp.ClientResponse, lease: Lease) -> bytes:
    """The whole answer; the lease and the connection are let go either way."""
    try:
        return await response.read()
    finally:
        lease.close()
        response.release()


def json_of(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def unusable(url: str, raw: bytes, what: str = "a body") -> UpstreamFailed:
    """The 502 for an upstream answer that is no JSON object, naming why (non-finite numbers: a code of their own)."""
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if any(word in raw for word in (b"NaN", b"Infinity")) or "infinity" in str(exc).lower():
            return UpstreamFailed(f"upstream {url} answered with {what} holding a number that is not finite (NaN or "
                                  f"Infinity), which no event can carry: {exc}", ErrorCode.UPSTREAM_NON_FINITE)
        return UpstreamFailed(f"upstream {url} answered with {what} that is not JSON: {exc}")
    return UpstreamFailed(f"upstream {url} answered with {what} that is not a JSON object")


def error_message(payload: Any, raw: bytes) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return raw[:2000].decode("utf-8", "replace")



class ClosingStream(StreamingResponse):
    """A StreamingResponse that always closes its iterator, so a call cut short is still recorded."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # an async generator, always



class Relay:
    """Forwards a stream chunk by chunk; in `ack` mode keeps its end back until the call is recorded."""

    def __init__(self, call: CallRecord, assembler: StreamAssembler, durable: bool):
        self.call = call
        self.assembler = assembler
        self.durable = durable
        self.tail: list[bytes] = []
        self.ttft_ms: float | None = None
        self.error: GatewayError | None = None

    async def forward(self, response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        url = self.call.upstream_url
        done = False
        try:
            async for data in sse.data_of(response.content.iter_any()):
                if data == sse.DONE:
                    done = True
                    self.tail += self.assembler.close()
                    break
                try:
                    chunk = orjson.loads(data)
                except orjson.JSONDecodeError:
                    self.error = unusable(url, data, "a stream event")
                    return
                if not isinstance(chunk, dict) or (chunk.get("error") is not None and "choices" not in chunk):
                    self.error = UpstreamFailed(f"upstream {url} failed mid-stream: {error_message(chunk, data)}")
                    return
                try:
                    lines = self.assembler.lines(chunk)
                except GatewayError as error:
                    self.error = error
                    return
                if self.ttft_ms is None and self.assembler.tokens_seen:
                    self.ttft_ms = round(self.call.elapsed_ms, 3)
                if self.durable and self.assembler.finished:
                    self.tail += lines
                else:
                    for line in lines:
                        yield line
        except TRANSPORT as exc:
            self.error = UpstreamFailed(f"upstream {url} failed mid-stream: {describe(exc)}")
            return
        if not done:
            self.error = UpstreamFailed(f"upstream {url} ended the stream before [DONE]")

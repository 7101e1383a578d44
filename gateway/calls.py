"""Serving one model call: admit, route, forward, capture, record, answer.

Every call becomes exactly one `call` event, failed ones included (bad JSON, unknown model,
upstream errors, a hold that lasted too long). In `ack` durability the agent gets the end of its
response (the whole body, or a stream's last chunk and closing events, e.g. `[DONE]`) only after
Kafka acknowledged the event; if Kafka does not, it gets a 503 (or, mid-stream, an error event) instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from starlette.requests import Request
from starlette.datastructures import Headers
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from schemas.events import Call, CallEvent
from schemas.ids import new_id, now_ms

from gateway import sse
from gateway.auth import Attribution
from gateway.adapter import Adapter, Body, Rewrite, StreamAssembler, Tokens
from gateway.errors import BadRequest, ErrorCode, GatewayError, UpstreamFailed
from gateway.fields import model_of
from gateway.logs import fields
from gateway.messages import Messages
from gateway.metrics import Metrics
from gateway.pool import Lease, Pool, Upstream, no_server
from gateway.recorder import Recorder

log = logging.getLogger("gateway.calls")

CALL_ID_HEADER = "x-agentstream-call-id"
RETRY_HEADERS = ("x-stainless-retry-count", "x-retry-count")
"""where SDKs say which retry a request is (OpenAI's and Anthropic's SDKs: the first; some others: the second)"""
_SECRET_FIELDS = frozenset({"api_key", "apikey", "authorization", "password", "secret", "access_token"})
_NO_TOKENS = Tokens()
# the upstream never took the request
_REFUSED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# the connection closed under the request: a kept-alive one the server had just dropped, or a server that died
_DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_UNREACHABLE = _REFUSED + _DROPPED  # another server may take the request
_TRANSPORT = (aiohttp.ClientError, TimeoutError)


@dataclass
class _Call:
    """What is known about one call so far; becomes its event."""

    adapter: Adapter
    attribution: Attribution
    id: str = field(default_factory=new_id)
    started_at: int = field(default_factory=now_ms)
    t0: float = field(default_factory=time.perf_counter)
    body: dict[str, Any] | None = None
    model: str = ""
    streamed: bool = False
    upstream: Upstream | None = None
    weight_version: int | None = None
    retry_count: int | None = None

    @property
    def upstream_url(self) -> str:
        return self.upstream.url if self.upstream else "(none)"

    @property
    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000

    def event(self, source: str, status: int, *, response: Body | None = None, tokens: Tokens = _NO_TOKENS,
              error: str | None = None, ttft_ms: float | None = None) -> CallEvent:
        data = Call(
            api=self.adapter.api, model=self.model, upstream=self.upstream.url if self.upstream else None,
            weight_version=self.weight_version, streamed=self.streamed, session_id=self.attribution.session_id,
            request=_redacted(self.body or {}), response=response,
            prompt_token_ids=tokens.prompt_token_ids, completion_token_ids=tokens.completion_token_ids,
            logprobs=tokens.logprobs, finish_reason=tokens.finish_reason, extra_choices=tokens.extra_choices,
            usage=tokens.usage, status=status, error=error, started_at=self.started_at,
            latency_ms=round(self.elapsed_ms, 3), ttft_ms=ttft_ms, retry_count=self.retry_count,
        )
        return CallEvent(id=self.id, source=source, rollout_id=self.attribution.rollout_id,
                         attempt_id=self.attribution.attempt_id, data=data)


def _retry_count(headers: Headers) -> int | None:
    """The SDK's retry number of this request, if it says (a retry is not a new turn of the agent)."""
    for name in RETRY_HEADERS:
        value = headers.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _redacted(body: dict[str, Any]) -> dict[str, Any]:
    if _SECRET_FIELDS.isdisjoint(body):
        return body
    return {key: value for key, value in body.items() if key not in _SECRET_FIELDS}


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _body_of(response: aiohttp.ClientResponse, lease: Lease) -> bytes:
    """The whole answer; the lease and the connection are let go either way."""
    try:
        return await response.read()
    finally:
        lease.close()
        response.release()


def _json_of(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _unusable(url: str, raw: bytes, what: str = "a body") -> UpstreamFailed:
    """The 502 for an upstream answer that is no JSON object, naming why (non-finite numbers have a code of their own)."""
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if any(word in raw for word in (b"NaN", b"Infinity")) or "infinity" in str(exc).lower():
            return UpstreamFailed(f"upstream {url} answered with {what} holding a number that is not finite (NaN or "
                                  f"Infinity), which no event can carry: {exc}", ErrorCode.UPSTREAM_NON_FINITE)
        return UpstreamFailed(f"upstream {url} answered with {what} that is not JSON: {exc}")
    return UpstreamFailed(f"upstream {url} answered with {what} that is not a JSON object")


def _error_message(payload: Any, raw: bytes) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return raw[:2000].decode("utf-8", "replace")


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that always closes its iterator, so a call cut short is still recorded."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # an async generator, always


@dataclass(frozen=True)
class CallOptions:
    """How calls are served: the gateway settings `Calls` reads, and nothing else."""

    training: bool
    source: str
    upstream_api_key: str = ""
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0
    refused_fields: frozenset[str] = frozenset()
    access_log: bool = False


class Calls:
    def __init__(self, options: CallOptions, pool: Pool, recorder: Recorder, metrics: Metrics,
                 http: aiohttp.ClientSession):
        self.pool = pool
        self.recorder = recorder
        self.metrics = metrics
        self.http = http
        self.training = options.training
        self.source = options.source
        self.access_log = options.access_log
        self.refused = options.refused_fields
        self.headers = {"content-type": "application/json"}
        if options.upstream_api_key:
            self.headers["authorization"] = f"Bearer {options.upstream_api_key}"
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=options.connect_timeout_s,
                                             sock_read=options.upstream_timeout_s)

    async def serve(self, request: Request, adapter: Adapter, attribution: Attribution) -> Response:
        call = _Call(adapter, attribution, retry_count=_retry_count(request.headers))
        try:
            body = self._parse(call, await request.body())
            adapter.check(body)  # a bad field is the agent's error: a 400 before anything goes upstream
            rewrite = adapter.rewrite(body, self.training)
            # before the upstream generates anything: a call that cannot be recorded is not served
            self.recorder.check_available()
            await self.pool.admit(call.model)
            response, lease = await self._send(call, rewrite.body, adapter.upstream_path)
        except GatewayError as error:
            return await self._fail(call, error)
        if response.status >= 400:
            return await self._relay_error(call, response, lease)
        if rewrite.stream:
            return _ClosingStream(self._stream(call, rewrite, response, lease), media_type="text/event-stream",
                                  headers={CALL_ID_HEADER: call.id, "cache-control": "no-cache"})
        return await self._relay_body(call, rewrite, response, lease)

    async def count_tokens(self, request: Request, adapter: Messages, attribution: Attribution) -> Response:
        """Anthropic's `messages.count_tokens`: the length of the prompt a `/v1/messages` call with this body
        renders, by the upstream's /tokenize. It generates nothing, so it is no call event."""
        call = _Call(adapter, attribution, retry_count=_retry_count(request.headers))
        try:
            body = self._parse(call, await request.body())
            response, lease = await self._send(call, adapter.tokenize_request(body), "/tokenize")
            try:
                raw = await _body_of(response, lease)
            except _TRANSPORT as exc:
                raise UpstreamFailed(f"upstream {call.upstream_url} failed while answering: {_describe(exc)}") from None
            payload = _json_of(raw)
            if response.status >= 400:
                return Response(adapter.relay_error(response.status, raw, _error_message(payload, raw)),
                                response.status, media_type="application/json")
            counted = adapter.count_tokens_response(payload if isinstance(payload, dict) else {})
        except GatewayError as error:
            return adapter.error_response(error)
        return Response(orjson.dumps(counted), media_type="application/json")

    # --- request ----------------------------------------------------------------------------

    def _parse(self, call: _Call, raw: bytes) -> Body:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            call.body = {"unparsed": raw[:4096].decode("utf-8", "replace")}
            raise BadRequest(f"the request body is not valid JSON: {exc}", ErrorCode.INVALID_JSON) from None
        if not isinstance(body, dict):
            call.body = {"unparsed": raw[:4096].decode("utf-8", "replace")}
            raise BadRequest(f"the request body must be a JSON object, not {type(body).__name__}")
        call.body = body
        call.streamed = body.get("stream") is True
        call.model = model_of(body)
        for name in self.refused.intersection(body):
            raise BadRequest(f"'{name}' is refused by this gateway: the inference pool cannot take it (see the "
                             "gateway's --refused-fields; for 'seed': vLLM-CPU's engine dies on a seeded request "
                             "whose prompt is prefilled in chunks, which would fail every agent's calls); send the "
                             "request without it", ErrorCode.REFUSED_FIELD)
        return body

    async def _send(self, call: _Call, body: dict[str, Any], path: str) -> tuple[aiohttp.ClientResponse, Lease]:
        """Send to the first server that takes the request; fail over only when one never got it."""
        content = orjson.dumps(body)
        tried: list[str] = []
        for upstream in self.pool.candidates(call.model, call.attribution.rollout_id or call.attribution.session_id):
            if tried:
                await self.pool.admit(call.model)  # a hold may have begun while the last server failed
            try:
                return await self._post(call, upstream, path, content)
            except _UNREACHABLE as exc:
                self.pool.mark_down(upstream, _describe(exc))
                self.metrics.failovers.labels(upstream.url).inc()
                tried.append(f"{upstream.url} ({_describe(exc)})")
            except _TRANSPORT as exc:
                raise UpstreamFailed(f"upstream {upstream.url} failed: {_describe(exc)}") from None
        if not tried:
            raise no_server(call.model, self.pool.models())
        raise UpstreamFailed(f"no upstream serving {call.model!r} could be reached: {'; '.join(tried)}",
                             ErrorCode.UPSTREAM_UNREACHABLE)

    async def _post(self, call: _Call, upstream: Upstream, path: str,
                    content: bytes) -> tuple[aiohttp.ClientResponse, Lease]:
        try:
            return await self._post_once(call, upstream, path, content)
        except _DROPPED as exc:
            if isinstance(exc, _REFUSED):
                raise
            # most often a kept-alive connection the server closed just then: once more, on a new one
            return await self._post_once(call, upstream, path, content)

    async def _post_once(self, call: _Call, upstream: Upstream, path: str,
                         content: bytes) -> tuple[aiohttp.ClientResponse, Lease]:
        lease = self.pool.lease(call.model, upstream)  # counted from now, so a weight update waits for it
        call.upstream, call.weight_version = upstream, upstream.weight_version
        try:
            response = await self.http.post(upstream.endpoint(path), data=content,
                                            headers=self.headers, timeout=self.timeout)
        except BaseException:
            lease.close()
            raise
        return response, lease

    # --- answers ----------------------------------------------------------------------------

    async def _relay_body(self, call: _Call, rewrite: Rewrite, response: aiohttp.ClientResponse,
                          lease: Lease) -> Response:
        url = call.upstream_url
        try:
            raw = await _body_of(response, lease)
        except _TRANSPORT as exc:
            return await self._fail(call, UpstreamFailed(f"upstream {url} failed while answering: "
                                                            f"{_describe(exc)}"))
        payload = _json_of(raw)
        if not isinstance(payload, dict):
            return await self._fail(call, _unusable(url, raw))
        try:
            tokens = call.adapter.finish(payload, rewrite)
        except GatewayError as error:  # e.g. a logprob no event can carry: the call fails, nothing broken is recorded
            return await self._fail(call, error)
        content = orjson.dumps(payload)
        try:
            await self.recorder.record(call.event(self.source, 200, response=payload, tokens=tokens))
        except GatewayError as error:
            return self._answer(call, error.status, call.adapter.error_response(error))
        return self._answer(call, 200, Response(content, 200, media_type="application/json",
                                                headers={CALL_ID_HEADER: call.id}))

    async def _relay_error(self, call: _Call, response: aiohttp.ClientResponse, lease: Lease) -> Response:
        """An upstream error goes to the agent as it is (status and body), and into the log."""
        try:
            raw = await _body_of(response, lease)
        except _TRANSPORT:
            raw = b""
        payload = _json_of(raw)
        status = response.status
        message = f"upstream {call.upstream_url} answered {status}: {_error_message(payload, raw)}"
        relayed = call.adapter.relay_error(status, raw, _error_message(payload, raw))
        if relayed is not raw:  # translated into the API's own error shape: that is what the agent got
            payload = orjson.loads(relayed)
        event = call.event(self.source, status, response=payload if isinstance(payload, dict) else None, error=message)
        try:
            await self.recorder.record(event)
        except GatewayError as error:
            return self._answer(call, error.status, call.adapter.error_response(error))
        headers = {CALL_ID_HEADER: call.id}
        media_type = response.headers.get("content-type", "application/json") if relayed is raw else "application/json"
        return self._answer(call, status, Response(relayed, status, headers=headers, media_type=media_type))

    async def _fail(self, call: _Call, error: GatewayError) -> Response:
        """A call the gateway itself refused or could not complete: recorded, then answered."""
        if error.code != "kafka_unavailable":
            try:
                await self.recorder.record(call.event(self.source, error.status, error=error.message))
            except GatewayError as kafka:
                error = kafka
        response = call.adapter.error_response(error)
        response.headers[CALL_ID_HEADER] = call.id
        return self._answer(call, error.status, response)

    def _answer(self, call: _Call, status: int, response: Response) -> Response:
        self._observe(call, status)
        return response

    def _observe(self, call: _Call, status: int, ttft_ms: float | None = None) -> None:
        elapsed = call.elapsed_ms
        self.metrics.requests.labels(call.adapter.api, str(status)).inc()
        self.metrics.latency.labels(call.adapter.api, "true" if call.streamed else "false").observe(elapsed / 1000)
        if ttft_ms is not None:
            self.metrics.ttft.labels(call.adapter.api).observe(ttft_ms / 1000)
        if self.access_log:
            log.info("call", extra=fields(
                call_id=call.id, api=call.adapter.api, model=call.model, status=status, streamed=call.streamed,
                latency_ms=round(elapsed, 2), upstream=call.upstream.url if call.upstream else None,
                rollout_id=call.attribution.rollout_id, attempt_id=call.attribution.attempt_id))

    # --- streams ----------------------------------------------------------------------------

    async def _stream(self, call: _Call, rewrite: Rewrite, response: aiohttp.ClientResponse, lease: Lease) -> AsyncIterator[bytes]:
        assembler = call.adapter.assembler(rewrite)
        relay = _Relay(call, assembler, durable=self.recorder.durable)
        try:
            async for line in relay.forward(response):
                yield line
        except BaseException:
            # the agent went away (or the server is stopping): record what it got, off this cancelled task
            lease.close()
            response.close()  # the upstream sees the connection go and stops generating
            self.recorder.record_later(call.event(
                self.source, 499, response=assembler.response(), tokens=assembler.tokens(), ttft_ms=relay.ttft_ms,
                error="the agent disconnected before the end of the stream"))
            self._observe(call, 499, relay.ttft_ms)
            raise
        lease.close()
        response.release() if relay.error is None else response.close()
        error = relay.error
        event = call.event(self.source, error.status if error else 200, response=assembler.response(),
                           tokens=assembler.tokens(), ttft_ms=relay.ttft_ms, error=error.message if error else None)
        try:
            await self.recorder.record(event)
        except GatewayError as kafka:
            error = error or kafka
        if error:
            self._observe(call, error.status, relay.ttft_ms)
            for line in assembler.error_lines(error):
                yield line
            return
        self._observe(call, 200, relay.ttft_ms)
        for line in relay.tail:  # the stream's end: its last chunks (in ack mode) and closing events
            yield line


class _Relay:
    """Forwards a stream chunk by chunk; in `ack` mode keeps its end back until the call is recorded."""

    def __init__(self, call: _Call, assembler: StreamAssembler, durable: bool):
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
                    self.error = _unusable(url, data, "a stream event")
                    return
                if not isinstance(chunk, dict) or (chunk.get("error") is not None and "choices" not in chunk):
                    self.error = UpstreamFailed(f"upstream {url} failed mid-stream: {_error_message(chunk, data)}")
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
        except _TRANSPORT as exc:
            self.error = UpstreamFailed(f"upstream {url} failed mid-stream: {_describe(exc)}")
            return
        if not done:
            self.error = UpstreamFailed(f"upstream {url} ended the stream before [DONE]")

"""Serving one model call: admit, route, forward, capture, record, answer.

Every call becomes exactly one `call` event, failed ones included (bad JSON, unknown model,
upstream errors, a hold that lasted too long). In `ack` durability the agent gets the end of its
response (the whole body, or a stream's last chunk and closing events, e.g. `[DONE]`) only after
Kafka acknowledged the event; if Kafka does not, it gets a 503 (or, mid-stream, an error event) instead.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response

from agentstream.gateway.adapter import Adapter, Body, Rewrite
from agentstream.gateway.auth import Attribution
from agentstream.gateway.call_record import CallRecord, retry_count_of
from agentstream.gateway.errors import BadRequest, ErrorCode, GatewayError, UpstreamFailed
from agentstream.gateway.fields import model_of
from agentstream.gateway.logs import fields
from agentstream.gateway.lora import TenantAdapter
from agentstream.gateway.messages import Messages
from agentstream.gateway.metrics import Metrics
from agentstream.gateway.pool import Lease, Pool, Upstream, no_server
from agentstream.gateway.recorder import Recorder
from agentstream.gateway.relay import (
    TRANSPORT,
    ClosingStream,
    Relay,
    body_of,
    describe,
    error_message,
    json_of,
    unusable,
)

log = logging.getLogger("gateway.calls")

CALL_ID_HEADER = "x-agentstream-call-id"

REFUSED_BECAUSE = {
    "seed": ": vLLM-CPU's engine dies on a seeded request whose prompt is prefilled in chunks, which would fail "
            "every agent's calls",
    "vllm_xargs": ": it carries vLLM's extension arguments, such as `forced_answer`, which would record a text the "
                  "agent chose as the model's answer; only a gateway recording demonstrations takes it",
}
"""why a field is refused by default, said in its 400"""

# the upstream never took the request
_REFUSED = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# the connection closed under the request: a kept-alive one the server had just dropped, or a server that died
_DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_UNREACHABLE = _REFUSED + _DROPPED  # another server may take the request


@dataclass(frozen=True)
class CallOptions:
    """How calls are served: the gateway settings `Calls` reads, and nothing else."""

    training: bool
    source: str
    upstream_api_key: str = ""
    provider_api_key: str = ""
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0
    refused_fields: frozenset[str] = frozenset()
    access_log: bool = False
    partial_rollouts: bool = False
    """streamed calls go on across a weight update, their tokens counted as they pass (`gateway/pool.py`)"""


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
        # the switch is found by counting token ids, which only training mode asks for; an adapter's call is not
        # paused by an update of its base
        self.follow_streams = options.partial_rollouts and options.training
        self.refused = options.refused_fields
        # each key goes to its own servers only: a provider's key never reaches this platform's servers, nor theirs it
        self.headers = _headers(options.upstream_api_key)
        self.provider_headers = _headers(options.provider_api_key)
        self.provider_key = options.provider_api_key.encode()
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=options.connect_timeout_s,
                                             sock_read=options.upstream_timeout_s)

    async def serve(self, request: Request, adapter: Adapter, attribution: Attribution) -> Response:
        """Serve one call; a tenant's goes to its current adapter (`gateway/lora.py`), if it has one."""
        call = CallRecord(adapter, attribution, retry_count=retry_count_of(request.headers))
        try:
            body = self._parse(call, await request.body())
            adapter.check(body)  # a bad field is the agent's error: a 400 before anything goes upstream
            # a provider's answer has no token ids, and asking it for them would be refused as an unknown field
            rewrite = adapter.rewrite(body, self.training and not self.pool.provided(call.model))
            # before the upstream generates anything: a call that cannot be recorded is not served
            self.recorder.check_available()
            await self.pool.admit(call.model)
            if attribution.tenant is not None:  # a new adapter holds no one: calls go on to the version they find
                call.lora = self.pool.adapters.current(call.model, attribution.tenant,
                                                       attribution.rollout_id or attribution.session_id)
            response, lease = await self._send(call, rewrite.body, adapter.upstream_path)
        except GatewayError as error:
            return await self._fail(call, error)
        if response.status >= 400:
            return await self._relay_error(call, response, lease)
        if rewrite.stream:
            return ClosingStream(self._stream(call, rewrite, response, lease), media_type="text/event-stream",
                                  headers={CALL_ID_HEADER: call.id, "cache-control": "no-cache"})
        return await self._relay_body(call, rewrite, response, lease)

    async def count_tokens(self, request: Request, adapter: Messages, attribution: Attribution) -> Response:
        """Anthropic's `messages.count_tokens`: the length of the prompt a `/v1/messages` call with this body
        renders, by the upstream's /tokenize. It generates nothing, so it is no call event."""
        call = CallRecord(adapter, attribution, retry_count=retry_count_of(request.headers))
        try:
            body = self._parse(call, await request.body())
            response, lease = await self._send(call, adapter.tokenize_request(body), "/tokenize")
            try:
                raw = await body_of(response, lease)
            except TRANSPORT as exc:
                raise UpstreamFailed(f"upstream {call.upstream_url} failed while answering: {describe(exc)}") from None
            payload = json_of(raw)
            if response.status >= 400:
                return Response(adapter.relay_error(response.status, raw, error_message(payload, raw)),
                                response.status, media_type="application/json")
            counted = adapter.count_tokens_response(payload if isinstance(payload, dict) else {})
        except GatewayError as error:
            return adapter.error_response(error)
        return Response(orjson.dumps(counted), media_type="application/json")

    # --- request ----------------------------------------------------------------------------

    def _parse(self, call: CallRecord, raw: bytes) -> Body:
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
            why = REFUSED_BECAUSE.get(name, "")
            raise BadRequest(f"'{name}' is refused by this gateway (its --refused-fields){why}; send the request "
                             "without it", ErrorCode.REFUSED_FIELD)
        return body

    async def _send(self, call: CallRecord, body: Body, path: str) -> tuple[aiohttp.ClientResponse, Lease]:
        """Send to the first server that takes the request; fail over only when one never got it."""
        lora = call.lora
        content = orjson.dumps({**body, "model": lora.name} if lora else body)
        tried: list[str] = []
        for upstream in self.pool.candidates(call.model, call.attribution.rollout_id or call.attribution.session_id,
                                             lora):
            if tried:
                await self.pool.admit(call.model)  # a hold may have begun while the last server failed
            try:
                if lora:  # loaded back on demand where it was unloaded (least recently used) or never loaded
                    return await self._post_adapter(call, upstream, path, content, lora)
                return await self._post(call, upstream, path, content)
            except _UNREACHABLE as exc:
                self.pool.mark_down(upstream, describe(exc))
                self.metrics.failovers.labels(upstream.url).inc()
                tried.append(f"{upstream.url} ({describe(exc)})")
            except TRANSPORT as exc:
                raise UpstreamFailed(f"upstream {upstream.url} failed: {describe(exc)}") from None
        if not tried:
            raise no_server(call.model, self.pool.models())
        raise UpstreamFailed(f"no upstream serving {call.model!r} could be reached: {'; '.join(tried)}",
                             ErrorCode.UPSTREAM_UNREACHABLE)

    async def _post_adapter(self, call: CallRecord, upstream: Upstream, path: str, content: bytes,
                            lora: TenantAdapter) -> tuple[aiohttp.ClientResponse, Lease]:
        """Send a tenant's call to its adapter; a 404 means the server no longer holds it (another replica unloaded
        it, at its bound or after a swap): loaded again, and the call sent once more."""
        await self.pool.adapters.ensure(upstream.url, lora)
        response, lease = await self._post(call, upstream, path, content)
        if response.status != 404:
            return response, lease
        lease.close()
        response.release()
        self.pool.adapters.forget(upstream.url, lora)
        await self.pool.adapters.ensure(upstream.url, lora)
        return await self._post(call, upstream, path, content)

    async def _post(self, call: CallRecord, upstream: Upstream, path: str,
                    content: bytes) -> tuple[aiohttp.ClientResponse, Lease]:
        try:
            return await self._post_once(call, upstream, path, content)
        except _DROPPED as exc:
            if isinstance(exc, _REFUSED):
                raise
            # most often a kept-alive connection the server closed just then: once more, on a new one
            return await self._post_once(call, upstream, path, content)

    async def _post_once(self, call: CallRecord, upstream: Upstream, path: str,
                         content: bytes) -> tuple[aiohttp.ClientResponse, Lease]:
        lease = self.pool.lease(call.served_model, upstream)  # counted from now, so a weight update waits for it
        call.upstream, call.weight_version = upstream, upstream.weight_version
        try:
            response = await self.http.post(upstream.endpoint(path), data=content,
                                            headers=self.provider_headers if upstream.provider else self.headers,
                                            timeout=self.timeout)
        except BaseException:
            lease.close()
            raise
        return response, lease

    # --- answers ----------------------------------------------------------------------------

    async def _relay_body(self, call: CallRecord, rewrite: Rewrite, response: aiohttp.ClientResponse,
                          lease: Lease) -> Response:
        url = call.upstream_url
        try:
            raw = await body_of(response, lease)
        except TRANSPORT as exc:
            return await self._fail(call, UpstreamFailed(f"upstream {url} failed while answering: "
                                                            f"{describe(exc)}"))
        payload = json_of(raw)
        if not isinstance(payload, dict):
            return await self._fail(call, unusable(url, raw))
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

    async def _relay_error(self, call: CallRecord, response: aiohttp.ClientResponse, lease: Lease) -> Response:
        """An upstream error goes to the agent as it is (status and body), and into the log."""
        try:
            raw = await body_of(response, lease)
        except TRANSPORT:
            raw = b""
        if call.upstream is not None and call.upstream.provider and self.provider_key:
            # a provider's 401 may quote the key it was sent: neither the agent nor the log gets it
            raw = raw.replace(self.provider_key, b"[the provider key]")
        payload = json_of(raw)
        status = response.status
        message = f"upstream {call.upstream_url} answered {status}: {error_message(payload, raw)}"
        relayed = call.adapter.relay_error(status, raw, error_message(payload, raw))
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

    async def _fail(self, call: CallRecord, error: GatewayError) -> Response:
        """A call the gateway itself refused or could not complete: recorded, then answered."""
        if error.code != "kafka_unavailable":
            try:
                await self.recorder.record(call.event(self.source, error.status, error=error.message))
            except GatewayError as kafka:
                error = kafka
        response = call.adapter.error_response(error)
        response.headers[CALL_ID_HEADER] = call.id
        return self._answer(call, error.status, response)

    def _answer(self, call: CallRecord, status: int, response: Response) -> Response:
        self._observe(call, status)
        return response

    def _observe(self, call: CallRecord, status: int, ttft_ms: float | None = None) -> None:
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

    async def _stream(self, call: CallRecord, rewrite: Rewrite, response: aiohttp.ClientResponse,
                      lease: Lease) -> AsyncIterator[bytes]:
        assembler = call.adapter.assembler(rewrite)
        relay = Relay(call, assembler, durable=self.recorder.durable)
        if self.follow_streams and call.lora is None:
            call.generated = assembler.generated
            lease.follow(call)
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


def _headers(key: str) -> dict[str, str]:
    return {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}

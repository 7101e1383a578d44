"""The gateway's HTTP surface: model calls (OpenAI chat completions, completions and Responses; Anthropic
Messages, and its count_tokens), rewards, rollout ends, operations.

Model calls are served at `/v1/...` (attributed by the rollout token, or by the
`x-agentstream-rollout-id`/`-attempt-id` headers, else recorded as session traffic) and at the
rollout-scoped base URL `/rollouts/{rollout_id}/attempts/{attempt_id}/v1/...`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from schemas.events import (Reward, RewardEvent, RolloutDiff, RolloutDiffEvent, RolloutFinished, RolloutFinishedEvent,
                            TurnReward)
from schemas.kafka import ensure_topics

from gateway.auth import (ATTEMPT_HEADER, ROLLOUT_HEADER, SESSION_HEADER, Attribution, Authenticator, Principal,
                          auth_headers)
from gateway.calls import Calls
from gateway.adapters import ADAPTERS
from gateway.errors import GatewayError, error_body
from gateway.logs import fields
from gateway.metrics import Metrics
from gateway.pool import Pool, parse_upstreams
from gateway.pool_sync import PoolSync
from gateway.recorder import Recorder
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway")


class Gateway:
    """The parts of one gateway process, made and started together in the server's event loop."""

    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.metrics = Metrics()
        self.auth = Authenticator(settings.keys, settings.token_secret.get_secret_value(), settings.allow_anonymous)
        self.upstreams = parse_upstreams(settings.upstreams)
        self.recorder = Recorder(settings, self.metrics, durable=settings.durability == "ack",
                                 timeout_s=settings.publish_timeout_s, linger_ms=settings.publish_linger_ms)
        self.http: aiohttp.ClientSession | None = None
        self.pool: Pool | None = None
        self.calls: Calls | None = None
        self.sync: PoolSync | None = None
        self._health: asyncio.Task | None = None

    async def start(self) -> None:
        problem = settings_problem(self.settings)
        if problem:
            raise RuntimeError(problem)
        settings = self.settings
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
            limit=0, limit_per_host=settings.max_connections,
            # below the usual 5 s of servers, so a connection is not reused just as the server drops it
            keepalive_timeout=4.0))
        self.pool = Pool(self.upstreams, self.http, self.metrics, initial_version=settings.initial_weight_version,
                         hold_timeout_s=settings.hold_timeout_s, hold_max_s=settings.hold_max_s)
        self.calls = Calls(settings, self.pool, self.recorder, self.metrics, self.http)
        if not self.pool.upstreams:
            log.warning("no upstreams configured (--upstreams MODEL=URL): every model call will get a 404")
        if settings.create_topics:
            await self._ensure_topics()
        await self.recorder.start()
        await self.pool.check_all()
        self._health = asyncio.create_task(self.pool.run_health_checks(settings.health_interval_s))
        if settings.pool_sync:
            self.sync = PoolSync(settings, self.pool, self.recorder, self.metrics, self.http)
            await self.sync.start()
        # the long-lived objects of imports and set-up need no more garbage collection: without them in the
        # collector's way, its full passes stop showing up as tail latency
        gc.freeze()
        log.info("gateway ready", extra=fields(
            mode=settings.mode, durability=settings.durability, upstreams=self.pool.describe(),
            topic_prefix=settings.topic_prefix, replica_id=settings.replica_id))

    async def _ensure_topics(self) -> None:
        try:
            report = await asyncio.wait_for(ensure_topics(self.settings), 20)
        except Exception as exc:  # Kafka down at startup: the recorder keeps trying, calls get 503 meanwhile
            log.warning("could not check topics", extra=fields(problem=f"{type(exc).__name__}: {exc}"))
            return
        for problem in report.mismatches:
            log.warning("topic differs from its spec", extra=fields(problem=problem))

    async def stop(self) -> None:
        if self.sync:
            await self.sync.stop()
        if self._health:
            self._health.cancel()
        await self.recorder.stop()
        if self.http:
            await self.http.close()

    def attribution(self, request: Request, rollout_id: str | None = None, attempt_id: str | None = None,
                    principal: Principal | None = None) -> Attribution:
        """Who the request is for, from the URL, else the headers, else the rollout token; 401/403 if not allowed."""
        headers = auth_headers(request.scope)
        return self.auth.attribute(principal or self.auth.principal(headers),
                                   rollout_id or headers.get(ROLLOUT_HEADER), attempt_id or headers.get(ATTEMPT_HEADER),
                                   headers.get(SESSION_HEADER))


def settings_problem(settings: GatewaySettings) -> str | None:
    """Why these settings cannot run a gateway, with the fix; None if they can."""
    if not (settings.keys or settings.token_secret.get_secret_value() or settings.allow_anonymous):
        return ("the gateway has no way to authenticate agents: set AGENTSTREAM_API_KEYS (operator keys), "
                "AGENTSTREAM_TOKEN_SECRET (rollout tokens), or --allow-anonymous for local experiments")
    try:
        parse_upstreams(settings.upstreams)
    except ValueError as exc:
        return str(exc)
    return None


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: float
    turns: list[TurnReward] = Field(default_factory=list)
    details: dict[str, Any] = Field(default_factory=dict)
    attempt_id: str | None = None


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exit_code: int | None = None
    duration_ms: int | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    attempt_id: str | None = None


class DiffBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instance_id: str
    base_commit: str
    diff: str
    outcome: str | None = Field(None, min_length=1, max_length=64)
    details: dict[str, Any] = Field(default_factory=dict)


MAX_DIFF_BYTES = 512 * 1024
"""a longer diff is cut to this and marked truncated (a grader scores it 0): one event fits a Kafka record"""
MAX_DIFF_BODY_BYTES = 8 * MAX_DIFF_BYTES
"""a body larger than this is refused (413) unread"""


async def _limited_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 once it passes `limit` bytes (without reading the rest)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"the body is over {limit} bytes: leave generated and binary files out of the diff",
                               "diff_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


def _body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate(orjson.loads(raw or b"{}"))
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise GatewayError(400, f"{where}: {first['msg']}", "invalid_request") from None


def create_app(settings: GatewaySettings) -> FastAPI:
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    # FastAPI's own OpenTelemetry hooks look up providers on every request; the gateway exports Prometheus
    app = FastAPI(title="agentstream gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, error: GatewayError) -> Response:
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        code = "not_found" if error.status_code == 404 else "http_error"
        return _json(error_body(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code),
                     error.status_code)

    # --- model calls ------------------------------------------------------------------------
    # one adapter per API (gateway.adapters); plain Starlette routes, as the hot path needs no dependency
    # injection (FastAPI's would add ~30 µs to a call of ~400 µs)

    def model_call(adapter):
        async def endpoint(request: Request) -> Response:
            params = request.path_params
            try:
                where = gateway.attribution(request, params.get("rollout_id"), params.get("attempt_id"))
            except GatewayError as error:  # 401/403 in the API's own error shape, so its SDK raises as usual
                return adapter.error_response(error)
            return await gateway.calls.serve(request, adapter, where)
        return endpoint

    for adapter in ADAPTERS.values():
        path = adapter.path.removeprefix("/v1")
        app.add_route(f"/v1{path}", model_call(adapter), methods=["POST"])
        app.add_route(f"/rollouts/{{rollout_id}}/attempts/{{attempt_id}}/v1{path}", model_call(adapter),
                      methods=["POST"])

    @app.post("/v1/messages/count_tokens")
    @app.post("/rollouts/{rollout_id}/attempts/{attempt_id}/v1/messages/count_tokens")
    async def count_tokens(request: Request, rollout_id: str | None = None, attempt_id: str | None = None) -> Response:
        messages = ADAPTERS["messages"]
        try:
            where = gateway.attribution(request, rollout_id, attempt_id)
        except GatewayError as error:
            return messages.error_response(error)
        return await gateway.calls.count_tokens(request, messages, where)

    @app.get("/v1/models")
    @app.get("/rollouts/{rollout_id}/attempts/{attempt_id}/v1/models")
    async def models(request: Request, rollout_id: str | None = None, attempt_id: str | None = None) -> Response:
        gateway.attribution(request, rollout_id, attempt_id)
        return _json({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "agentstream"} for model in gateway.pool.models()
        ]})

    # --- rewards and rollout ends -----------------------------------------------------------

    @app.post("/rollouts/{rollout_id}/reward")
    @app.post("/rollouts/{rollout_id}/attempts/{attempt_id}/reward")
    async def reward(request: Request, rollout_id: str, attempt_id: str | None = None) -> Response:
        principal = gateway.auth.principal(auth_headers(request.scope))  # 401 before any look at the body
        body = _body(await request.body(), RewardBody)
        where = gateway.attribution(request, rollout_id, attempt_id or body.attempt_id, principal)
        event = RewardEvent(source=settings.source, rollout_id=where.rollout_id, attempt_id=where.attempt_id,
                            data=Reward(value=body.value, turns=body.turns, details=body.details))
        await gateway.recorder.publish(event)
        return _json({"id": event.id, "rollout_id": event.rollout_id, "attempt_id": event.attempt_id})

    @app.post("/rollouts/{rollout_id}/finish")
    @app.post("/rollouts/{rollout_id}/attempts/{attempt_id}/finish")
    async def finish(request: Request, rollout_id: str, attempt_id: str | None = None) -> Response:
        principal = gateway.auth.principal(auth_headers(request.scope))  # 401 before any look at the body
        body = _body(await request.body(), FinishBody)
        where = gateway.attribution(request, rollout_id, attempt_id or body.attempt_id, principal)
        event = RolloutFinishedEvent(
            source=settings.source, rollout_id=where.rollout_id, attempt_id=where.attempt_id,
            data=RolloutFinished(by="agent", exit_code=body.exit_code, duration_ms=body.duration_ms,
                                 details=body.details))
        await gateway.recorder.publish(event)
        return _json({"id": event.id, "rollout_id": event.rollout_id, "attempt_id": event.attempt_id})

    @app.post("/rollouts/{rollout_id}/attempts/{attempt_id}/diff")
    async def diff(request: Request, rollout_id: str, attempt_id: str) -> Response:
        """The attempt's final diff (coding agents): a `rollout.diff` event a grader scores."""
        principal = gateway.auth.principal(auth_headers(request.scope))  # 401 before any look at the body
        where = gateway.attribution(request, rollout_id, attempt_id, principal)
        raw = await _limited_body(request, MAX_DIFF_BODY_BYTES)
        body = _body(raw, DiffBody)
        encoded = body.diff.encode()
        truncated = len(encoded) > MAX_DIFF_BYTES
        diff = encoded[:MAX_DIFF_BYTES].decode("utf-8", "ignore") if truncated else body.diff
        event = RolloutDiffEvent(source=settings.source, rollout_id=where.rollout_id, attempt_id=where.attempt_id,
                                 data=RolloutDiff(**body.model_dump(exclude={"diff"}), diff=diff, size=len(encoded),
                                                  truncated=truncated))
        await gateway.recorder.publish(event)
        return _json({"id": event.id, "rollout_id": event.rollout_id, "attempt_id": event.attempt_id})

    # --- operations -------------------------------------------------------------------------

    @app.get("/healthz")
    async def healthz() -> Response:
        kafka = gateway.recorder.available
        upstreams = gateway.pool.describe()
        ok = kafka and any(upstream["healthy"] for upstream in upstreams)
        return _json({"status": "ok" if ok else "degraded", "kafka": kafka,
                      "unacknowledged_events": gateway.recorder.unacknowledged, "upstreams": upstreams,
                      "holds": {model: hold.version for model, hold in gateway.pool.holds.items()},
                      "replica_id": settings.replica_id}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    return app

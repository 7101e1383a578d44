"""The gateway's HTTP surface: model calls (OpenAI chat completions, completions and Responses; Anthropic
Messages, and its count_tokens), rewards, rollout ends, sessions' ends and feedback, operations; one table
of routes.

Model calls are served at `/v1/...` (attributed by the rollout token, or by the
`x-agentstream-rollout-id`/`-attempt-id` headers, else session traffic: `gateway/sessions.py`) and at the
rollout-scoped base URL `/rollouts/{rollout_id}/attempts/{attempt_id}/v1/...`. Every endpoint is a
plain Starlette one reading the process's parts from `request.app.state.gateway`: model calls are the
hot path, and FastAPI would add its dependency resolution to every one of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from agentstream.gateway import rollouts, sessions
from agentstream.gateway.adapter import Adapter
from agentstream.gateway.adapters import ADAPTERS
from agentstream.gateway.errors import ErrorCode, GatewayError
from agentstream.gateway.messages import Messages
from agentstream.gateway.rollouts import json_response
from agentstream.gateway.service import Gateway
from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas.api_errors import error_body

Endpoint = Callable[[Request], Coroutine[Any, Any, Response]]
ROLLOUT_SCOPE = "/rollouts/{rollout_id}/attempts/{attempt_id}"


class ModelCalls:
    """The endpoint of one API's model calls."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter

    async def endpoint(self, request: Request) -> Response:
        gateway: Gateway = request.app.state.gateway
        params = request.path_params
        try:
            where = gateway.attribution(request, params.get("rollout_id"), params.get("attempt_id"))
        except GatewayError as error:  # 401/403 in the API's own error shape, so its SDK raises as usual
            return self.adapter.error_response(error)
        assert gateway.calls is not None  # set by the lifespan, before the first request
        return await gateway.calls.serve(request, self.adapter, where)


async def count_tokens(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    messages = ADAPTERS["messages"]
    assert isinstance(messages, Messages) and gateway.calls is not None
    params = request.path_params
    try:
        where = gateway.attribution(request, params.get("rollout_id"), params.get("attempt_id"))
    except GatewayError as error:
        return messages.error_response(error)
    return await gateway.calls.count_tokens(request, messages, where)


async def models(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    gateway.attribution(request, request.path_params.get("rollout_id"), request.path_params.get("attempt_id"))
    assert gateway.pool is not None
    return json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "agentstream"} for model in gateway.pool.models()
    ]})


async def healthz(request: Request) -> Response:
    """Liveness: 200 while the process answers, whatever Kafka and the upstreams do (a probe that restarts the
    gateway when an upstream reloads would restart every replica at once); the report says what is down."""
    return _health(request, ready_status=False)


async def readyz(request: Request) -> Response:
    """Readiness: 503 while Kafka or every upstream is down, so a load balancer sends agents elsewhere."""
    return _health(request, ready_status=True)


def _health(request: Request, ready_status: bool) -> Response:
    gateway: Gateway = request.app.state.gateway
    assert gateway.pool is not None
    kafka = gateway.recorder.available
    upstreams = gateway.pool.describe()
    ok = kafka and any(upstream["healthy"] for upstream in upstreams)
    return json_response({"status": "ok" if ok else "degraded", "kafka": kafka,
                          "unacknowledged_events": gateway.recorder.unacknowledged, "upstreams": upstreams,
                          "holds": {model: hold.version for model, hold in gateway.pool.holds.items()},
                          "replica_id": gateway.settings.replica_id}, 503 if ready_status and not ok else 200)


async def metrics(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")


def _scoped(path: str, endpoint: Endpoint, method: str) -> list[BaseRoute]:
    """`path` served plain and under a rollout's base URL."""
    return [Route(path, endpoint, methods=[method]), Route(ROLLOUT_SCOPE + path, endpoint, methods=[method])]


routes: list[BaseRoute] = [
    *(route for adapter in ADAPTERS.values() for route in _scoped(adapter.path, ModelCalls(adapter).endpoint, "POST")),
    *_scoped("/v1/messages/count_tokens", count_tokens, "POST"),
    *_scoped("/v1/models", models, "GET"),
    Route("/rollouts/{rollout_id}/reward", rollouts.reward, methods=["POST"]),
    Route(ROLLOUT_SCOPE + "/reward", rollouts.reward, methods=["POST"]),
    Route("/rollouts/{rollout_id}/finish", rollouts.finish, methods=["POST"]),
    Route(ROLLOUT_SCOPE + "/finish", rollouts.finish, methods=["POST"]),
    Route(ROLLOUT_SCOPE + "/diff", rollouts.diff, methods=["POST"]),
    Route("/sessions/{session_id}/end", sessions.end, methods=["POST"]),
    Route("/sessions/{session_id}/feedback", sessions.feedback, methods=["POST"]),
    Route("/sessions/{session_id}/calls/{call_id}/feedback", sessions.feedback, methods=["POST"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]


async def gateway_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, GatewayError)
    return error.response()


async def http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    code = ErrorCode.NOT_FOUND if error.status_code == 404 else ErrorCode.HTTP_ERROR
    return json_response(error_body(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code),
                         error.status_code)


def create_app(settings: GatewaySettings) -> Starlette:
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={GatewayError: gateway_error, HTTPException: http_error})
    app.state.gateway = gateway
    app.state.feedback_ids = sessions.FeedbackIds()
    return app

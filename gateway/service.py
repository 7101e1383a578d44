"""The parts of one gateway process (pool, calls, recorder, pool sync), made and started together in the
server's event loop; the endpoints reach them as `request.app.state.gateway`."""

from __future__ import annotations

import asyncio
import gc
import logging
import math

import aiohttp
from starlette.requests import Request

from agentstream.gateway.auth import (
    ATTEMPT_HEADER,
    ROLLOUT_HEADER,
    SESSION_HEADER,
    Attribution,
    Authenticator,
    Principal,
    auth_headers,
)
from agentstream.gateway.calls import CallOptions, Calls
from agentstream.gateway.logs import fields
from agentstream.gateway.metrics import Metrics
from agentstream.gateway.pool import Pool, parse_upstreams
from agentstream.gateway.pool_sync import PoolSync
from agentstream.gateway.recorder import Recorder
from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas.kafka import ensure_topics
from agentstream.schemas.keys import placeholder_secret, secret_values

log = logging.getLogger("gateway")


class Gateway:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.metrics = Metrics()
        self.auth = Authenticator(settings.key_ring, settings.token_secret.get_secret_value(), settings.allow_anonymous)
        self.upstreams = parse_upstreams(settings.upstreams, settings.providers)
        self.recorder = Recorder(settings, self.metrics, durable=settings.durability == "ack",
                                 timeout_s=settings.publish_timeout_s, linger_ms=settings.publish_linger_ms)
        self.http: aiohttp.ClientSession | None = None
        self.pool: Pool | None = None
        self.calls: Calls | None = None
        self.sync: PoolSync | None = None
        self._health: asyncio.Task[None] | None = None

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
                         hold_timeout_s=settings.hold_timeout_s, hold_max_s=settings.hold_max_s,
                         arm_key=settings.arm_key, max_resident_adapters=settings.max_resident_adapters,
                         canary_share=settings.canary_share)
        self.calls = Calls(call_options(settings), self.pool, self.recorder, self.metrics, self.http)
        if not self.pool.upstreams:
            log.warning("no upstreams configured (--upstreams MODEL=URL): every model call will get a 404")
        if not settings.arm_key:
            log.warning("no arm secret (AGENTSTREAM_ARM_SECRET or AGENTSTREAM_TOKEN_SECRET): a client that chooses "
                        "its session ids can choose which arm of a canary serves it")
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


def call_options(settings: GatewaySettings) -> CallOptions:
    return CallOptions(
        training=settings.mode == "training", source=settings.source,
        upstream_api_key=settings.upstream_api_key.get_secret_value(),
        provider_api_key=settings.provider_api_key.get_secret_value(), connect_timeout_s=settings.connect_timeout_s,
        upstream_timeout_s=settings.upstream_timeout_s, refused_fields=frozenset(settings.refused_fields),
        access_log=settings.access_log, partial_rollouts=settings.partial_rollouts)


def settings_problem(settings: GatewaySettings) -> str | None:
    """Why these settings cannot run a gateway, with the fix; None if they can."""
    try:
        keys = settings.key_ring
    except ValueError as exc:  # a key under two scopes
        return str(exc)
    if not (keys or settings.token_secret.get_secret_value() or settings.allow_anonymous):
        return ("the gateway has no way to authenticate agents: set AGENTSTREAM_API_KEYS (operator keys), "
                "AGENTSTREAM_APP_KEYS (app keys), "
                "AGENTSTREAM_TOKEN_SECRET (rollout tokens), or --allow-anonymous for local experiments")
    default = default_secret(settings)
    if default:
        return default
    try:
        parse_upstreams(settings.upstreams, settings.providers)
    except ValueError as exc:
        return str(exc)
    low, high = settings.feedback_score_min, settings.feedback_score_max
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        return f"the feedback score range must be finite, low < high: got [{low}, {high}] (--feedback-score-min/max)"
    return None


def default_secret(settings: GatewaySettings) -> str | None:
    """Which shipped placeholder secret or key a gateway reachable from other hosts would run with; None if none."""
    return placeholder_secret("gateway", settings.host, {
        "AGENTSTREAM_TOKEN_SECRET": [settings.token_secret.get_secret_value()],
        "AGENTSTREAM_API_KEYS": settings.keys, "AGENTSTREAM_APP_KEYS": secret_values(settings.app_keys),
        "AGENTSTREAM_READ_KEYS": secret_values(settings.read_keys),
        "AGENTSTREAM_ARM_SECRET": [settings.arm_secret.get_secret_value()]})

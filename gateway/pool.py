"""The inference pool: upstream servers per model, which one serves a request, and holds.

A rollout sticks to one server (its prefix cache stays warm) by rendezvous hashing of the
rollout id over the model's servers: every gateway replica picks the same server without
sharing state, and a server going down moves only its own rollouts. Health checks mark servers
up and down and read the weight version each one serves.

While a model's weights are updated, its new requests wait in `admit` (bounded; then 503 with
Retry-After) and `drain` reports when the ones in flight have finished. `pool_sync` decides when
to hold and release; this module only keeps the state. With partial rollouts, a streamed call is
`followed` while it runs (its tokens are counted as they pass): the drain does not wait for it, and
`switched` tells it at which of its tokens a server began serving new weights.

Tenants' LoRA adapters ride on the base model's servers (`gateway/lora.py`, `Pool.adapters`): a tenant's call
is counted under its adapter's name, `<tenant>@<version>`, so the old version's requests can drain; a new
adapter holds no one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from agentstream.gateway.errors import ErrorCode, NotFound, Unavailable
from agentstream.gateway.logs import fields
from agentstream.gateway.lora import Adapters, TenantAdapter
from agentstream.gateway.metrics import Metrics
from agentstream.gateway.releases import arm_first
from agentstream.schemas.releases import ReleaseKey, ReleaseState

log = logging.getLogger("gateway.pool")

CHECK_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
_BUSY = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})
"""vLLM's gauges of the requests a server holds: it is idle when they are all 0"""


@dataclass(eq=False)
class Upstream:
    url: str
    models: set[str]
    discover: bool = False
    """models come from the server's /v1/models (it was configured as a bare URL)"""
    provider: bool = False
    """a server that is not this platform's (a teacher at an OpenAI-compatible provider): calls are forwarded as they
    are, with no token ids or logprobs asked, the provider's key and no other; no health or weight checks"""
    healthy: bool = True
    weight_version: int | None = None
    in_flight: int = 0
    problem: str | None = None
    failed_checks: int = 0
    _endpoints: dict[str, URL] = field(default_factory=dict, repr=False)

    def endpoint(self, path: str) -> URL:
        """`url + path`, parsed once (URL parsing is a measurable part of a proxied call)."""
        endpoint = self._endpoints.get(path)
        if endpoint is None:
            endpoint = self._endpoints[path] = URL(self.url + path)
        return endpoint


def parse_upstreams(entries: Sequence[str], providers: Sequence[str] = ()) -> list[Upstream]:
    """`MODEL=URL` or bare `URL` entries; several models on one URL make one server. `providers`: `MODEL=URL` entries
    of servers that are not vLLM (`Upstream.provider`); a URL may not be both."""
    servers = _servers(entries, provider=False)
    for url, server in _servers(providers, provider=True).items():
        if server.discover:
            raise ValueError(f"provider {url!r}: name its model, MODEL=URL (a provider's /v1/models lists models "
                             "this gateway must not route to it)")
        if url in servers:
            raise ValueError(f"{url} is both an upstream and a provider: it is one or the other")
        servers[url] = server
    return list(servers.values())


def _servers(entries: Sequence[str], provider: bool) -> dict[str, Upstream]:
    servers: dict[str, Upstream] = {}
    for entry in entries:
        model, url = ("", entry) if entry.startswith(("http://", "https://")) else entry.partition("=")[::2]
        url = normalize_url(url)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"upstream {entry!r}: expected MODEL=URL or URL, e.g. tiny=http://127.0.0.1:8000")
        server = servers.setdefault(url, Upstream(url, set(), provider=provider))
        if model:
            server.models.add(model)
        else:
            server.discover = True
    return servers


def normalize_url(url: str) -> str:
    """Accept an OpenAI-style base URL too: `http://host:8000/v1/` is the server `http://host:8000`."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x1f{url}".encode(), digest_size=8).digest(), "big")


@dataclass(eq=False)
class Hold:
    version: int
    pending: dict[str, int]
    """server url -> the version it must serve before the hold ends"""
    since: float = field(default_factory=time.monotonic)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    expiry: asyncio.TimerHandle | None = None


class Followed(Protocol):
    """A call whose completion tokens are counted as they stream: it can go on across a weight update."""

    def switched(self, version: int) -> None:
        """Its server serves `version` from the next token on."""


class Lease:
    """One request's use of a server: counted while it runs, so updates can drain."""

    __slots__ = ("_open", "followed", "model", "pool", "upstream")

    def __init__(self, pool: Pool, model: str, upstream: Upstream):
        self.pool, self.model, self.upstream, self._open = pool, model, upstream, True
        self.followed: Followed | None = None
        upstream.in_flight += 1
        pool._in_flight[model] += 1
        pool.metrics.in_flight.inc()

    def follow(self, call: Followed) -> None:
        """From now on a weight update need not wait for this request: `call` learns where it switched."""
        if self._open and self.followed is None:
            self.followed = call
            self.pool.followed.setdefault(self.upstream.url, set()).add(call)
            self.pool._followed[self.model] += 1

    def close(self) -> None:
        if self._open:
            self._open = False
            self.upstream.in_flight -= 1
            self.pool._in_flight[self.model] -= 1
            self.pool.metrics.in_flight.dec()
            if self.followed is not None:
                self.pool.followed[self.upstream.url].discard(self.followed)
                self.pool._followed[self.model] -= 1


class Pool:
    def __init__(self, upstreams: list[Upstream], http: aiohttp.ClientSession, metrics: Metrics, *,
                 initial_version: int = 0, hold_timeout_s: float = 30.0, hold_max_s: float = 300.0,
                 arm_key: bytes = b"", max_resident_adapters: int = 8, canary_share: float = 0.0):
        self.upstreams = {upstream.url: upstream for upstream in upstreams}
        self.arm_key = arm_key
        """the server secret that keys which sessions a canary serves (`schemas.releases.bucket`)"""
        self.http = http
        self.metrics = metrics
        self.initial_version = initial_version
        self.hold_timeout_s = hold_timeout_s
        self.hold_max_s = hold_max_s
        self.holds: dict[str, Hold] = {}
        self._in_flight: Counter[str] = Counter()
        self._followed: Counter[str] = Counter()
        self.followed: dict[str, set[Followed]] = {}
        """server url -> its calls in flight that can go on across a weight update (`Lease.follow`)"""
        self.releases: dict[ReleaseKey, ReleaseState] = {}
        """(model, tenant) -> its release (canary) state, as pool sync folds it from the `releases` topic"""
        self.adapters = Adapters(http, self.in_flight, max_resident=max_resident_adapters, canary_share=canary_share,
                                 arm_key=arm_key)
        """the tenants' LoRA adapters: which serves each tenant, which each server holds"""

    # --- routing ----------------------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted({model for upstream in self.upstreams.values() for model in upstream.models})

    def provided(self, model: str) -> bool:
        """Whether `model` is served by a provider (`Upstream.provider`): its calls are forwarded as they are."""
        return any(upstream.provider for upstream in self.servers(model))

    def servers(self, model: str) -> list[Upstream]:
        return [upstream for upstream in self.upstreams.values() if model in upstream.models]

    def candidates(self, model: str, sticky_key: str | None, adapter: TenantAdapter | None = None) -> list[Upstream]:
        """The model's servers in the order to try them: healthy first; for a tenant's `adapter`, those that hold
        it, then by its tenant (its calls gather where its adapter is); else the session's canary arm first
        (`gateway/releases.py`); by rollout, else least busy."""
        servers = self.servers(model)
        key = adapter.tenant if adapter else sticky_key
        if key:
            servers.sort(key=lambda upstream: _score(key, upstream.url), reverse=True)
        else:
            servers.sort(key=lambda upstream: upstream.in_flight)
        servers = arm_first(self.releases.get((model, None)), sticky_key, servers, self.arm_key)
        if adapter:
            servers.sort(key=lambda upstream: not self.adapters.holds(upstream.url, adapter))
        servers.sort(key=lambda upstream: not upstream.healthy)
        return servers

    def lease(self, model: str, upstream: Upstream) -> Lease:
        return Lease(self, model, upstream)

    def in_flight(self, model: str) -> int:
        return self._in_flight[model]

    def mark_down(self, upstream: Upstream, problem: str) -> None:
        if upstream.healthy:
            log.warning("upstream down", extra=fields(upstream=upstream.url, problem=problem))
        upstream.healthy, upstream.problem = False, problem
        self.metrics.upstream_healthy.labels(upstream.url).set(0)

    # --- holds ------------------------------------------------------------------------------

    async def admit(self, model: str) -> float:
        """Return when `model` takes requests (seconds waited); 503 with Retry-After past the bound."""
        if model not in self.holds:
            return 0.0
        start = time.monotonic()
        deadline = start + self.hold_timeout_s
        self.metrics.held.inc()
        try:
            while (hold := self.holds.get(model)) is not None:
                try:
                    await asyncio.wait_for(hold.released.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    self.metrics.hold_timeouts.inc()
                    raise Unavailable(
                        f"model {model!r} is loading new weights (version {hold.version}) and did not finish "
                        f"within {self.hold_timeout_s:.0f} s; retry shortly", ErrorCode.MODEL_UPDATING, retry_after_s=2,
                    ) from None
        finally:
            self.metrics.held.dec()
        waited = time.monotonic() - start
        self.metrics.hold_wait.observe(waited)
        return waited

    def hold(self, model: str, version: int, servers: list[str]) -> Hold | None:
        """Hold new requests for `model` until each of `servers` serves `version`; None if all already do."""
        behind = [url for url in servers if self._behind(url, version)]
        if not behind:
            return self.holds.get(model)
        hold = self.holds.get(model)
        if hold is None:
            hold = self.holds[model] = Hold(version, {})
            hold.expiry = asyncio.get_running_loop().call_later(self.hold_max_s, self._expire, model, hold)
            log.info("holding requests for a weight update", extra=fields(model=model, version=version, servers=behind))
        hold.version = max(hold.version, version)
        for url in behind:
            hold.pending[url] = max(hold.pending.get(url, version), version)
        return hold

    def applied(self, model: str, version: int, server: str, ok: bool) -> None:
        """A server finished an update (`ok`: it now serves `version`); release the hold when all did."""
        upstream = self.upstreams.get(server)
        if ok and upstream is not None and (upstream.weight_version is None or version > upstream.weight_version):
            self.set_version(upstream, version)
        hold = self.holds.get(model)
        if hold is None:
            return
        if server in hold.pending and hold.pending[server] <= version:
            del hold.pending[server]
        if not hold.pending:
            self._release(model, hold)

    def _behind(self, url: str, version: int) -> bool:
        upstream = self.upstreams.get(url)
        return upstream is not None and (upstream.weight_version is None or upstream.weight_version < version)

    def _release(self, model: str, hold: Hold) -> None:
        if self.holds.get(model) is hold:
            del self.holds[model]
        if hold.expiry:
            hold.expiry.cancel()
        hold.released.set()
        log.info("released requests after a weight update",
                 extra=fields(model=model, version=hold.version, held_ms=round((time.monotonic() - hold.since) * 1000, 1)))

    def _expire(self, model: str, hold: Hold) -> None:
        log.error("weight update not applied in time: releasing requests; they are served by the weights "
                  "each server has", extra=fields(model=model, version=hold.version, servers=sorted(hold.pending),
                                                   hold_max_s=self.hold_max_s))
        self._release(model, hold)

    async def drain(self, model: str, servers: list[Upstream], timeout: float, followed_go_on: bool = False) -> bool:
        """Wait until no request of `model` runs here or on `servers` (other replicas' too); False at timeout.
        `followed_go_on`: wait only for this replica's requests that are not followed (the servers' own
        counts cannot tell a followed request from another)."""
        deadline = time.monotonic() + timeout
        while True:
            if followed_go_on and self.in_flight(model) == self._followed[model]:
                return True
            if self.in_flight(model) == 0 and all(await asyncio.gather(*(self.idle(s) for s in servers))):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    def switched(self, server: str, version: int) -> None:
        """`server` serves `version` from its next step on: each followed call on it marks where that is."""
        for call in self.followed.get(server, ()):
            call.switched(version)

    async def idle(self, upstream: Upstream) -> bool:
        """Whether `upstream` holds no request (vLLM's busy gauges are 0; True when it cannot tell)."""
        try:
            async with self.http.get(f"{upstream.url}/metrics", timeout=CHECK_TIMEOUT) as response:
                if response.status != 200:
                    return True  # a server without vLLM's metrics: the local count is all we know
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return True
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:  # not Prometheus text: as good as no metrics
            return True
        return not any(sample.value for family in families for sample in family.samples if sample.name in _BUSY)

    # --- health -----------------------------------------------------------------------------

    def set_version(self, upstream: Upstream, version: int | None) -> None:
        upstream.weight_version = version
        if version is not None:
            self.metrics.upstream_version.labels(upstream.url).set(version)

    def parse_version(self, reported: object) -> int | None:
        if reported == "default":
            return self.initial_version
        try:
            return int(str(reported))
        except ValueError:
            return None

    async def check(self, upstream: Upstream) -> None:
        if upstream.provider:  # no /health, no /weight_info, and its /v1/models is not this pool's business
            return
        try:
            await self._get(upstream, "/health")
            if upstream.discover:
                listed = await self._get(upstream, "/v1/models") or {}
                upstream.models = {entry["id"] for entry in listed.get("data", [])}
            info = await self._get(upstream, "/weight_info", required=False)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, AttributeError) as exc:
            upstream.failed_checks += 1
            # a refused connection is a server that is down; a slow answer may be a busy one: twice in a row
            if isinstance(exc, aiohttp.ClientConnectorError) or upstream.failed_checks >= 2:
                self.mark_down(upstream, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            return
        upstream.failed_checks = 0
        if info is not None:
            version = self.parse_version(info.get("weight_version"))
            # versions only grow: a check that raced an update must not undo what pool sync set
            if version is not None and (upstream.weight_version is None or version > upstream.weight_version):
                self.set_version(upstream, version)
        if not upstream.healthy:
            log.info("upstream up", extra=fields(upstream=upstream.url))
        upstream.healthy, upstream.problem = True, None
        self.metrics.upstream_healthy.labels(upstream.url).set(1)

    async def _get(self, upstream: Upstream, path: str, required: bool = True) -> dict[str, Any] | None:
        """GET a JSON endpoint (None if it does not exist and is not `required`)."""
        async with self.http.get(f"{upstream.url}{path}", timeout=CHECK_TIMEOUT) as response:
            if response.status == 404 and not required:
                return None
            if response.status != 200:
                raise aiohttp.ClientResponseError(response.request_info, (), status=response.status,
                                                  message=f"{path} answered {response.status}")
            return await response.json(content_type=None) if path != "/health" else None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(upstream) for upstream in self.upstreams.values()))

    async def run_health_checks(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all()

    def describe(self) -> list[dict[str, Any]]:
        return [{"url": u.url, "models": sorted(u.models), "healthy": u.healthy, "weight_version": u.weight_version,
                 "in_flight": u.in_flight, "problem": u.problem,
                 "adapters": list(self.adapters.resident.get(u.url, {}))} for u in self.upstreams.values()]


def no_server(model: str, known: list[str]) -> NotFound:
    return NotFound(f"model {model!r} is not served here; known models: {', '.join(known) or 'none'}",
                        ErrorCode.MODEL_NOT_FOUND)

"""Tenants' LoRA adapters on the pool: which adapter serves a tenant's call, on which server, and which adapters
each server holds.

A tenant (an agent or team, named by its key: `Principal.tenant`) learns its own adapter over the shared base.
Its trainer publishes `weights` with `tenant` set and `uri` a PEFT adapter folder; the server loads it at run
time as `<tenant>@<version>` (`/v1/load_lora_adapter`) beside the base and every other adapter, so an update
pauses no one (`gateway/pool_sync.py` loads it, and unloads the old version once its requests drained). A call
of the tenant is sent as that model: the call event records it and the tenant.

Routing keeps a tenant sticky to the servers that hold its adapter (then by rendezvous hashing of the tenant,
so its calls gather where its adapter is). Each server holds at most `max_resident` adapters as this replica
knows them: a server at the bound unloads its least recently used idle one before loading another, which is
loaded back on demand when its tenant calls again.

Canaries per tenant (`canary_share` > 0): a new version of a tenant that has one serves beside the stable one
on the same server, the session's arm picked by the keyed bucket canaries of the base use
(`schemas.releases.in_canary`). Its `release` events carry the tenant: the decision service measures it on the
tenant's sessions alone, and its decision (`decide`) makes the canary the tenant's stable adapter or drops it;
either way the loser is unloaded once drained (`gateway/pool_sync.py`). A newer version replaces the canary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from agentstream.gateway.errors import ErrorCode, UpstreamFailed
from agentstream.gateway.logs import fields
from agentstream.schemas.events import Release, Weights
from agentstream.schemas.releases import BUCKETS, adapter_name, in_canary

log = logging.getLogger("gateway.lora")

LOAD_TIMEOUT = aiohttp.ClientTimeout(total=60.0)


@dataclass(frozen=True)
class TenantAdapter:
    """One version of a tenant's adapter over a base model."""

    model: str
    tenant: str
    version: int
    uri: str

    @property
    def name(self) -> str:
        return adapter_name(self.tenant, self.version)

    @property
    def path(self) -> str:
        return self.uri.removeprefix("file://")

    @classmethod
    def of(cls, weights: Weights) -> TenantAdapter:
        assert weights.tenant is not None
        return cls(weights.model, weights.tenant, weights.version, weights.uri)

    @classmethod
    def loser(cls, release: Release) -> TenantAdapter:
        """The adapter a tenant's canary decision leaves unused: the old stable one after a promotion, else the
        canary."""
        assert release.tenant is not None
        if release.action == "promote":
            return cls(release.model, release.tenant, release.stable_version, release.stable_uri)
        return cls(release.model, release.tenant, release.version, release.uri)


@dataclass
class TenantState:
    """What serves a tenant now: its stable adapter, and a canary beside it."""

    stable: TenantAdapter
    canary: TenantAdapter | None = None
    share_bp: int = 0


class Adapters:
    """The tenants' current adapters and the adapters each server holds (least recently used first)."""

    def __init__(self, http: aiohttp.ClientSession, in_flight: Callable[[str], int], *, max_resident: int = 8,
                 canary_share: float = 0.0, arm_key: bytes = b""):
        self.http = http
        self.in_flight = in_flight
        """requests this replica has on a model name (the pool's leases, an adapter's under its name)"""
        self.max_resident = max_resident
        self.share_bp = round(canary_share * BUCKETS)
        self.arm_key = arm_key
        self.tenants: dict[tuple[str, str], TenantState] = {}
        """(base model, tenant) -> what serves it"""
        self.resident: dict[str, OrderedDict[str, TenantAdapter]] = {}
        """server url -> the adapters it holds, least recently used first"""
        self.published_uris: dict[tuple[str, str, int], str] = {}
        """(model, tenant, version) -> the folder its `weights` event named, until a server loaded it"""
        self._loading: dict[tuple[str, str], asyncio.Task[float]] = {}
        self.decided: dict[tuple[str, str, int], str] = {}
        """(model, tenant, version) -> `promote` or `rollback`: its canary's decision, kept for a version whose
        `weights` event is folded after the decision (the two topics' histories are read in no set order)"""

    # --- which adapter ------------------------------------------------------------------------

    def current(self, model: str, tenant: str, sticky_key: str | None) -> TenantAdapter | None:
        """The adapter that serves this session of the tenant (its canary arm, else the stable); None: the base."""
        state = self.tenants.get((model, tenant))
        if state is None:
            return None
        if state.canary is not None and in_canary(sticky_key, state.share_bp, self.arm_key):
            return state.canary
        return state.stable

    def serve(self, adapter: TenantAdapter) -> TenantAdapter | None:
        """Make `adapter` what serves its tenant: the stable one, or (canaries on, and a stable one there) the
        canary beside it. Returns the adapter it replaced, whose requests drain before it is unloaded."""
        key = (adapter.model, adapter.tenant)
        state = self.tenants.get(key)
        decided = self.decided.get((*key, adapter.version))
        if decided == "rollback":
            return None  # a canary rolled back already: never served again
        if state is None:
            self.tenants[key] = TenantState(adapter)
            return None
        if adapter.version <= max(state.stable.version, state.canary.version if state.canary else 0):
            return None  # an old or repeated version
        if self.share_bp > 0 and decided is None:
            replaced, state.canary, state.share_bp = state.canary, adapter, self.share_bp
            return replaced
        replaced, state.stable, state.canary = state.stable, adapter, None
        return replaced

    def decide(self, release: Release) -> TenantAdapter | None:
        """A tenant's canary decided: promoted, it serves every session of the tenant; rolled back, none. Returns
        the adapter no session goes to any more (None if this canary does not serve here, or was decided)."""
        assert release.tenant is not None and release.action in ("promote", "rollback")
        key = (release.model, release.tenant)
        self.decided[(*key, release.version)] = release.action
        state = self.tenants.get(key)
        if state is None or state.canary is None or state.canary.version != release.version:
            return None
        replaced = state.stable if release.action == "promote" else state.canary
        if release.action == "promote":
            state.stable = state.canary
        state.canary = None
        return replaced

    # --- where ---------------------------------------------------------------------------------

    def holds(self, server: str, adapter: TenantAdapter) -> bool:
        return adapter.name in self.resident.get(server, {})

    def holders(self, adapter: TenantAdapter) -> list[str]:
        return [url for url, held in self.resident.items() if adapter.name in held]

    # --- loading -------------------------------------------------------------------------------

    async def ensure(self, server: str, adapter: TenantAdapter) -> float:
        """Load `adapter` on `server` unless it holds it (milliseconds spent loading, 0 if it did); a 502 if the
        server cannot. Concurrent calls for the same adapter share one load."""
        held = self.resident.setdefault(server, OrderedDict())
        if adapter.name in held:
            held.move_to_end(adapter.name)
            return 0.0
        key = (server, adapter.name)
        task = self._loading.get(key)
        if task is None:
            task = self._loading[key] = asyncio.create_task(self._load(server, adapter))
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(task)

    async def _load(self, server: str, adapter: TenantAdapter) -> float:
        await self._make_room(server)
        started = time.monotonic()
        status, text = await self._post(server, "/v1/load_lora_adapter",
                                        {"lora_name": adapter.name, "lora_path": adapter.path})
        # 400 "already been loaded": another replica loaded it; the server holds it all the same
        if status != 200 and "already been loaded" not in text:
            raise UpstreamFailed(f"upstream {server} could not load the adapter {adapter.name!r} from {adapter.uri} "
                                 f"(answered {status}: {text[:300]})", ErrorCode.ADAPTER_UNAVAILABLE)
        load_ms = round((time.monotonic() - started) * 1000, 1)
        self.resident.setdefault(server, OrderedDict())[adapter.name] = adapter
        log.info("adapter loaded", extra=fields(server=server, adapter=adapter.name, load_ms=load_ms))
        return load_ms

    async def _make_room(self, server: str) -> None:
        """At the bound, unload the least recently used adapters no request of this replica runs on."""
        held = self.resident.setdefault(server, OrderedDict())
        for name in list(held):
            if len(held) < self.max_resident:
                return
            if not self.in_flight(name):
                await self.unload(server, held[name])

    def forget(self, server: str, adapter: TenantAdapter) -> None:
        """`server` no longer holds `adapter` (it answered 404 for it: another replica unloaded it)."""
        self.resident.get(server, OrderedDict()).pop(adapter.name, None)

    async def unload(self, server: str, adapter: TenantAdapter) -> None:
        """Unload `adapter` from `server` (one already gone is fine); requests still running on it finish."""
        self.forget(server, adapter)
        status, text = await self._post(server, "/v1/unload_lora_adapter", {"lora_name": adapter.name})
        if status not in (200, 404):
            log.warning("an adapter could not be unloaded", extra=fields(server=server, adapter=adapter.name,
                                                                         problem=f"{status}: {text[:300]}"))
        else:
            log.info("adapter unloaded", extra=fields(server=server, adapter=adapter.name))

    async def drain(self, adapter: TenantAdapter, timeout: float) -> bool:
        """Wait until no request of this replica runs on `adapter` (False at timeout)."""
        deadline = time.monotonic() + timeout
        while self.in_flight(adapter.name):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def _post(self, server: str, path: str, body: dict[str, str]) -> tuple[int, str]:
        try:
            async with self.http.post(f"{server}{path}", json=body, timeout=LOAD_TIMEOUT) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"

    def describe(self) -> dict[str, object]:
        return {"tenants": {f"{model}/{tenant}": {"stable": state.stable.name,
                                                   "canary": state.canary.name if state.canary else None}
                            for (model, tenant), state in self.tenants.items()},
                "resident": {url: list(held) for url, held in self.resident.items()}}

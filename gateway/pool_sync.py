"""Pool sync: new weights into the serving pool, with agents seeing a short wait and never an error.

Every replica follows the `weights` and `pool` topics without a consumer group, from where they
end when it starts (what came before is in the servers' /weight_info). A `weights` event for a
model it serves makes it hold that model's new requests; `pool` events, one per server, release
the hold once every server of the model serves the new version (or `hold_max_s` passes).

Exactly one replica applies each `weights` and `releases` event: the member of a consumer group over
both topics that owns their partition (`gateway/ownership.py`, which also fences a writer that lost it).
It first waits (bounded) until every other member of the group said, with a `pool.held` event, that it holds
the model and its own requests of it drained (`gateway/barrier.py`: each replica holds when the event reaches its
own follower, and one that sees it late would send requests into the paused engine). Then, for each server of
the model, it waits for requests in flight to drain (bounded), then pause(keep) → reload_weights(uri) →
reset_prefix_cache → update_weight_version → resume, proving before each step that it still owns the partition,
and publishes a `pool` event with the pause duration. Requests the server counts just after the pause slipped in
after the drain: it resumes the server until they finished and pauses again (bounded, `REPAUSES`; without
partial rollouts). vLLM's gauges do not count a request that arrives once the engine is paused (no step runs to
update them): the barrier is what keeps those out. The version label comes from the same event as the weights,
after they loaded, so a server reports the version it serves. Offsets are committed after the pool events are
acknowledged.

Partial rollouts (`--partial-rollouts`): the drain waits only for calls that are not followed (not
streamed); a streamed call stays in vLLM's scheduler through the pause ("keep" freezes it; the prefix
cache reset makes it recompute its keys and values under the new weights) and goes on with the new
weights after the resume. Just before the resume, with the engine still paused, every followed call on
the server marks its count of tokens so far as the start of the new version's segment: no token is
sampled while paused, and those sampled before the pause have had the whole reload to reach the
gateway. Other replicas mark it when the `pool` event reaches them (later: a few of the new version's
tokens may be counted as the old one's). A re-delivered event (the applier died or lost the
partition mid-way) is finished, not repeated: a server whose /weight_info already shows the version is not
paused again (resumed if the applier stopped before resuming it), one behind loads the event's weights again,
and the pool event's id is derived from (model, version, server, status), so consumers drop the repeat.

A `weights` event with `tenant` set is a tenant's LoRA adapter (`gateway/lora.py`): no hold, no pause. The
applier loads it at run time on the servers that hold the tenant's adapter (else on the tenant's first server),
publishes a `pool` event per server with the tenant and the load time, and every replica then sends the
tenant's calls to the new version; the version it replaced is unloaded once its requests drained. The
`weights` topic is folded from its beginning, so a replica that starts knows each tenant's current adapter.

Canaries (`--canary-share` > 0): the applier answers a `weights` event with a `release` event
(`canary`, topic `releases`) and loads the version on the canary's servers only; the decision
service or a human publishes `promote` (the applier loads it on every server) or `rollback` (it
loads the stable checkpoint on the canary's servers again). Every replica folds the `releases`
topic from its beginning (`schemas.releases`), so each routes a session to the same arm
(`gateway/releases.py`), before and after a restart.

A tenant's canary (`gateway/lora.py`) is its new adapter beside its stable one on the same servers: the applier
publishes its `canary` release event (with the tenant) once a server loaded it. Its decision moves every
replica's routing of that tenant alone (no hold, no pause, no other tenant's or the base's state touched), and the
applier unloads the adapter it left unused (the old stable after a promotion, the canary after a rollback) once
its requests drained. A newer version replaces a running canary, promoted first if it led (`successor`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

import aiohttp
import orjson
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError

from agentstream.gateway.barrier import Barrier, client_id
from agentstream.gateway.errors import GatewayError, UpstreamFailed
from agentstream.gateway.logs import fields
from agentstream.gateway.lora import TenantAdapter
from agentstream.gateway.metrics import Metrics
from agentstream.gateway.ownership import Claim, Fenced, Ownership
from agentstream.gateway.pool import Pool, Upstream
from agentstream.gateway.recorder import Recorder
from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.errors import ServiceError
from agentstream.schemas.events import (
    Event,
    PoolHeldEvent,
    PoolUpdate,
    PoolUpdateEvent,
    Release,
    ReleaseEvent,
    Weights,
    WeightsEvent,
)
from agentstream.schemas.ids import derived_id, now_ms
from agentstream.schemas.kafka import deadletter_event, make_consumer, partitions_of
from agentstream.schemas.releases import BUCKETS, canary_servers, decision_id, fold, key_of, stable_of, successor
from agentstream.schemas.scan import resolve

log = logging.getLogger("gateway.pool_sync")


RELEASES_WAIT_S = 30.0
"""how long a starting replica waits to read the `releases` topic before serving"""

REPAUSES = 3
"""times an update resumes a server it paused with requests in it, lets them finish and pauses it again"""


class UpdateFailed(ServiceError):
    pass


class PoolSync:
    def __init__(self, settings: GatewaySettings, pool: Pool, recorder: Recorder, metrics: Metrics,
                 http: aiohttp.ClientSession):
        self.settings = settings
        self.pool = pool
        self.recorder = recorder
        self.metrics = metrics
        self.http = http
        self._tasks: list[asyncio.Task[None]] = []
        self._unloads: set[asyncio.Task[None]] = set()
        """replaced adapters waiting for their requests to drain before they are unloaded"""
        self._positions: dict[TopicPartition, int] = {}
        self._history: dict[TopicPartition, int] = {}
        """where each partition ended when this replica started: records before are folded, never acted on"""
        self.following = asyncio.Event()
        """set once this replica follows the topics (it holds for every update published after)"""
        self.ownership = Ownership()
        self.barrier = Barrier(settings, pool, recorder)

    async def start(self) -> None:
        """Follow (and apply); with canaries on, return once the release history is folded, so that the first
        call of a session after a restart goes to its canary arm (bounded: without Kafka, start anyway)."""
        self._tasks.append(asyncio.create_task(self._run("follow", self._follow)))
        if self.settings.apply_updates:
            self._tasks.append(asyncio.create_task(self._run("apply", self._apply)))
        if self.settings.canary_share == 0:
            return
        try:
            await asyncio.wait_for(self._releases_known(), RELEASES_WAIT_S)
        except TimeoutError:
            log.warning("serving before the canary releases were read from the log: sessions may reach the "
                        "other arm until they are", extra=fields(waited_s=RELEASES_WAIT_S))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._unloads]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._unloads, return_exceptions=True)
        await self.barrier.stop()

    async def _run(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a consumer loop; when Kafka fails under it, start it again."""
        delay = 0.5
        while True:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except (KafkaError, OSError) as exc:
                log.warning(f"pool sync ({name}) lost Kafka; retrying", extra=fields(problem=str(exc)))
            except Exception:
                log.exception(f"pool sync ({name}) failed; restarting it")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    # --- every replica: hold and release ---------------------------------------------------

    async def _follow(self) -> None:
        topics = self.settings.topics
        consumer = make_consumer(self.settings, group_id=None)
        await consumer.start()
        try:
            partitions = [*await partitions_of(self.settings, topics.weights),
                          *await partitions_of(self.settings, topics.pool),
                          *await partitions_of(self.settings, topics.releases)]
            if not partitions:
                raise KafkaError(f"topics {topics.weights} and {topics.pool} do not exist yet")
            consumer.assign(partitions)
            # from the end on the first start (releases and weights: from the beginning, the state of every canary
            # and every tenant's adapter); after a lost connection, from where this replica was
            fresh = [partition for partition in partitions if partition not in self._positions]
            for topic in {partition.topic for partition in fresh}:  # the log's end now, as the scans find it
                for number, (_, end) in (await resolve(self.settings, topic)).items():
                    where = TopicPartition(topic, number)
                    self._history.setdefault(where, end)
                    self._positions.setdefault(where, 0 if topic in (topics.releases, topics.weights) else end)
            for partition in partitions:
                if partition in self._positions:
                    consumer.seek(partition, self._positions[partition])
                await consumer.position(partition)  # fix the start position now, not at the first fetch
            self.following.set()
            async for record in consumer:
                self.observe(record)
                self._positions[TopicPartition(record.topic, record.partition)] = record.offset + 1
        finally:
            self.following.clear()
            await consumer.stop()

    def observe(self, record: ConsumerRecord) -> None:
        try:
            event: Event = decode(record.value)
        except DecodeError as exc:
            log.warning("skipping an undecodable record", extra=fields(topic=record.topic, offset=record.offset,
                                                                       problem=str(exc)))
            return
        live = record.offset >= self._history.get(TopicPartition(record.topic, record.partition), 0)
        if isinstance(event, WeightsEvent):
            if event.data.tenant is not None:
                self.observe_adapter(event.data, live)
                return
            servers = [upstream.url for upstream in self.pool.servers(event.data.model)]
            # a canary holds when its release event comes; the history is folded for tenants only
            if live and not self.canaries(event.data.model):
                if servers:
                    self.pool.hold(event.data.model, event.data.version, servers)
                self.barrier.held(event.id, event.data.model, event.data.version)
        elif isinstance(event, PoolHeldEvent):
            self.barrier.observe(event.data)
        elif isinstance(event, PoolUpdateEvent):
            update = event.data
            if update.tenant is not None:
                self.adapter_loaded(update)
                return
            self._rolled_back(update)
            if self.settings.partial_rollouts and update.status == "ok":
                self.pool.switched(update.server, update.version)  # the applier's calls have marked it already
            self.pool.applied(update.model, update.version, update.server, ok=update.status == "ok")
        elif isinstance(event, ReleaseEvent):
            self.observe_release(event, live)

    def observe_release(self, event: ReleaseEvent, live: bool = True) -> None:
        """Fold a release event into the routing state; a live canary or promotion holds the model's new
        requests until its servers serve the version (a rollback needs no hold: routing avoids the canary's
        servers until they serve the stable version again)."""
        state = fold(self.pool.releases, event)
        release = event.data
        if state is not None and release.tenant is not None:
            self.observe_tenant_release(release, live)
            return
        if state is None or not live:
            return
        if release.action == "canary":
            log.info("canary started", extra=fields(model=release.model, version=release.version,
                                                   share_bp=release.share_bp, servers=release.servers))
            self.pool.hold(release.model, release.version, release.servers)
            self.barrier.held(event.id, release.model, release.version)
        elif release.action in ("promote", "rollback"):
            log.info(f"canary {state.phase}", extra=fields(model=release.model, version=release.version,
                                                          decided_by=release.decided_by, reason=release.reason))
            if release.action == "promote":
                self.pool.hold(release.model, release.version, [server.url for server in self.pool.servers(release.model)])
                self.barrier.held(event.id, release.model, release.version)

    def observe_tenant_release(self, release: Release, live: bool) -> None:
        """A tenant's canary started (its adapter serves from its `pool` event) or was decided: the tenant's
        sessions go to the winner from now on (from the history too: routing is the fold of both topics)."""
        if release.action in ("promote", "rollback"):
            self.pool.adapters.decide(release)
        if live and release.action != "measure":
            log.info(f"tenant canary {release.action}", extra=fields(
                model=release.model, tenant=release.tenant, version=release.version,
                decided_by=release.decided_by, reason=release.reason))

    def observe_adapter(self, weights: Weights, live: bool) -> None:
        """A tenant's new adapter: from the history it serves at once (loaded on demand where a call needs it);
        a live one once a server loaded it (its `pool` event)."""
        adapter = TenantAdapter.of(weights)
        if live:
            self.pool.adapters.published_uris[(adapter.model, adapter.tenant, adapter.version)] = adapter.uri
        else:
            self.pool.adapters.serve(adapter)

    def adapter_loaded(self, update: PoolUpdate) -> None:
        """A server loaded a tenant's adapter (`pool` event): it holds it, and the tenant's calls go to it."""
        assert update.tenant is not None
        uri = self.pool.adapters.published_uris.pop((update.model, update.tenant, update.version), None)
        if update.status != "ok" or uri is None:
            return  # failed, or published before this replica followed: the history fold took it
        adapter = TenantAdapter(update.model, update.tenant, update.version, uri)
        self.pool.adapters.resident.setdefault(update.server, OrderedDict())[adapter.name] = adapter
        self.pool.adapters.serve(adapter)

    def _rolled_back(self, update: PoolUpdate) -> None:
        """A canary server loaded the stable weights again: it serves that (lower) version now."""
        state = self.pool.releases.get((update.model, None))
        upstream = self.pool.upstreams.get(update.server)
        if (state is not None and upstream is not None and update.status == "ok" and state.current.action == "rollback"
                and update.version == state.current.stable_version and update.server in state.current.servers):
            self.pool.set_version(upstream, update.version)

    def canaries(self, model: str) -> bool:
        """Whether a new version of `model` starts as a canary here (settings, and servers to split)."""
        urls = [server.url for server in self.pool.servers(model)]
        return self.settings.canary_share > 0 and bool(canary_servers(urls, self.settings.canary_servers))

    # --- one replica: apply ----------------------------------------------------------------

    async def _apply(self) -> None:
        topics = self.settings.topics
        # the longest step (a drain, then a reload) must not cost the partition: the group waits that long for
        # this loop to poll again
        step_ms = round((self.settings.barrier_timeout_s + self.settings.drain_timeout_s
                         + self.settings.upstream_timeout_s + 60) * 1000)
        consumer = make_consumer(self.settings, group_id=self.settings.pool_group,
                                 client_id=client_id(self.settings.replica_id),  # the barrier's list of replicas
                                 partition_assignment_strategy=(RangePartitionAssignor,),
                                 rebalance_timeout_ms=step_ms, max_poll_interval_ms=step_ms)
        consumer.subscribe([topics.weights, topics.releases], listener=self.ownership)
        self.ownership.consumer = consumer
        await consumer.start()
        try:
            await self._releases_known()
            while True:
                batch = await consumer.getmany(timeout_ms=1000)
                for partition, records in batch.items():
                    await self._apply_batch(consumer, partition, records)
        finally:
            self.ownership.consumer = None
            await consumer.stop()

    async def _apply_batch(self, consumer: AIOKafkaConsumer, partition: TopicPartition,
                           records: list[ConsumerRecord]) -> None:
        claim = self.ownership.claim(partition, records[0].offset)
        try:
            if partition.topic == self.settings.topics.releases:
                await self._apply_releases(records, claim)
            else:
                await self._apply_weights(records, claim)
        except Fenced as exc:
            log.warning("stopped an update: this replica no longer applies it; the partition's owner does",
                        extra=fields(problem=str(exc)))
            if partition in consumer.assignment():  # still ours (the broker did not answer): read them again
                consumer.seek(partition, records[0].offset)
            return
        except GatewayError:
            # Kafka did not take the pool events: nothing is committed, the restarted loop reads these again
            raise KafkaError("pool events were not acknowledged") from None
        await consumer.commit({partition: records[-1].offset + 1})

    async def _releases_known(self) -> None:
        """Wait until this replica folded the release history: a canary starts from the stable version it names."""
        releases = self.settings.topics.releases
        while not (self.following.is_set() and all(
                self._positions.get(partition, 0) >= end for partition, end in self._history.items()
                if partition.topic == releases)):
            await asyncio.sleep(0.05)

    async def _decoded(self, record: ConsumerRecord) -> Event | None:
        try:
            return decode(record.value)
        except DecodeError as exc:
            await self.recorder.publish(deadletter_event(record, str(exc), f"{self.settings.source}.pool-sync"))
            return None

    async def _apply_weights(self, records: list[ConsumerRecord], claim: Claim) -> None:
        # only the newest version of each model (and each tenant's adapter) matters: a backlog is one update
        newest: dict[tuple[str, str | None], WeightsEvent] = {}
        for record in records:
            event = await self._decoded(record)
            if not isinstance(event, WeightsEvent):
                continue
            key = (event.data.model, event.data.tenant)
            current = newest.get(key)
            if current is None or event.data.version > current.data.version:
                newest[key] = event
        for event in newest.values():
            if event.data.tenant is not None:
                await self.apply_adapter(event, claim)
            elif self.canaries(event.data.model):
                await self.start_canary(event, claim)
            else:
                await self.apply(event, claim=claim, cause=event.id)

    async def _apply_releases(self, records: list[ConsumerRecord], claim: Claim) -> None:
        for record in records:
            event = await self._decoded(record)
            if not isinstance(event, ReleaseEvent) or event.data.action not in ("promote", "rollback"):
                continue
            self.observe_release(event, live=False)  # this replica's follower may not have seen it yet
            state = self.pool.releases.get(key_of(event.data))
            if state is None or state.current != event.data:
                continue  # a decision about a canary that was replaced or decided before
            if event.data.tenant is not None:
                self._unload_later(TenantAdapter.loser(event.data), event.data.servers)
            elif event.data.action == "promote":
                await self.apply(_weights_of(event.data), claim=claim, cause=event.id)
            else:
                await self.roll_back(event.data, claim)

    async def start_canary(self, event: WeightsEvent, claim: Claim | None = None) -> None:
        """Publish the canary's release event, then load its version on the canary's servers."""
        weights = event.data
        servers = self.pool.servers(weights.model)
        chosen = canary_servers([server.url for server in servers], self.settings.canary_servers)
        state = self.pool.releases.get((weights.model, None))
        if state is not None and state.current.version == weights.version:  # delivered again after its start
            if state.active:
                await self.apply(event, [server for server in servers if server.url in state.current.servers], claim,
                                 cause=_canary_id(weights))
            elif state.current.action == "promote":
                await self.apply(event, claim=claim)
            return
        if (state is not None and weights.version > state.current.version
                and (promotion := successor(state)) is not None):  # it replaces a canary that led
            await self._promote_replaced(promotion, claim)
            state = self.pool.releases.get((weights.model, None))
        stable = stable_of(state) or await self._base(weights.model, servers, chosen)
        if stable is not None and weights.version <= stable[0]:
            return  # older than what everyone is served: nothing to try
        if stable is None:
            log.warning("no stable checkpoint to roll a canary back to: the new version goes to every server; "
                        "pass --base-weights MODEL=PATH (the folder the servers started with)",
                        extra=fields(model=weights.model, version=weights.version))
            await self.apply(event, claim=claim)
            return
        release = Release(model=weights.model, action="canary", version=weights.version, uri=weights.uri,
                          stable_version=stable[0], stable_uri=stable[1],
                          share_bp=round(self.settings.canary_share * BUCKETS), servers=chosen, started_at=now_ms(),
                          decided_by=self.settings.replica_id, reason="a new version")
        canary = ReleaseEvent(id=_canary_id(weights), source=self.settings.source, data=release)
        await _check(claim, "starting a canary")
        await self.recorder.publish(canary)
        self.observe_release(canary)
        await self.apply(event, [server for server in servers if server.url in chosen], claim, cause=canary.id)

    async def _promote_replaced(self, release: Release, claim: Claim | None) -> None:
        """Promote a canary that a newer version replaces while it leads (`schemas.releases.successor`): every
        server loads it (a tenant's: it becomes the tenant's stable adapter), and the newer canary is measured
        against it. The id is the rule's for the same promotion, so the decision service's and this one are one
        event."""
        event = ReleaseEvent(id=decision_id(release), source=self.settings.source, data=release)
        await _check(claim, "promoting a replaced canary")
        await self.recorder.publish(event)
        self.observe_release(event)
        if release.tenant is not None:
            self._unload_later(TenantAdapter.loser(release), release.servers)
        else:
            await self.apply(_weights_of(release), claim=claim, cause=event.id)

    async def _base(self, model: str, servers: list[Upstream], chosen: list[str]) -> tuple[int, str] | None:
        """The stable version before any release: what the servers outside the canary serve, from the folder
        they started with (--base-weights)."""
        uri = self.settings.base_weight_uris.get(model)
        versions = [await self._served_version(server) for server in servers if server.url not in chosen]
        known = [version for version in versions if version is not None]
        return (max(known), uri) if uri and known else None

    async def roll_back(self, release: Release, claim: Claim | None = None) -> list[PoolUpdate]:
        """Load the stable checkpoint on the canary's servers again (their version goes down)."""
        servers = [server for server in self.pool.servers(release.model) if server.url in release.servers]
        versions = await asyncio.gather(*(self._served_version(server) for server in servers))
        behind = [server for server, version in zip(servers, versions) if version != release.stable_version]
        if behind and not await self.pool.drain(release.model, behind, self.settings.drain_timeout_s):
            log.warning("requests still in flight after the drain timeout: pausing anyway (they resume after)",
                        extra=fields(model=release.model, drain_timeout_s=self.settings.drain_timeout_s))
        started = time.monotonic()
        updates = await _each(
            self._update(server, release.model, release.stable_version, release.stable_uri, started,
                         skip=server not in behind, claim=claim) for server in servers)
        for server, update in zip(servers, updates):
            await self._published(update, "rollback", str(release.version))
            if update.status == "ok":
                self.pool.set_version(server, update.version)
        return updates

    async def _published(self, update: PoolUpdate, *why: str) -> None:
        await self.recorder.publish(PoolUpdateEvent(
            id=derived_id("pool.update", update.model, str(update.version), update.server, update.status, *why),
            source=self.settings.source, data=update))
        self.metrics.pool_updates.labels(update.status).inc()

    async def apply(self, event: WeightsEvent, servers: list[Upstream] | None = None,
                    claim: Claim | None = None, cause: str | None = None) -> list[PoolUpdate]:
        """Apply one update to `servers` (default: every server of its model) while `claim` holds (None: no
        group, as when called by hand); publish and return one `PoolUpdate` each. `cause`: the id of the event
        every replica holds for (with a claim, the other live replicas are waited for, `gateway/barrier.py`)."""
        weights = event.data
        servers = self.pool.servers(weights.model) if servers is None else servers
        if not servers:
            return []
        hold = self.pool.hold(weights.model, weights.version, [server.url for server in servers])
        held_since = hold.since if hold else time.monotonic()
        versions = await asyncio.gather(*(self._served_version(server) for server in servers))
        behind = [server for server, version in zip(servers, versions) if version is None or version < weights.version]
        if behind:
            log.info("applying weights", extra=fields(model=weights.model, version=weights.version, uri=weights.uri,
                                                      servers=[server.url for server in behind]))
            if cause is not None and claim is not None:
                await self.barrier.wait(cause, weights.model, weights.version)
            if not await self.pool.drain(weights.model, behind, self.settings.drain_timeout_s,
                                         followed_go_on=self.settings.partial_rollouts):
                log.warning("requests still in flight after the drain timeout: pausing anyway (they resume after)",
                            extra=fields(model=weights.model, drain_timeout_s=self.settings.drain_timeout_s))
        updates = await _each(self._update(server, weights.model, weights.version, weights.uri, held_since,
                                           skip=server not in behind, claim=claim) for server in servers)
        for server, update in zip(servers, updates):
            await self._published(update)
            self.pool.applied(update.model, update.version, server.url, ok=update.status == "ok")
        return updates

    async def apply_adapter(self, event: WeightsEvent, claim: Claim | None = None) -> list[PoolUpdate]:
        """Load a tenant's new adapter beside everything the servers serve (no hold, no pause) on the servers
        that hold its tenant's adapters (else the tenant's first server); publish a `pool` event for each; then
        serve it, and unload the version it replaced once that one's requests drained."""
        adapter = TenantAdapter.of(event.data)
        adapters = self.pool.adapters
        release = self.pool.releases.get((adapter.model, adapter.tenant))
        if (release is not None and adapter.version > release.current.version
                and (promotion := successor(release)) is not None):  # it replaces a tenant's canary that led
            await self._promote_replaced(promotion, claim)
        state = adapters.tenants.get((adapter.model, adapter.tenant))
        held = {url for old in ((state.stable, state.canary) if state else ()) if old for url in adapters.holders(old)}
        servers = ([server for server in self.pool.servers(adapter.model) if server.url in held]
                   or self.pool.candidates(adapter.model, None, adapter)[:1])
        updates = []
        for server in servers:
            await _check(claim, "loading an adapter")
            try:
                update = self._adapter_update(adapter, server, "ok", load_ms=await adapters.ensure(server.url, adapter))
            except UpstreamFailed as exc:
                log.error("an adapter could not be loaded; its tenant keeps its current one",
                          extra=fields(server=server.url, adapter=adapter.name, problem=exc.message))
                update = self._adapter_update(adapter, server, "failed", error=exc.message)
            await self._published(update, "adapter", adapter.tenant)
            updates.append(update)
        if any(update.status == "ok" for update in updates):
            adapters.published_uris.pop((adapter.model, adapter.tenant, adapter.version), None)
            replaced = adapters.serve(adapter)
            if replaced is not None:
                self._unload_later(replaced)
            state = adapters.tenants[(adapter.model, adapter.tenant)]
            if state.canary == adapter:
                await self._start_tenant_canary(state.stable, adapter,
                                                [update.server for update in updates if update.status == "ok"], claim)
        return updates

    async def _start_tenant_canary(self, stable: TenantAdapter, canary: TenantAdapter, servers: list[str],
                                   claim: Claim | None) -> None:
        """Publish the `canary` release event of a tenant's adapter beside its stable one (once: a re-delivered
        `weights` event finds it in the fold), which the decision service measures on the tenant's sessions."""
        state = self.pool.releases.get((canary.model, canary.tenant))
        if state is not None and state.current.version == canary.version:
            return
        release = Release(model=canary.model, tenant=canary.tenant, action="canary", version=canary.version,
                          uri=canary.uri, stable_version=stable.version, stable_uri=stable.uri,
                          share_bp=self.pool.adapters.share_bp, servers=servers, started_at=now_ms(),
                          decided_by=self.settings.replica_id, reason="a new adapter version")
        event = ReleaseEvent(id=derived_id("release.canary", canary.model, canary.tenant, str(canary.version)),
                             source=self.settings.source, data=release)
        await _check(claim, "starting a tenant's canary")
        await self.recorder.publish(event)
        self.observe_release(event)

    def _unload_later(self, adapter: TenantAdapter, servers: Iterable[str] = ()) -> None:
        """Unload `adapter` once its requests drained, without holding up the applier."""
        task = asyncio.create_task(self._unload_when_drained(adapter, servers))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    def _adapter_update(self, adapter: TenantAdapter, server: Upstream, status: Literal["ok", "failed"],
                        load_ms: float | None = None, error: str | None = None) -> PoolUpdate:
        return PoolUpdate(model=adapter.model, version=adapter.version, server=server.url, status=status,
                          pause_ms=0.0, load_ms=load_ms, held_ms=0.0, error=error,
                          applied_by=self.settings.replica_id, tenant=adapter.tenant)

    async def _unload_when_drained(self, adapter: TenantAdapter, servers: Iterable[str] = ()) -> None:
        """Unload from the servers this replica knows hold it, and from `servers` (a canary's, as its release
        names them: this replica may have started after they loaded it)."""
        if not await self.pool.adapters.drain(adapter, self.settings.drain_timeout_s):
            log.warning("requests still on a replaced adapter after the drain timeout: unloading it anyway (the "
                        "server finishes them)", extra=fields(adapter=adapter.name))
        for url in dict.fromkeys([*self.pool.adapters.holders(adapter), *servers]):
            await self.pool.adapters.unload(url, adapter)

    async def _served_version(self, server: Upstream) -> int | None:
        try:
            async with self.http.get(f"{server.url}/weight_info", timeout=aiohttp.ClientTimeout(total=10)) as response:
                response.raise_for_status()
                return self.pool.parse_version((await response.json(content_type=None)).get("weight_version"))
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None

    async def _paused(self, server: Upstream) -> bool:
        try:
            async with self.http.get(f"{server.url}/is_paused", timeout=aiohttp.ClientTimeout(total=10)) as response:
                return response.status == 200 and (await response.json(content_type=None)).get("is_paused") is True
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return False

    async def _update(self, server: Upstream, model: str, version: int, uri: str, held_since: float,
                      skip: bool, claim: Claim | None = None) -> PoolUpdate:
        """Update one server, step by step while `claim` holds. Fenced stops it where it is: the engine stays
        paused (requests wait, none runs on half-loaded weights) until the partition's new owner finishes."""
        def update(status: Literal["ok", "failed"], pause_ms: float = 0.0, load_ms: float | None = None,
                   error: str | None = None) -> PoolUpdate:
            held_ms = round((time.monotonic() - held_since) * 1000, 1)
            return PoolUpdate(model=model, version=version, server=server.url, status=status,
                              pause_ms=pause_ms, load_ms=load_ms, held_ms=held_ms, error=error,
                              applied_by=self.settings.replica_id)

        if skip:  # already serves it: an update delivered again after its applier stopped
            return await self._finish(server, claim, update)
        path = uri.removeprefix("file://")
        paused = time.monotonic()
        load_ms = None
        error = None
        try:
            await _check(claim, "pausing")
            await self._post(server, "/pause", params={"mode": "keep"})
            if not self.settings.partial_rollouts:
                await self._paused_empty(server, model, claim)
            paused = time.monotonic()
            await _check(claim, "reloading")
            await self._post(server, "/collective_rpc", timeout=self.settings.upstream_timeout_s,
                             json={"method": "reload_weights", "kwargs": {"weights_path": path}})
            load_ms = round((time.monotonic() - paused) * 1000, 1)
            await _check(claim, "resetting the prefix cache")
            await self._reset_prefix_cache(server)
            await _check(claim, "labelling the version")  # after the weights loaded, from the same event
            await self._post(server, "/update_weight_version", json={"new_version": str(version)})
            if self.settings.partial_rollouts:  # still paused: every token counted so far is the old weights'
                self.pool.switched(server.url, version)
        except (aiohttp.ClientError, TimeoutError, UpdateFailed) as exc:
            error = f"{type(exc).__name__}: {exc}"
        await _check(claim, "resuming")  # a fenced writer leaves the resume to the one that finishes the update
        try:
            await self._post(server, "/resume")
        except (aiohttp.ClientError, TimeoutError, UpdateFailed) as exc:
            error = f"{error + '; ' if error else ''}resume failed: {type(exc).__name__}: {exc}"
        pause_ms = round((time.monotonic() - paused) * 1000, 1)
        self.metrics.pause.observe(pause_ms / 1000)
        if error:
            log.error("weight update failed on a server; it keeps serving its weights",
                      extra=fields(server=server.url, version=version, problem=error))
            return update("failed", pause_ms, load_ms, error)
        log.info("weights applied", extra=fields(server=server.url, version=version, pause_ms=pause_ms, load_ms=load_ms))
        return update("ok", pause_ms, load_ms)

    async def _paused_empty(self, server: Upstream, model: str, claim: Claim | None) -> None:
        """A server just paused holds no request, or gets the chance to finish them first: a request that reached
        it after the drain (from a replica that held late) would wait through the reload, and be recorded with the
        version before while the new weights answer it."""
        for _ in range(REPAUSES):
            if await self.pool.idle(server):
                return
            log.warning("requests reached the server between the drain and the pause: resuming it until they finish",
                        extra=fields(server=server.url, model=model))
            await _check(claim, "resuming for requests that came after the drain")
            await self._post(server, "/resume")
            await self.pool.drain(model, [server], self.settings.drain_timeout_s)
            await _check(claim, "pausing again")
            await self._post(server, "/pause", params={"mode": "keep"})
        if not await self.pool.idle(server):
            log.warning("requests still in the paused server: they go on with the new weights",
                        extra=fields(server=server.url, model=model, tries=REPAUSES))

    async def _finish(self, server: Upstream, claim: Claim | None,
                      update: Callable[..., PoolUpdate]) -> PoolUpdate:
        """A server that serves the version already: resume it if its applier stopped before doing so."""
        if not await self._paused(server):
            return update("ok")
        await _check(claim, "resuming")
        try:
            await self._post(server, "/resume")
        except (aiohttp.ClientError, TimeoutError, UpdateFailed) as exc:
            return update("failed", error=f"resume failed: {type(exc).__name__}: {exc}")
        log.info("resumed a server its last applier left paused", extra=fields(server=server.url))
        return update("ok")

    async def _reset_prefix_cache(self, server: Upstream) -> None:
        """Drop KV blocks cached under the old weights: a prompt that hits them after the swap would
        be continued from the old model's keys and values, and its logprobs would match neither.
        vLLM 0.32's reload_weights drops them itself; this keeps it so where a server does not."""
        # kept requests hold blocks; resetting them too makes them recompute under the new weights
        result = await self._post(server, "/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not (result or {}).get("success"):
            raise UpdateFailed(f"the prefix cache could not be reset (answer: {result})")

    async def _post(self, server: Upstream, path: str, timeout: float = 30.0, **kwargs: Any) -> dict[str, Any] | None:
        async with self.http.post(f"{server.url}{path}", timeout=aiohttp.ClientTimeout(total=timeout),
                                  **kwargs) as response:
            if response.status != 200:
                raise UpdateFailed(f"POST {path} answered {response.status}: {(await response.text())[:500]}")
            body = await response.read()
            answer: dict[str, Any] | None = orjson.loads(body) if body.strip().startswith(b"{") else None
            return answer


def _canary_id(weights: Weights) -> str:
    """The id of the release event that starts `weights` as a canary (every replica holds for it)."""
    return derived_id("release.canary", weights.model, str(weights.version))


def _weights_of(release: Release) -> WeightsEvent:
    """The update a promotion applies: the canary's version on every server."""
    return WeightsEvent(source="release", data=Weights(model=release.model, version=release.version, uri=release.uri,
                                                       step=0))


async def _check(claim: Claim | None, step: str) -> None:
    if claim is not None:
        await claim.check(step)


async def _each(updates: Iterable[Awaitable[PoolUpdate]]) -> list[PoolUpdate]:
    """Every server's update run to its end (a fenced one stops before its next step, never mid-step); then
    Fenced if one was."""
    results = await asyncio.gather(*updates, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [result for result in results if not isinstance(result, BaseException)]

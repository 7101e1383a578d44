"""Pool sync: new weights into the serving pool, with agents seeing a short wait and never an error.

Every replica follows the `weights` and `pool` topics without a consumer group, from where they
end when it starts (what came before is in the servers' /weight_info). A `weights` event for a
model it serves makes it hold that model's new requests; `pool` events, one per server, release
the hold once every server of the model serves the new version (or `hold_max_s` passes).

Exactly one replica applies each update: the one a consumer group over the single-partition
`weights` topic assigns the partition to. For each server of the model it waits for requests in
flight to drain (bounded), then pause(keep) → reload_weights(uri) → reset_prefix_cache →
update_weight_version → resume, and publishes a `pool` event with the pause duration. Offsets are committed after the
pool events are acknowledged. A re-delivered event (the applier died mid-way) is harmless:
a server whose /weight_info already shows the version is not paused again, and the pool event's
id is derived from (model, version, server, status), so consumers drop the repeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import aiohttp
import orjson
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from schemas.errors import ServiceError
from schemas.codec import DecodeError, decode
from schemas.events import Event, PoolUpdate, PoolUpdateEvent, WeightsEvent
from schemas.ids import derived_id
from schemas.kafka import deadletter_event, make_consumer, partitions_of
from schemas.scan import resolve

from gateway.errors import GatewayError
from gateway.logs import fields
from gateway.metrics import Metrics
from gateway.pool import Pool, Upstream
from gateway.recorder import Recorder
from gateway.settings import GatewaySettings

log = logging.getLogger("gateway.pool_sync")


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
        self._positions: dict[TopicPartition, int] = {}
        self.following = asyncio.Event()
        """set once this replica follows the topics (it holds for every update published after)"""

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._run("follow", self._follow)))
        if self.settings.apply_updates:
            self._tasks.append(asyncio.create_task(self._run("apply", self._apply)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

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
                          *await partitions_of(self.settings, topics.pool)]
            if not partitions:
                raise KafkaError(f"topics {topics.weights} and {topics.pool} do not exist yet")
            consumer.assign(partitions)
            # from the end on the first start; after a lost connection, from where this replica was
            fresh = [partition for partition in partitions if partition not in self._positions]
            for topic in {partition.topic for partition in fresh}:  # the log's end now, as the scans find it
                for number, (_, end) in (await resolve(self.settings, topic)).items():
                    self._positions.setdefault(TopicPartition(topic, number), end)
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
        if isinstance(event, WeightsEvent):
            servers = [upstream.url for upstream in self.pool.servers(event.data.model)]
            if servers:
                self.pool.hold(event.data.model, event.data.version, servers)
        elif isinstance(event, PoolUpdateEvent):
            update = event.data
            self.pool.applied(update.model, update.version, update.server, ok=update.status == "ok")

    # --- one replica: apply ----------------------------------------------------------------

    async def _apply(self) -> None:
        consumer = make_consumer(self.settings, self.settings.topics.weights, group_id=self.settings.pool_group)
        await consumer.start()
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=1000)
                for partition, records in batch.items():
                    await self._apply_batch(consumer, partition, records)
        finally:
            await consumer.stop()

    async def _apply_batch(self, consumer: AIOKafkaConsumer, partition: TopicPartition,
                           records: list[ConsumerRecord]) -> None:
        # only the newest version of each model matters: a backlog is one update, not many
        newest: dict[str, WeightsEvent] = {}
        for record in records:
            try:
                event = decode(record.value, expect=WeightsEvent)
            except DecodeError as exc:
                await self.recorder.publish(deadletter_event(record, str(exc), f"{self.settings.source}.pool-sync"))
                continue
            current = newest.get(event.data.model)
            if current is None or event.data.version > current.data.version:
                newest[event.data.model] = event
        try:
            for event in newest.values():
                await self.apply(event)
        except GatewayError:
            # Kafka did not take the pool events: nothing is committed, the restarted loop reads these again
            raise KafkaError("pool events were not acknowledged") from None
        await consumer.commit({partition: records[-1].offset + 1})

    async def apply(self, event: WeightsEvent) -> list[PoolUpdate]:
        """Apply one update to every server of its model; publish and return one `PoolUpdate` each."""
        weights = event.data
        servers = self.pool.servers(weights.model)
        if not servers:
            return []
        hold = self.pool.hold(weights.model, weights.version, [server.url for server in servers])
        held_since = hold.since if hold else time.monotonic()
        versions = await asyncio.gather(*(self._served_version(server) for server in servers))
        behind = [server for server, version in zip(servers, versions) if version is None or version < weights.version]
        if behind:
            log.info("applying weights", extra=fields(model=weights.model, version=weights.version, uri=weights.uri,
                                                      servers=[server.url for server in behind]))
            if not await self.pool.drain(weights.model, behind, self.settings.drain_timeout_s):
                log.warning("requests still in flight after the drain timeout: pausing anyway (they resume after)",
                            extra=fields(model=weights.model, drain_timeout_s=self.settings.drain_timeout_s))
        updates = await asyncio.gather(*(self._update(server, weights.model, weights.version, weights.uri, held_since,
                                                      skip=server not in behind) for server in servers))
        for server, update in zip(servers, updates):
            await self.recorder.publish(PoolUpdateEvent(
                id=derived_id("pool.update", update.model, str(update.version), update.server, update.status),
                source=self.settings.source, data=update))
            self.pool.applied(update.model, update.version, server.url, ok=update.status == "ok")
            self.metrics.pool_updates.labels(update.status).inc()
        return updates

    async def _served_version(self, server: Upstream) -> int | None:
        try:
            async with self.http.get(f"{server.url}/weight_info", timeout=aiohttp.ClientTimeout(total=10)) as response:
                response.raise_for_status()
                return self.pool.parse_version((await response.json(content_type=None)).get("weight_version"))
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None

    async def _update(self, server: Upstream, model: str, version: int, uri: str, held_since: float,
                      skip: bool) -> PoolUpdate:
        def update(status: Literal["ok", "failed"], pause_ms: float = 0.0, load_ms: float | None = None,
                   error: str | None = None) -> PoolUpdate:
            held_ms = round((time.monotonic() - held_since) * 1000, 1)
            return PoolUpdate(model=model, version=version, server=server.url, status=status,
                              pause_ms=pause_ms, load_ms=load_ms, held_ms=held_ms, error=error,
                              applied_by=self.settings.replica_id)

        if skip:  # already serves it: an update delivered again after its applier stopped
            return update("ok")
        path = uri.removeprefix("file://")
        paused = time.monotonic()
        load_ms = None
        error = None
        try:
            await self._post(server, "/pause", params={"mode": "keep"})
            paused = time.monotonic()
            await self._post(server, "/collective_rpc", timeout=self.settings.upstream_timeout_s,
                             json={"method": "reload_weights", "kwargs": {"weights_path": path}})
            load_ms = round((time.monotonic() - paused) * 1000, 1)
            await self._reset_prefix_cache(server)
            await self._post(server, "/update_weight_version", json={"new_version": str(version)})
        except (aiohttp.ClientError, TimeoutError, UpdateFailed) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
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

"""The Faust application: trajectory assembly and windowed analytics over the log.

    rollouts ┐
    calls    ├─▶ assemble ─(tables: rollouts, events)─▶ trajectories, rewards (computed), deadletter
    rewards  ┘       ▲
    ticks ───────────┘   (the timer's nudge: an attempt of this partition is due)

    calls, trajectories ─▶ analyse ─(tumbling windowed tables)─▶ metrics topic, GET /analytics

All rollout-scoped topics share one partition count, so each agent reads a rollout's events from
one partition, in order, and each table key is written from one partition: the changelogs are
co-partitioned with the sources and a rebalance moves state with its partition.

Settling is time-driven, but a Faust table can only be changed while an agent handles an event
of the key's partition. So the timer only looks: when an attempt of partition P is due, it sends
a tick to partition P of the worker's own `ticks` topic, and the assembly agent settles P's due
attempts when the tick arrives.

Processing is at-least-once: Faust commits a source offset after the messages sent while handling
it and the table changes are acknowledged. After a crash, events since the last commit are handled
again: the assembly drops them as duplicates, and an attempt settled twice yields the same
trajectory id, which consumers drop. Analytics may count such events twice; they are a view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from datetime import timedelta

import faust
from aiokafka.errors import KafkaError
from faust.exceptions import ProducerSendError
from faust.types import TP
from faust.web import Request, Response, View

from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    CallEvent, DeadletterEvent, Deadletter, Event, Metrics, MetricsEvent, RewardEvent, TrajectoryEvent,
)
from schemas.ids import derived_id, now_ms
from schemas.kafka import deadletter_event
from schemas.topics import FOREVER, TopicSpec

from streams import analytics
from streams.assembly import Assembly, Settled
from streams.settings import StreamsSettings

log = logging.getLogger("streams")
ASSEMBLED = ("rollouts", "calls", "rewards")
ANALYSED = ("calls", "trajectories")


def create_app(settings: StreamsSettings, partitions: int) -> faust.App:
    """The worker's app; `partitions` is the rollout-scoped topics' partition count."""
    topics = settings.topics
    app = faust.App(
        settings.group_id,
        broker=[f"kafka://{server.strip()}" for server in settings.bootstrap_servers.split(",")],
        store="memory://",
        datadir=str(settings.data_dir),
        key_serializer="raw",
        value_serializer="raw",
        processing_guarantee="at_least_once",
        producer_acks=-1,
        producer_max_request_size=16 * 1024 * 1024,
        consumer_max_fetch_size=16 * 1024 * 1024,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
        # a worker that died is noticed (and its partitions handed on) after this long
        broker_session_timeout=10.0,
        broker_heartbeat_interval=2.0,
        topic_partitions=partitions,
        topic_replication_factor=settings.replication_factor,
        topic_allow_declare=True,
        web_bind=settings.web_host,
        web_host=settings.web_host,
        web_port=settings.web_port,
        web_enabled=True,
    )
    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    ticks = app.topic(ticks_topic(settings), **raw)
    sources = app.topic(*(topics.name(base) for base in ASSEMBLED), ticks_topic(settings), **raw)
    out = {base: app.topic(topics.name(base), **raw) for base in ("trajectories", "rewards", "deadletter", "metrics")}

    rollouts = app.tables.add(DurableTable(app, name="assembly-rollouts", partitions=partitions))  # JSON
    events = app.tables.add(DurableTable(app, name="assembly-events", partitions=partitions, key_type=str,
                                         value_type=bytes))
    assembly = Assembly(rollouts, events, settings.timing, settings.source)

    @rollouts.on_recover
    async def index_recovered_state() -> None:
        assembly.reindex()
    counts: Counter[str] = Counter()
    """what the worker itself dropped or deadlettered (the assembly counts the rest)"""
    ticking: dict[int, float] = {}
    """partition → when its tick was sent (monotonic), until the agent handles it"""

    async def publish(topic: str, event: Event, now: bool = False):
        """Send as part of handling the current event (at its commit), or `now`: the broker's ack is
        then the returned future."""
        return await out[topic].send(key=event.key, value=encode(event), force=now)

    async def deadletter(message, kind: str | None, reason: str) -> None:
        if kind:
            counts[kind] += 1
        event = deadletter_event(message, reason, settings.source)
        event.id = derived_id("streams.deadletter", message.topic, str(message.partition), str(message.offset))
        await publish("deadletter", event)

    async def emit(settled: Settled) -> None:
        """Publish what settling yielded, acknowledged, before the state says the attempts are settled."""
        sent = [await publish("rewards", reward, now=True) for reward in settled.rewards]
        sent += [await publish("trajectories", trajectory, now=True) for trajectory in settled.trajectories]
        for raw_event, reason in settled.late + settled.unscored:
            event = decode(raw_event)
            sent.append(await publish("deadletter", DeadletterEvent(
                id=derived_id("streams.deadletter", event.id), source=settings.source,
                data=Deadletter(topic=topics.name(event.topic), key=event.rollout_id, value=raw_event.decode(),
                                reason=reason, consumer=settings.source)), now=True))
        await asyncio.gather(*sent)
        assembly.record(settled)

    source_names = [topics.name(base) for base in ASSEMBLED]
    read: dict[TP, tuple[int, int]] = {}
    """source topic partition → (offset, event time) of the last event the assembly handled"""

    def watermark(partition: int) -> int:
        """The time up to which the partition's events have all been handled (see `settle_at`)."""
        return settle_at(partition, source_names, read, app.consumer, now_ms())

    async def settle_due(partition: int) -> None:
        now = watermark(partition)
        for rollout_id in assembly.due(now, [partition]):
            await emit(assembly.settle(rollout_id, now))

    async def handle(message) -> None:
        if message.topic == ticks_topic(settings):
            ticking.pop(message.partition, None)
            return await settle_due(message.partition)
        last_time = read.get(message.tp, (0, 0))[1]
        try:
            event = decode(message.value)
        except DecodeError as exc:
            read[message.tp] = (message.offset, last_time)
            return await deadletter(message, "undecodable", f"undecodable: {exc}")
        read[message.tp] = (message.offset, max(last_time, event.time))
        if event.topic not in ASSEMBLED or topics.name(event.topic) != message.topic:
            return await deadletter(message, "misplaced", f"a {event.type} event does not belong on {message.topic}")
        if event.rollout_id is None:
            if isinstance(event, CallEvent):
                counts["session_calls"] += 1  # traffic outside any rollout: analytics count it
                return
            return await deadletter(message, "unattributed", f"a {event.type} event needs a rollout_id")
        late = assembly.add(event, message.value, message.partition)
        if late:
            await deadletter(message, None, late)  # the assembly counted it
        await settle_due(message.partition)  # while events flow, no tick is needed

    @app.agent(sources, name="assemble")
    async def assemble(stream):
        async for record in stream.events():
            message = record.message
            try:
                await handle(message)
            except (KafkaError, ProducerSendError) as exc:
                # nothing is committed past this event: the next worker handles it again
                await app.crash(exc)
                raise
            except Exception as exc:  # a bug meeting an odd event: set the event aside, keep going
                log.exception("the assembly failed on %s:%d@%d", message.topic, message.partition, message.offset)
                await deadletter(message, "failed", f"the assembly failed on this event: {type(exc).__name__}: {exc}")
            await rollouts.written()
            await events.written()

    @app.on_partitions_revoked.connect
    async def forget_positions(app, revoked, **kwargs) -> None:
        for tp in revoked:
            read.pop(tp, None)

    def active_partitions() -> set[int]:
        return {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == topics.rollouts}

    @app.timer(interval=settings.tick_s)
    async def tick() -> None:
        clock = time.monotonic()
        for partition in active_partitions():
            if not assembly.due(watermark(partition), [partition]):
                continue
            if clock - ticking.get(partition, -1e9) > 5.0:  # resend a tick that got lost in a rebalance
                ticking[partition] = clock
                await ticks.send(key=b"tick", value=b"tick", partition=partition, force=True)

    windows = {size: app.Table(f"analytics-{size}s", default=dict, partitions=partitions).tumbling(size, expires=timedelta(
                                   seconds=size * settings.window_history)).relative_to_stream()
               for size in settings.windows_s}
    changed: set[tuple[int, str, float]] = set()

    @app.agent(app.topic(*(topics.name(base) for base in ANALYSED), **raw), name="analyse")
    async def analyse(stream):
        async for record in stream.events():
            message = record.message
            try:
                event = decode(message.value)
            except DecodeError:
                continue  # the assembly agent deadletters what it reads; trajectories are ours
            if isinstance(event, CallEvent):
                key, fold = group_key(event.data.model, event.data.weight_version, message.partition), \
                    lambda agg: analytics.add_call(agg, event.data)
            elif isinstance(event, TrajectoryEvent):
                key, fold = group_key(event.data.model, wrote_it(event), message.partition), \
                    lambda agg: analytics.add_trajectory(agg, event.data)
            else:
                continue
            for size, table in windows.items():
                table[key] = fold(table[key].current())
                changed.add((size, key, table.table.window.current(message.timestamp)))

    @app.timer(interval=settings.metrics_interval_s)
    async def publish_metrics() -> None:
        pending = list(changed)
        changed.clear()
        for size, key, window in pending:
            value = windows[size].table.data.get((key, window))
            if value is None:
                continue
            model, version, partition = key.split("|")
            await publish("metrics", MetricsEvent(source=settings.source, data=Metrics(
                window_s=size, window_start=int(window[0] * 1000),
                group={"model": model, "weight_version": version, "partition": partition}, values=value)))

    @app.page("/analytics")
    class AnalyticsView(View):
        async def get(self, request: Request) -> Response:
            return self.json({
                "assembly": {**assembly.counts, **counts, "rollouts_held": len(rollouts),
                             "partitions": sorted(active_partitions())},
                "sources": {f"{topic}:{partition}": source_position(TP(topic, partition), read, app.consumer)
                            for partition in sorted(active_partitions()) for topic in source_names},
                "windows": {str(size): window_view(windows[size].table, size) for size in windows},
            })

    return app


class DurableTable(faust.Table):
    """A table whose changes can be awaited until the broker has them.

    faust-streaming 0.15.3 commits a source offset after `producer.flush()`, but its buffer's flush
    returns while a changelog message is still on its way to the client (the one being handed over,
    or any after 0.1 s without progress), so a crash just after a commit could lose a table change
    whose event is never read again. The assembly agent awaits its changes before it takes the next
    event: an event is only ever committed after its changes are durable.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unacknowledged: list[asyncio.Future] = []

    def send_changelog(self, *args, **kwargs):
        sent = super().send_changelog(*args, **kwargs)
        self._unacknowledged.append(sent)
        return sent

    async def written(self) -> None:
        pending, self._unacknowledged = self._unacknowledged, []
        if pending:
            await asyncio.gather(*pending)


def group_key(model: str | None, version: int | None, partition: int) -> str:
    return f"{model or ''}|{'' if version is None else version}|{partition}"


def wrote_it(event: TrajectoryEvent) -> int | None:
    """The weight version a trajectory is credited to: the oldest that generated one of its turns."""
    versions = [turn.weight_version for turn in event.data.turns if turn.weight_version is not None]
    return min(versions) if versions else None


def settle_at(partition: int, sources: list[str], read: dict[TP, tuple[int, int]], consumer, now: int) -> int:
    """The event time up to which attempts of `partition` may settle: now, once every source topic's
    partition has been read to its end; else the time of the last event read from the one behind.

    The three sources are separate topics: Faust reads them side by side, not in the order they
    were written, so a worker catching up (after a restart, say) may see an attempt's finish before
    its calls. Settling by this watermark instead of the clock waits for them.
    """
    mark = now
    for topic in sources:
        position, end, last_time = source_position(TP(topic, partition), read, consumer)
        if end is None or position < end:
            mark = min(mark, last_time)
    return mark


def source_position(tp: TP, read: dict[TP, tuple[int, int]], consumer) -> tuple[int, int | None, int]:
    """(next offset to handle, the log's end as last fetched, time of the last event handled)."""
    last = read.get(tp)
    if last is not None:
        return last[0] + 1, consumer.highwater(tp), last[1]
    # nothing handled since the partition was assigned: the consumer's start (the committed offset)
    return consumer._read_offset.get(tp) or 0, consumer.highwater(tp), 0


def changelog_specs(app: faust.App, settings: StreamsSettings) -> list[TopicSpec]:
    """The tables' changelog topics, to create before the worker starts.

    Faust creates them itself on start, but its consumer may not have their metadata yet when the
    first event arrives, and a table write then fails (PartitionsMismatch: '0 partitions').
    """
    specs = []
    for table in app.tables.values():
        expires = table.window.expires if table.window else None
        specs.append(TopicSpec(
            table.changelog_topic.get_topic_name().removeprefix(settings.topic_prefix), table.partitions,
            retention_ms=int(expires * 1000) if expires else FOREVER,
            cleanup_policy="compact,delete" if expires else "compact", key="table key"))
    return specs


def ticks_spec(settings: StreamsSettings, partitions: int) -> TopicSpec:
    """The worker's own topic of nudges to settle due attempts (co-partitioned with the sources)."""
    return TopicSpec(f"{settings.app_id}-ticks", partitions, retention_ms=3_600_000, key="none")


def ticks_topic(settings: StreamsSettings) -> str:
    return settings.topics.name(ticks_spec(settings, 0).base)


def window_view(table, size: int) -> list[dict]:
    """The local windows, newest first: per window and (model, weight version), the partitions merged."""
    merged: dict[tuple[float, str, str], list[dict]] = {}
    for (key, (start, _end)), value in list(table.data.items()):
        model, version, _partition = key.split("|")
        merged.setdefault((start, model, version), []).append(value)
    rows = [{"window_start": int(start * 1000), "window_s": size, "model": model or None,
             "weight_version": int(version) if version else None, **analytics.summary(analytics.merge(values))}
            for (start, model, version), values in merged.items()]
    return sorted(rows, key=lambda row: (-row["window_start"], row["model"] or "", row["weight_version"] or -1))

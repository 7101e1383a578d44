"""The Faust application: trajectory assembly and windowed analytics over the log.

    rollouts ┐
    calls    ├─▶ assemble ─(table: rollouts, events, positions)─▶ trajectories, rewards, deadletter
    rewards  ┘       ▲
    ticks ───────────┘   (the timer's nudge: an attempt of this partition is due)

    calls, trajectories ─▶ analyse ─(tumbling windowed tables)─▶ metrics topic, GET /analytics

All rollout-scoped topics share one partition count, so each agent reads a rollout's events from
one partition, and each table key is written from one partition: the changelogs are
co-partitioned with the sources and a rebalance moves state with its partition.

Settling is time-driven, but a Faust table can only be changed while an agent handles an event
of the key's partition. Due attempts are settled after each event of their partition; for a
quiet partition the timer sends a tick to the worker's own `ticks` topic, and the assembly agent
settles when the tick arrives.

Exactly-once handling of the sources does not rest on Faust's offset commits. The assembly's
table records, per source partition, the next offset it will handle, in the same changelog
partition as the state those events built, written in order after it: whatever prefix of that
changelog a crash leaves, the position restored is never ahead of the state. A record delivered
again is skipped, one the state already holds is a duplicate by id, and a record delivered after
a gap (Faust committed past the restored position, or faust-streaming 0.15.3 dropped records
around a restart) makes the worker read the partition again from the gap. So changes need no
acknowledgement one by one: they flow, batched by the producer, and the agent waits only when
too many are on their way. Trajectories and computed rewards are published, and acknowledged,
before the state marks their attempt settled, and their ids derive from the attempt: a crash
repeats them at worst, and consumers drop the repeat. Analytics are at-least-once: a view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, MutableMapping
from datetime import timedelta
from typing import Any

import faust
from aiokafka.errors import KafkaError
from faust.exceptions import ProducerSendError
from faust.types import TP
from faust.web import Request, Response, View

from schemas.codec import DecodeError, decode, encode
from schemas.events import CallEvent, Deadletter, DeadletterEvent, Event, Metrics, MetricsEvent, TrajectoryEvent
from schemas.ids import derived_id, now_ms
from schemas.kafka import deadletter_event
from schemas.topics import FOREVER, TopicSpec

from streams import analytics
from streams.assembly import Assembly, Settled
from streams.settings import StreamsSettings

log = logging.getLogger("streams")
ASSEMBLED = ("rollouts", "calls", "rewards")
ANALYSED = ("calls", "trajectories")
RAW = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
STALL_S = 10.0
"""the assembly idle this long while behind a source partition's end: read it again"""
RESEEK_S = 5.0
"""a gap still open this long after its seek: seek again"""
UNACKNOWLEDGED_MAX = 2000
"""table changes on their way to the broker before the assembly waits for them"""


def create_app(settings: StreamsSettings, partitions: int) -> faust.App:
    """The worker's app; `partitions` is the rollout-scoped topics' partition count."""
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
    out = {base: app.topic(settings.topics.name(base), **RAW)
           for base in ("trajectories", "rewards", "deadletter", "metrics")}

    async def publish(topic: str, event: Event, now: bool = False):
        """Send as part of handling the current event (at its commit), or `now`: the broker's ack is
        then the returned future."""
        return await out[topic].send(key=event.key, value=encode(event), force=now)

    assembly_view = add_assembly(app, settings, partitions, publish)
    windows_view = add_analytics(app, settings, partitions, publish)

    @app.page("/analytics")
    class AnalyticsView(View):
        async def get(self, request: Request) -> Response:
            return self.json({**assembly_view(), "windows": windows_view()})

    return app


# --- assembly ----------------------------------------------------------------------------------


def add_assembly(app: faust.App, settings: StreamsSettings, partitions: int, publish) -> Callable[[], dict]:
    """The assembly agent, its table and timers; returns the function that describes its state."""
    topics = settings.topics
    sources = [topics.name(base) for base in ASSEMBLED]
    ticks_name = ticks_topic(settings)
    ticks = app.topic(ticks_name, **RAW)
    table = app.tables.add(DurableTable(app, name="assembly", partitions=partitions))
    # one table, so that a partition's state, its events and its position share one ordered changelog
    assembly = Assembly(Keyspace(table, "r:"), Keyspace(table, "e:", bytes.decode, str.encode),
                        settings.timing, settings.source)
    positions = Keyspace(table, "p:")
    """'topic:partition' → the next offset of that source partition to handle"""
    counts: Counter[str] = Counter()
    """what the worker itself dropped, deadlettered or read again (the assembly counts the rest)"""
    last_time: dict[TP, int] = {}
    """source partition → the latest event time handled (since it was assigned)"""
    gaps: dict[TP, float] = {}
    """source partition → when it was last sought back to a gap (monotonic)"""
    ticking: dict[int, float] = {}
    """partition → when its tick was sent (monotonic), until the agent handles it"""
    handled_at = [time.monotonic()]

    @table.on_recover
    async def index_recovered_state() -> None:
        assembly.reindex()
        log.info("state recovered: %d keys", len(table))

    def position(tp: TP) -> tuple[int, int | None]:
        """(next offset to handle, the log's end as last fetched) of a source partition."""
        start = positions.get(f"{tp.topic}:{tp.partition}")
        if start is None:  # never handled: where the consumer started reading
            start = app.consumer._read_offset.get(tp) or 0
        return start, app.consumer.highwater(tp)

    def watermark(partition: int) -> int:
        """The event time up to which attempts of `partition` may settle: now, once every source
        topic's partition has been handled to its end; else the time of the last event handled from
        the one behind. Faust reads the three topics side by side, not in the order they were
        written, so a worker catching up may see an attempt's finish before its calls."""
        mark = now_ms()
        for topic in sources:
            tp = TP(topic, partition)
            start, end = position(tp)
            if end is None or start < end:
                mark = min(mark, last_time.get(tp, 0))
        return mark

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

    async def settle_due(partition: int) -> None:
        now = watermark(partition)
        for rollout_id in assembly.due(now, [partition]):
            await emit(assembly.settle(rollout_id, now))

    async def deadletter(message, kind: str | None, reason: str) -> None:
        if kind:
            counts[kind] += 1
        event = deadletter_event(message, reason, settings.source)
        event.id = derived_id("streams.deadletter", message.topic, str(message.partition), str(message.offset))
        await (await publish("deadletter", event, now=True))  # in the log before the position passes the record

    async def in_order(message) -> bool:
        """Whether this record is the next of its partition; after a gap, read it again from there."""
        expected = positions.get(f"{message.topic}:{message.partition}")
        if expected is None or message.offset == expected:
            return True
        if message.offset < expected:
            counts["redelivered"] += 1
        elif time.monotonic() - gaps.get(message.tp, -1e9) > RESEEK_S:
            log.warning("%s:%d: record %d arrived before %d: reading the partition again from %d",
                        message.topic, message.partition, message.offset, expected, expected)
            counts["gaps"] += 1
            gaps[message.tp] = time.monotonic()
            await app.consumer.seek(message.tp, expected)
        return False

    async def handle(message) -> None:
        if message.topic == ticks_name:
            ticking.pop(message.partition, None)
            return await settle_due(message.partition)
        if not await in_order(message):
            return
        gaps.pop(message.tp, None)
        try:
            await assemble_one(message)
        except (KafkaError, ProducerSendError):
            raise
        except Exception as exc:  # a bug meeting an odd event: set the event aside, keep going
            log.exception("the assembly failed on %s:%d@%d", message.topic, message.partition, message.offset)
            await deadletter(message, "failed", f"the assembly failed on this event: {type(exc).__name__}: {exc}")
        positions[f"{message.topic}:{message.partition}"] = message.offset + 1
        await settle_due(message.partition)  # while events flow, no tick is needed

    async def assemble_one(message) -> None:
        try:
            event = decode(message.value)
        except DecodeError as exc:
            return await deadletter(message, "undecodable", f"undecodable: {exc}")
        last_time[message.tp] = max(last_time.get(message.tp, 0), event.time)
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

    @app.agent(app.topic(*sources, ticks_name, **RAW), name="assemble")
    async def assemble(stream):
        async for record in stream.events():
            message = record.message
            handled_at[0] = time.monotonic()
            try:
                await handle(message)
                if table.unacknowledged > UNACKNOWLEDGED_MAX:
                    await table.written()
            except (KafkaError, ProducerSendError) as exc:
                # nothing is recorded past this event: the next worker handles it again
                await app.crash(exc)
                raise
            except Exception:  # settling failed (a bug): the attempts stay due and are tried again
                log.exception("settling after %s:%d@%d failed", message.topic, message.partition, message.offset)

    @app.on_partitions_revoked.connect
    async def forget_partitions(app, revoked, **kwargs) -> None:
        for tp in revoked:
            last_time.pop(tp, None)
            gaps.pop(tp, None)

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

    @app.timer(interval=STALL_S / 2)
    async def watchdog() -> None:
        """Read again a source partition the worker is behind on but no longer receives records of
        (records dropped at its end, where no later record shows the gap)."""
        if time.monotonic() - handled_at[0] < STALL_S:
            return
        for partition in active_partitions():
            for topic in sources:
                tp = TP(topic, partition)
                start, end = position(tp)
                if end is not None and start < end:
                    log.warning("%s:%d stalled at offset %d of %d: reading it again from there", topic, partition,
                                start, end)
                    counts["stalls"] += 1
                    await app.consumer.seek(tp, start)
                    handled_at[0] = time.monotonic()

    def describe() -> dict:
        actives = sorted(active_partitions())
        return {
            "assembly": {**assembly.counts, **counts, "partitions": actives},
            "sources": {f"{topic}:{p}": position(TP(topic, p)) for p in actives for topic in sources},
        }

    return describe


class DurableTable(faust.Table):
    """A table whose changes can be awaited until the broker has them.

    faust-streaming 0.15.3 commits a source offset after `producer.flush()`, but its buffer's flush
    returns while a changelog message is still on its way to the client (the one being handed over,
    or any after 0.1 s without progress). So the assembly does not rely on those commits (see the
    module's docstring); it awaits its changes only to bound how many are on their way.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._unacknowledged: list[asyncio.Future] = []

    @property
    def unacknowledged(self) -> int:
        return len(self._unacknowledged)

    def send_changelog(self, *args, **kwargs):
        sent = super().send_changelog(*args, **kwargs)
        self._unacknowledged.append(sent)
        return sent

    async def written(self) -> None:
        pending, self._unacknowledged = self._unacknowledged, []
        if pending:
            await asyncio.gather(*pending)


class Keyspace(MutableMapping):
    """The keys of a table that start with `prefix`, as a mapping of their own."""

    def __init__(self, table: MutableMapping, prefix: str, encode: Callable[[Any], Any] | None = None,
                 decode: Callable[[Any], Any] | None = None):
        self.table = table
        self.prefix = prefix
        self.encode = encode
        self.decode = decode

    def __getitem__(self, key: str) -> Any:
        value = self.table[self.prefix + key]
        return self.decode(value) if self.decode else value

    def __setitem__(self, key: str, value: Any) -> None:
        self.table[self.prefix + key] = self.encode(value) if self.encode else value

    def __delitem__(self, key: str) -> None:
        del self.table[self.prefix + key]

    def __iter__(self) -> Iterator[str]:
        cut = len(self.prefix)
        return (key[cut:] for key in list(self.table.keys()) if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


# --- analytics ---------------------------------------------------------------------------------


def add_analytics(app: faust.App, settings: StreamsSettings, partitions: int, publish) -> Callable[[], dict]:
    """The analytics agent, its windowed tables and the metrics timer; returns the windows' view."""
    topics = settings.topics
    windows = {size: app.Table(f"analytics-{size}s", default=dict, partitions=partitions)
               .tumbling(size, expires=timedelta(seconds=size * settings.window_history)).relative_to_stream()
               for size in settings.windows_s}
    changed: set[tuple[int, str, tuple[float, float]]] = set()

    @app.agent(app.topic(*(topics.name(base) for base in ANALYSED), **RAW), name="analyse")
    async def analyse(stream):
        async for record in stream.events():
            message = record.message
            try:
                event = decode(message.value)
            except DecodeError:
                continue  # the assembly agent deadletters what it reads; trajectories are ours
            if isinstance(event, CallEvent):
                key = group_key(event.data.model, event.data.weight_version, message.partition)
                add = analytics.add_call
            elif isinstance(event, TrajectoryEvent):
                key = group_key(event.data.model, wrote_it(event), message.partition)
                add = analytics.add_trajectory
            else:
                continue
            for size, table in windows.items():
                table[key] = add(table[key].current(), event.data)
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

    return lambda: {str(size): window_view(windows[size].table, size) for size in windows}


def group_key(model: str | None, version: int | None, partition: int) -> str:
    return f"{model or ''}|{'' if version is None else version}|{partition}"


def wrote_it(event: TrajectoryEvent) -> int | None:
    """The weight version a trajectory is credited to: the oldest that generated one of its turns."""
    versions = [turn.weight_version for turn in event.data.turns if turn.weight_version is not None]
    return min(versions) if versions else None


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


# --- topics ------------------------------------------------------------------------------------


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

"""The Faust application: trajectory assembly and windowed analytics over the log.

    rollouts ┐
    calls    ├─▶ Inbox (transport.py) ─▶ AssemblyWorker (worker.py; table: tables.py) ─▶ trajectories, rewards, deadletter
    rewards  ┘

    the calls it reads, the trajectories it emits ─▶ Windows (windows.py) ─▶ metrics topic, GET /analytics

All rollout-scoped topics share one partition count, so a worker reads a rollout's events from
one partition, and each table key is written from one partition: the changelogs are
co-partitioned with the sources and a rebalance moves state with its partition. Analytics are
at-least-once: a view.
"""

from __future__ import annotations

from collections.abc import Awaitable
from time import monotonic
from typing import Any

import faust
from aiokafka.helpers import create_ssl_context
from faust.sensors import Monitor
from faust.types import TP, EventT, Message, ProducerT, RecordMetadata, StreamT, TopicT
from faust.types.auth import CredentialsT
from faust.types.tables import CollectionT
from faust.types.tuples import PendingMessage
from faust.web import Request, Response, View

from agentstream.schemas.codec import encode
from agentstream.schemas.events import Event, Metrics, MetricsEvent
from agentstream.schemas.topics import FOREVER, TopicSpec
from agentstream.streams.settings import StreamsSettings
from agentstream.streams.transport import Transport
from agentstream.streams.windows import Windows, parse
from agentstream.streams.worker import ASSEMBLED, AssemblyWorker


def raw_topic(app: faust.App, *names: str) -> TopicT:
    """The topics `names` as Faust sees them: keys and values the bytes as stored (the events' JSON)."""
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


class QuietMonitor(Monitor):
    """Faust's Monitor without its per-record bookkeeping, which costs a catching-up worker a share of its CPU.

    Nothing here reads those figures (no statsd, `/analytics` is the worker's own, Faust's
    `/stats` and `/performance` views are off); what Faust itself reads of the monitor stays: the
    time a partition's stream last took an event (its "stream idle" warnings), end offsets, commits.
    """

    def on_message_in(self, tp: TP, offset: int, message: Message) -> None:
        pass

    def on_stream_event_in(self, tp: TP, offset: int, stream: StreamT[Any], event: EventT[Any]) -> None:
        self.stream_inbound_time[tp] = monotonic()

    def on_stream_event_out(self, tp: TP, offset: int, stream: StreamT[Any], event: EventT[Any],
                            state: dict[Any, Any] | None = None) -> None:
        pass

    def on_message_out(self, tp: TP, offset: int, message: Message) -> None:
        pass

    def on_send_initiated(self, producer: ProducerT, topic: str, message: PendingMessage, keysize: int,
                          valsize: int) -> None:
        pass

    def on_send_completed(self, producer: ProducerT, state: Any, metadata: RecordMetadata) -> None:
        pass

    def on_table_get(self, table: CollectionT, key: Any) -> None:
        pass

    def on_table_set(self, table: CollectionT, key: Any, value: Any) -> None:
        pass

    def on_table_del(self, table: CollectionT, key: Any) -> None:
        pass


class Streams:
    """What the app's task, timer, signal receiver and view share: the output topics, the windows, the worker.

    Made with the app, before it starts: it sets the app's transport and claims the sources for the worker.
    """

    def __init__(self, app: faust.App, settings: StreamsSettings, partitions: int):
        self.app = app
        self.settings = settings
        # Faust's Kafka transport, but the sources' records handed over in batches (transport.py); set
        # before anything creates the consumer (the `transport` setter is App's own)
        transport = app.transport = Transport(app.conf.broker_consumer, app)
        self.out = {base: raw_topic(app, settings.topics.name(base))
                    for base in ("trajectories", "rewards", "deadletter", "metrics")}
        self.windows = Windows(app, settings.windows_s, settings.window_history, partitions)
        sources = [settings.topics.name(base) for base in ASSEMBLED]
        # the sources' records go to the worker in batches, not through a stream (transport.py); the topic is
        # still Faust's to subscribe to, and the worker pauses a partition as a stream's full buffer would
        inbox = transport.claim(sources, high=app.conf.stream_buffer_maxsize)
        app.topics.add(raw_topic(app, *sources))
        self.worker = AssemblyWorker(app, settings, partitions, self.send, self.windows, inbox)

    async def publish(self, topic: str, event: Event, now: bool = False) -> Awaitable[RecordMetadata]:
        """Send as part of handling the current event (at its commit), or `now`: the broker's ack is
        then the returned future."""
        return await self.out[topic].send(key=event.key, value=encode(event), force=now)

    async def send(self, topic: str, event: Event) -> Awaitable[RecordMetadata]:
        """Straight to the producer (Faust's topic `send` yields to the loop on every record): the
        broker's ack is the returned future."""
        return await self.app.producer.send(self.settings.topics.name(topic), event.key, encode(event),
                                            partition=None, timestamp=None, headers=None)


class StreamsApp(faust.App):
    """Faust's App, holding the parts its task, timer, signal receiver and view share."""

    streams: Streams


def streams_of(app: Any) -> Streams:
    assert isinstance(app, StreamsApp)
    return app.streams


async def start_worker(app: faust.App) -> None:
    """The worker's timers start once the tables are recovered, as Faust's own do."""
    await app.add_runtime_dependency(streams_of(app).worker)


async def forget_partitions(app: faust.App, revoked: set[TP], **kwargs: Any) -> None:
    await streams_of(app).worker.revoked(revoked)


async def publish_metrics(app: faust.App) -> None:
    """The windows changed since the last run, to the metrics topic."""
    streams = streams_of(app)
    for size, key, value in streams.windows.unpublished():
        model, version, partition, start = parse(key)
        await streams.publish("metrics", MetricsEvent(source=streams.settings.source, data=Metrics(
            window_s=size, window_start=int(start * 1000),
            group={"model": model, "weight_version": version, "partition": partition}, values=value)))


class AnalyticsView(View):
    """The worker's counters, partitions and source positions, and the windows (`?open=1`: also the
    attempts not settled yet)."""

    async def get(self, request: Request) -> Response:
        streams = streams_of(self.app)
        view = streams.worker.describe(open_attempts=request.query.get("open") == "1")
        return self.json({**view, "windows": streams.windows.view()})


routes: list[tuple[str, type[View]]] = [
    ("/analytics", AnalyticsView),
]


def create_app(settings: StreamsSettings, partitions: int) -> faust.App:
    """The worker's app; `partitions` is the rollout-scoped topics' partition count."""
    app = StreamsApp(settings.group_id, **faust_settings(settings, partitions))
    app.streams = Streams(app, settings, partitions)
    app.task(start_worker)
    # faust types a receiver as taking any positional arguments; this signal sends one, the revoked partitions
    app.on_partitions_revoked.connect(forget_partitions)  # type: ignore[arg-type]
    app.timer(interval=settings.metrics_interval_s)(publish_metrics)
    for path, view in routes:
        app.page(path)(view)
    return app


def broker_credentials(settings: StreamsSettings) -> CredentialsT | None:
    """Faust's form of the settings' SASL/TLS (schemas.kafka.aiokafka_auth is the other services')."""
    protocol = settings.security_protocol
    context = create_ssl_context(cafile=settings.ssl_cafile or None) if protocol in ("SSL", "SASL_SSL") else None
    if protocol.startswith("SASL_"):
        return faust.SASLCredentials(username=settings.sasl_username, password=settings.sasl_password.get_secret_value(),
                                     mechanism=settings.sasl_mechanism, ssl_context=context)
    return faust.SSLCredentials(context) if context else None


def faust_settings(settings: StreamsSettings, partitions: int) -> dict[str, Any]:
    """Faust's settings for the worker's app."""
    return dict(
        broker=[f"kafka://{server.strip()}" for server in settings.bootstrap_servers.split(",")],
        broker_credentials=broker_credentials(settings),
        store="memory://",
        datadir=str(settings.data_dir),
        key_serializer="raw",
        value_serializer="raw",
        processing_guarantee="at_least_once",
        producer_acks=-1,
        producer_max_request_size=16 * 1024 * 1024,
        # a record joins the partition's open batch; with Faust's default (16 KiB, eight events or one
        # trajectory) a send waits for the broker's ack of the batch before it, at every few records
        producer_max_batch_size=1024 * 1024,
        consumer_max_fetch_size=16 * 1024 * 1024,
        # the worker's inbox pauses a partition's fetching once it holds stream_buffer_maxsize records;
        # what a fetch hands over past that still goes in: 500 records a fetch (Faust's default is
        # unbounded, up to 16 MiB a partition)
        broker_max_poll_records=500,
        stream_buffer_maxsize=8192,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
        # a worker that died is noticed (and its partitions handed on) after this long
        broker_session_timeout=10.0,
        broker_heartbeat_interval=2.0,
        topic_partitions=partitions,
        topic_replication_factor=settings.replication_factor,
        table_standby_replicas=settings.standby_replicas,
        topic_allow_declare=True,
        web_bind=settings.web_host,
        web_host=settings.web_host,
        web_port=settings.web_port,
        web_enabled=True,
        Monitor=QuietMonitor,
    )


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

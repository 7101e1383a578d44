"""The Faust application: trajectory assembly and windowed analytics over the log.

    rollouts ┐
    calls    ├─▶ assemble ─▶ AssemblyWorker (worker.py; table: tables.py) ─▶ trajectories, rewards, deadletter
    rewards  ┘

    the calls it reads, the trajectories it emits ─▶ Windows (windows.py) ─▶ metrics topic, GET /analytics

All rollout-scoped topics share one partition count, so each agent reads a rollout's events from
one partition, and each table key is written from one partition: the changelogs are
co-partitioned with the sources and a rebalance moves state with its partition. Analytics are
at-least-once: a view.
"""

from __future__ import annotations

import faust
from faust.web import Request, Response, View

from schemas.codec import encode
from schemas.events import Event, Metrics, MetricsEvent
from schemas.topics import FOREVER, TopicSpec

from streams.settings import StreamsSettings
from streams.windows import Windows, parse
from streams.worker import ASSEMBLED, AssemblyWorker

RAW = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


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
        # a record joins the partition's open batch; with Faust's default (16 KiB, eight events or one
        # trajectory) a send waits for the broker's ack of the batch before it, at every few records
        producer_max_batch_size=1024 * 1024,
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

    async def send(topic: str, event: Event):
        """Straight to the producer (Faust's topic `send` yields to the loop on every record): the
        broker's ack is the returned future."""
        return await app.producer.send(settings.topics.name(topic), event.key, encode(event), partition=None,
                                       timestamp=None, headers=None)

    windows = Windows(app, settings.windows_s, settings.window_history, partitions)
    worker = AssemblyWorker(app, settings, partitions, send, windows)

    @app.agent(app.topic(*worker.sources, **RAW), name="assemble")
    async def assemble(stream):
        async for record in stream.events():  # acknowledged at once: the table holds the positions
            await worker.add(record)

    @app.task
    async def start_worker() -> None:  # its timers start once the tables are recovered, as Faust's own do
        await app.add_runtime_dependency(worker)

    @app.on_partitions_revoked.connect
    async def forget_partitions(app, revoked, **kwargs) -> None:
        await worker.revoked(revoked)

    add_metrics(app, settings, windows, publish)

    @app.page("/analytics")
    class AnalyticsView(View):
        async def get(self, request: Request) -> Response:
            view = worker.describe(open_attempts=request.query.get("open") == "1")
            return self.json({**view, "windows": windows.view()})

    return app


# --- analytics ---------------------------------------------------------------------------------


def add_metrics(app: faust.App, settings: StreamsSettings, windows: Windows, publish) -> None:
    """The timer that publishes the windows changed since its last run to the metrics topic."""

    @app.timer(interval=settings.metrics_interval_s)
    async def publish_metrics() -> None:
        for size, key, value in windows.unpublished():
            model, version, partition, start = parse(key)
            await publish("metrics", MetricsEvent(source=settings.source, data=Metrics(
                window_s=size, window_start=int(start * 1000),
                group={"model": model, "weight_version": version, "partition": partition}, values=value)))


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

"""`agentstream top`: the streams' windowed analytics and the pool's pauses, live in the terminal.

The streams worker publishes, for each window and (model, weight version, partition), mergeable
aggregates to the `metrics` topic, again whenever the window changes: the latest event of a window
holds its whole count. This view keeps the latest of each, merges partitions (and, per window,
models and versions) with `streams.analytics.merge`, and reads them with `summary`. Pool updates
come from the `pool` topic.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, get_args

import orjson
import polars as pl
from agentstream_native import Decoder
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agentstream.logs.repeats import Repeats
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.errors import LogUnavailable
from agentstream.schemas.events import Event, MetricsEvent, PoolUpdate, PoolUpdateEvent
from agentstream.schemas.kafka import KafkaSettings, make_consumer, partitions_of
from agentstream.schemas.scan import Bounds, Fetch, plan_scan, scan_fetches
from agentstream.schemas.shapes import shape
from agentstream.streams.analytics import merge, summary

WINDOWS_SHOWN = 10
POOL_SHOWN = 8
_METRICS, _POOL = shape(MetricsEvent, tagged=True), shape(PoolUpdateEvent, tagged=True)
"""as `decode` reads any event: the `type` key names the model"""
_METRICS_COLUMNS = Decoder([("id", ["id"], "str"), ("time", ["time"], "int"),
                            ("window_s", ["data", "window_s"], "int"), ("window_start", ["data", "window_start"], "int"),
                            ("group", ["data", "group"], "json"), ("values", ["data", "values"], "json")])
"""a metrics event's columns: its group and values as their JSON text, read whole only where needed"""
_POOL_FLOATS = frozenset(name for name, info in PoolUpdate.model_fields.items() if float in (info.annotation,
                                                                                             *get_args(info.annotation)))


@dataclass
class TopView:
    windows: dict[tuple[int, int, tuple[tuple[str, str], ...]], dict[str, float]] = field(default_factory=dict)
    """(window size, window start, group) → the latest aggregate published for it"""
    pool: deque[tuple[int, PoolUpdate]] = field(default_factory=lambda: deque(maxlen=200))
    last_event_ms: int | None = None
    repeats: Repeats = field(default_factory=Repeats)

    def add_all(self, batch: list[bytes | None] | Fetch) -> None:
        """A batch of records, in order, as `add` would take each. A batch of metrics events that all fit
        their shape (checked natively, as strictly as pydantic) is read into columns; otherwise those that
        fit the metrics or pool event's shape are read with orjson, no pydantic model each, and any other
        as `add` reads it."""
        if not len(batch):
            return
        not_metrics = _METRICS.misfits_fetched(batch.taken) if isinstance(batch, Fetch) else _METRICS.misfits(batch)
        if not not_metrics:
            self._add_metrics(batch)
            return
        values = [message.value() for message in batch.messages] if isinstance(batch, Fetch) else batch
        neither = {not_metrics[i] for i in _POOL.misfits([values[i] for i in not_metrics])}
        not_metrics_set = set(not_metrics)
        for i, raw in enumerate(values):
            if i in neither or raw is None:
                self.add(raw)
            else:
                self._add_fitting(orjson.loads(raw), metrics=i not in not_metrics_set)

    def _add_metrics(self, batch: list[bytes | None] | Fetch) -> None:
        """Metrics events that fit their shape, in columns: of the windows published again and again, only
        the latest of each is read whole (its values), and the windows new to the view are added in the
        order they first came (as one by one: the merges add in that order)."""
        found, _ = (_METRICS_COLUMNS.decode_fetched(batch.taken) if isinstance(batch, Fetch) else
                    _METRICS_COLUMNS.decode([("", 0, 0, 0, None, value) for value in batch]))
        frame = pl.DataFrame(found)
        frame = frame.filter(pl.Series([self.repeats.first(event_id) for event_id in frame["id"].to_list()]))
        if not frame.height:
            return
        frame = frame.with_columns(pl.col("group").fill_null("{}"))  # (left out: its default)
        # a group as its sorted items, whatever the order of its keys in the text: each text read once
        named = {text: tuple(sorted(orjson.loads(text).items())) for text in frame["group"].unique().to_list()}
        canonical = {text: orjson.dumps(group).decode() for text, group in named.items()}
        groups = {canonical[text]: group for text, group in named.items()}
        frame = frame.with_columns(pl.col("group").replace_strict(canonical, return_dtype=pl.String))
        latest = frame.group_by("window_s", "window_start", "group", maintain_order=True).agg(pl.col("values").last())
        for size, start, group, text in latest.iter_rows():
            self.windows[size, start, groups[group]] = {name: float(v) for name, v in orjson.loads(text).items()}
        newest: int = frame.select(pl.col("time").max()).item()
        self.last_event_ms = max(self.last_event_ms or 0, newest)

    def _add_fitting(self, event: dict[str, Any], metrics: bool) -> None:
        """An event that fits its model's shape, as orjson reads it: its floats as pydantic makes them."""
        if not self.repeats.first(event["id"]):
            return
        data = event["data"]
        if metrics:
            group = data.get("group", {})
            self.windows[data["window_s"], data["window_start"], tuple(sorted(group.items()))] = {
                name: float(value) for name, value in data["values"].items()}
        else:
            fields: dict[str, Any] = {name: float(value) if name in _POOL_FLOATS and value is not None else value
                                      for name, value in data.items()}
            self.pool.append((event["time"], PoolUpdate.model_construct(**fields)))
        self.last_event_ms = max(self.last_event_ms or 0, event["time"])

    def add(self, raw: bytes | None) -> None:
        if raw is None:  # a tombstone: no event
            return
        try:
            event: Event = decode(raw)
        except DecodeError:
            return
        if not self.repeats.first(event.id):
            return
        if isinstance(event, MetricsEvent):
            m = event.data
            self.windows[m.window_s, m.window_start, tuple(sorted(m.group.items()))] = m.values
        elif isinstance(event, PoolUpdateEvent):
            self.pool.append((event.time, event.data))
        else:
            return
        self.last_event_ms = max(self.last_event_ms or 0, event.time)

    def sizes(self) -> list[int]:
        return sorted({size for size, _, _ in self.windows})

    def by_window(self, size: int) -> list[dict[str, Any]]:
        """Per window (newest first), everything merged: the stream's throughput and latency."""
        merged: dict[int, list[dict[str, float]]] = {}
        for (s, start, _), values in self.windows.items():
            if s == size:
                merged.setdefault(start, []).append(values)
        rows: list[dict[str, Any]] = []
        for start in sorted(merged, reverse=True):
            total = merge(merged[start])
            rows.append({"window_start": start, **summary(total),
                         "calls_per_s": total.get("calls", 0) / size, "tokens_out_per_s": total.get("tokens_out", 0) / size})
        return rows

    def by_version(self, size: int) -> list[dict[str, Any]]:
        """Per (model, weight version), every window of one size merged: reward and latency by version."""
        merged: dict[tuple[str, str], list[dict[str, float]]] = {}
        for (s, _, group), values in self.windows.items():
            if s == size:
                g = dict(group)
                merged.setdefault((g.get("model", ""), g.get("weight_version", "")), []).append(values)
        def order(key: tuple[str, str]) -> tuple[str, int]:
            return key[0], int(key[1]) if key[1].lstrip("-").isdigit() else -1
        return [{"model": model or None, "weight_version": version or None, **summary(merge(merged[model, version]))}
                for model, version in sorted(merged, key=order)]


def render(view: TopView, size: int | None, title: str) -> Group:
    sizes = view.sizes()
    size = size if size is not None else (sizes[0] if sizes else None)
    updated = _clock(view.last_event_ms) if view.last_event_ms else "never"
    parts: list[RenderableType] = [Text(f"{title} · windows of {size or '?'} s (published: {', '.join(map(str, sizes)) or 'none'}) "
                        f"· latest event {updated}", style="bold")]
    if size is None or size not in sizes:
        parts.append(Text("No metrics yet: is a streams worker running (agentstream streams) with this prefix?"
                          if not sizes else f"No {size} s windows; published sizes: {', '.join(map(str, sizes))}",
                          style="yellow"))
    else:
        parts += [_windows_table(view.by_window(size)[:WINDOWS_SHOWN], size), _versions_table(view.by_version(size))]
    parts.append(_pool_table(list(view.pool)[-POOL_SHOWN:][::-1]))
    return Group(*parts)


def _windows_table(rows: list[dict[str, Any]], size: int) -> Table:
    table = Table(title=f"Throughput and latency per {size} s window (newest first; the first may be filling)",
                  title_justify="left")
    for name in ("window", "calls/s", "tokens out/s", "errors", "latency p50 ms", "p99 ms", "ttft p50 ms",
                 "trajectories", "reward mean"):
        table.add_column(name, justify="left" if name == "window" else "right")
    for r in rows:
        table.add_row(_clock(r["window_start"]), _num(r["calls_per_s"]), _num(r["tokens_out_per_s"]),
                      f"{r['errors']:.0f} ({_pct(r['error_rate'])})", _num(r["latency_p50_ms"]),
                      _num(r["latency_p99_ms"]), _num(r["ttft_p50_ms"]), f"{r['trajectories']:.0f}",
                      _num(r["reward_mean"], 3))
    return table


def _versions_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Reward by weight version (the history shown)", title_justify="left")
    for name in ("model", "version", "trajectories", "rewarded", "reward mean", "reward missing", "calls",
                 "errors", "latency p50 ms"):
        table.add_column(name, justify="left" if name == "model" else "right")
    for r in rows:
        table.add_row(r["model"] or "-", r["weight_version"] or "-", f"{r['trajectories']:.0f}",
                      f"{r['rewarded']:.0f}", _num(r["reward_mean"], 3), f"{r['reward_missing']:.0f}",
                      f"{r['calls']:.0f}", _pct(r["error_rate"]), _num(r["latency_p50_ms"]))
    return table


def _pool_table(updates: Iterable[tuple[int, PoolUpdate]]) -> Table:
    table = Table(title="Pool updates (newest first): how long each server paused", title_justify="left")
    for name in ("time", "model", "version", "server", "status", "pause ms", "load ms", "held ms"):
        table.add_column(name, justify="right" if name.endswith("ms") or name == "version" else "left")
    for at, u in updates:
        status = u.status if u.status == "ok" else f"[red]{u.status}[/red] {u.error or ''}"
        table.add_row(_clock(at), u.model, str(u.version), u.server, status, _num(u.pause_ms), _num(u.load_ms),
                      _num(u.held_ms))
    return table


def _clock(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S")


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


# --- reading -------------------------------------------------------------------------------------


def _topics(settings: KafkaSettings) -> list[str]:
    return [settings.topics.metrics, settings.topics.pool]


async def show_once(settings: KafkaSettings, since_ms: int, size: int | None, console: Console) -> TopView:
    """Read both topics from `since_ms` to their current end and print the view."""
    view = TopView()
    for topic in _topics(settings):
        plan = await plan_scan(settings, topic, Bounds(since_ms=since_ms))
        async for fetch in scan_fetches(settings, topic, plan.tail):
            view.add_all(fetch)
    console.print(render(view, size, f"agentstream top · {settings.topic_prefix or '(no prefix)'}"))
    return view


async def show_live(settings: KafkaSettings, since_ms: int, size: int | None, refresh_s: float,
                    console: Console) -> None:
    """Follow both topics from `since_ms` and redraw every `refresh_s` until interrupted."""
    partitions = [tp for topic in _topics(settings) for tp in await partitions_of(settings, topic)]
    if not partitions:
        raise LogUnavailable(f"no metrics or pool topic under prefix {settings.topic_prefix!r} on "
                          f"{settings.bootstrap_servers}; check --topic-prefix")
    view = TopView()
    title = f"agentstream top · {settings.topic_prefix or '(no prefix)'} · Ctrl-C to quit"
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        consumer.assign(partitions)
        found = await consumer.offsets_for_times({tp: since_ms for tp in partitions})
        ends = await consumer.end_offsets(partitions)
        for tp in partitions:
            consumer.seek(tp, found[tp].offset if found[tp] else ends[tp])
        with Live(render(view, size, title), console=console, auto_refresh=False) as live:
            loop = asyncio.get_running_loop()
            while True:
                deadline = loop.time() + refresh_s
                while (left := deadline - loop.time()) > 0:
                    for records in (await consumer.getmany(timeout_ms=int(left * 1000), max_records=5000)).values():
                        view.add_all([record.value for record in records])
                live.update(render(view, size, title), refresh=True)
    finally:
        await consumer.stop()

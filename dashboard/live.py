"""What the page hears live: a follower of the topics, fanned out to each open page's event stream.

From the log's end at start-up (the weights topic from its beginning: it is small, and the lineage
of every version answers "which version trained on this trajectory"), the follower counts records
per topic each second and turns lifecycle, trajectory, reward, weights and pool events into short
notices. Call events are counted, not decoded: they are most of the traffic and the page needs
only their rate. A page that reads too slowly loses old notices, never blocks the follower.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import (
    CallEvent,
    Event,
    PoolUpdateEvent,
    ReleaseEvent,
    RewardEvent,
    TrajectoryEvent,
    WeightsEvent,
)
from agentstream.schemas.kafka import KafkaSettings, make_consumer, partitions_of
from agentstream.schemas.releases import ReleaseKey, ReleaseState, fold
from agentstream.schemas.scan import Bounds, Record, resolve, scan

log = logging.getLogger("dashboard.live")
FOLLOWED = ("rollouts", "calls", "rewards", "trajectories", "weights", "pool", "releases")
RATE_WINDOW_S = 10
QUEUE = 1000


class Live:
    def __init__(self, settings: KafkaSettings):
        self.settings = settings
        self.subscribers: set[asyncio.Queue[dict[str, Any]]] = set()
        self.trained_by: dict[str, list[int]] = {}
        """trajectory event id → the weight versions that trained on it"""
        self.versions: dict[int, dict[str, Any]] = {}
        self.seconds: deque[tuple[int, dict[str, int]]] = deque(maxlen=RATE_WINDOW_S + 1)
        self.ready = asyncio.Event()
        self.releases: dict[ReleaseKey, ReleaseState] = {}
        """(model, tenant) -> its canary release, folded from the `releases` topic (history, then live)"""
        self.error: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="dashboard-live")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE)
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self.subscribers.discard(queue)

    def rates(self) -> dict[str, float]:
        """Records per second of each topic over the last full seconds."""
        now = int(time.time())
        full = [(second, counts) for second, counts in self.seconds if now - RATE_WINDOW_S <= second < now]
        totals: dict[str, float] = {base: 0.0 for base in FOLLOWED}
        for _, counts in full:
            for base, n in counts.items():
                totals[base] += n
        return {base: n / RATE_WINDOW_S for base, n in totals.items()}

    def _publish(self, notice: dict[str, Any]) -> None:
        for queue in list(self.subscribers):
            if queue.full():
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(notice)

    async def _follow(self) -> None:
        while True:
            try:
                await self._consume()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker went away: say so, try again
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("following the topics failed (%s); again in 2 s", self.error)
                await asyncio.sleep(2)

    async def _consume(self) -> None:
        names = {self.settings.topics.name(base): base for base in FOLLOWED}
        ends = {}  # the log's end now: where following starts
        for topic in names:
            if await partitions_of(self.settings, topic):  # (a topic not created yet is not followed)
                ends[topic] = {p: end for p, (_, end) in (await resolve(self.settings, topic)).items()}
        if not ends:
            raise LookupError(f"no topics under prefix {self.settings.topic_prefix!r}")
        for base in ("weights", "releases"):  # their history (versions, canaries), by the one bounded reader
            topic = self.settings.topics.name(base)
            if topic in ends:
                history = {p: (0, end) for p, end in ends[topic].items()}
                async for records in scan(self.settings, topic, Bounds.exactly(history, history)):
                    for record in records:
                        self._take(base, record, history=True)
        consumer = make_consumer(self.settings, group_id=None, max_poll_records=5000)
        await consumer.start()
        try:
            positions = {TopicPartition(topic, p): end for topic, of in ends.items() for p, end in of.items()}
            consumer.assign(list(positions))
            for tp, end in positions.items():
                consumer.seek(tp, end)
            self.error = None
            self.ready.set()
            while True:
                fetched = await consumer.getmany(timeout_ms=500, max_records=5000)
                for tp, records in fetched.items():
                    for record in records:
                        self._take(names[tp.topic], record)
        finally:
            await consumer.stop()

    def _take(self, base: str, record: ConsumerRecord | Record, history: bool = False) -> None:
        if not history:
            second = int(time.time())
            if not self.seconds or self.seconds[-1][0] != second:
                self.seconds.append((second, {}))
            counts = self.seconds[-1][1]
            counts[base] = counts.get(base, 0) + 1
        if base == "calls":
            return
        try:
            event: Event = decode(record.value or b"")
        except DecodeError:
            return
        if isinstance(event, WeightsEvent):
            w = event.data
            self.versions[w.version] = {"version": w.version, "base_version": w.base_version, "step": w.step,
                                        "time": event.time, "samples": len(w.lineage)}
            for trajectory_id in w.lineage:
                self.trained_by.setdefault(trajectory_id, []).append(w.version)
        if isinstance(event, ReleaseEvent):
            fold(self.releases, event)
        if not history:
            self._publish(notice(event, record))


def notice(event: Event, record: ConsumerRecord | Record) -> dict[str, Any]:
    """What the page shows of a new event in its live feed."""
    out = {"kind": "event", "type": event.type, "time": event.time, "rollout_id": event.rollout_id,
           "attempt_id": event.attempt_id, "partition": record.partition, "offset": record.offset,
           "topic_base": event.topic}
    if isinstance(event, TrajectoryEvent):
        t = event.data
        out.update(status=t.status, reward=t.reward, task_id=t.task_id, split=t.split,
                   weight_version=t.weight_version_launch,
                   generated=sum(sum(s.mask) for s in t.sequences))
    elif isinstance(event, RewardEvent):
        out.update(reward=event.data.value, reward_fn=event.data.reward_fn)
    elif isinstance(event, WeightsEvent):
        out.update(model=event.data.model, version=event.data.version, samples=len(event.data.lineage))
    elif isinstance(event, PoolUpdateEvent):
        p = event.data
        out.update(model=p.model, version=p.version, server=p.server, status=p.status, pause_ms=p.pause_ms)
    elif isinstance(event, ReleaseEvent):
        r = event.data
        out.update(model=r.model, version=r.version, action=r.action, p_value=r.p_value, decided_by=r.decided_by)
    elif isinstance(event, CallEvent):  # not followed; kept for completeness of the shape
        out.update(model=event.data.model)
    return out

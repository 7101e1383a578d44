"""The assembly worker: source records in, a batch at a time; trajectories, rewards and deadletters out.

    rollouts ┐
    calls    ├─▶ add ─(a batch)─▶ settle due attempts ─▶ decide ─▶ emit ─▶ flush (state, positions, windows)
    rewards  ┘                          ▲                                       (every --write-every-s)
              timer: the next due attempt, a batch no record ends, or every --tick-s

Exactly-once handling of the sources does not rest on Faust's offset commits. The table holds, per
source partition, the next offset to handle, in the same changelog partition as the state those
records built and written after it (`flush`): whatever prefix of that changelog a crash leaves,
the position restored is never ahead of the state. The changes are held and written every
`--write-every-s` (not at every batch end), so a key changed again meanwhile is written once, and the
events of an attempt that came and settled meanwhile not at all; a crash loses at most that much of
the state, and the worker reads it again from the sources. After a rebalance (a restart too) each
source partition is read from the position restored, committed before Faust's seek (`start_of`,
transport.py), not from the group's commits, which lag it. A record delivered again is skipped, one the
state already holds is a duplicate by id, and a record delivered after a gap (Faust committed past
the restored position, or faust-streaming 0.15.3 dropped records around a restart) makes the
worker read the partition again from the gap; a watchdog does the same for a partition it is
behind on but has got nothing from for `STALL_S` (by that partition's own clock).

Trajectories and computed rewards of a batch are published together, and acknowledged, before
the state marks their attempts settled; their ids derive from the attempt, so a crash repeats
them at worst and readers drop the repeat by id. What each is built from is written (and
acknowledged) before it is published, so a repeat is built from the same events: the same bytes. Deadletters are acknowledged before the position
passes their record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import faust
from aiokafka.errors import KafkaError
from faust.exceptions import ProducerSendError
from faust.types import TP, Message

from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.collector import Survivors
from agentstream.schemas.events import CallEvent, Deadletter, DeadletterEvent, Event
from agentstream.schemas.ids import derived_id, now_ms
from agentstream.schemas.kafka import deadletter_event
from agentstream.streams import policies
from agentstream.streams.assembly import SLICE, Assembly, Settled
from agentstream.streams.disk import Budget
from agentstream.streams.recall import CallLog, retention_ms
from agentstream.streams.settings import StreamsSettings
from agentstream.streams.tables import DueKeys, Staged, StateTable, registered
from agentstream.streams.transport import Inbox
from agentstream.streams.windows import Windows

log = logging.getLogger("streams")
ASSEMBLED = ("rollouts", "calls", "rewards")
STALL_S = 10.0
"""the assembly idle this long while behind a source partition's end: read it again"""
RESEEK_S = 5.0
"""a gap still open this long after its seek: seek again"""
UNACKNOWLEDGED_MAX = 2000
"""table changes on their way to the broker before the worker waits for them"""

Publish = Callable[[str, Event], Awaitable[Awaitable[object]]]
"""(topic base name, event) → the broker's acknowledgement, to await"""


class AssemblyWorker(faust.Service):
    """Trajectory assembly over this worker's partitions of the rollout-scoped topics."""

    def __init__(self, app: faust.App, settings: StreamsSettings, partitions: int, publish: Publish,
                 windows: Windows, inbox: Inbox, **kwargs: Any):
        super().__init__(**kwargs)
        self.app = app
        self.inbox = inbox
        """the fetched records of the source topics (transport.py)"""
        inbox.start_of = self.start_of
        self.settings = settings
        self.publish = publish
        self.windows = windows
        """analytics of the calls read and the trajectories emitted, written with the batch"""
        self.sources = [settings.topics.name(base) for base in ASSEMBLED]
        self.topic_of = {settings.topics.name(base): base for base in ASSEMBLED}
        """source topic → the base name of the events it holds"""
        # one table, so that a partition's state, its events and its positions share one ordered changelog
        budget = Budget(settings.state_memory_mb) if settings.store == "rocksdb" else None
        self.table = registered(app, StateTable(app, name="assembly", partitions=partitions,
                                                on_recover=self.recovered, budget=budget,
                                                standby_buffer_size=settings.standby_batch))
        self.rollouts = Staged(self.table, "r:")
        self.events = Staged(self.table, "e:", bytes.decode, str.encode)
        self.positions = Staged(self.table, "p:")
        """'topic:partition' → the next offset of that source partition to handle"""
        self.due_keys = DueKeys(self.table)
        """the due index: what is due is a range of these keys (`assembly.due_key`), no state read to find it"""
        self.marks = Staged(self.table, "m:")
        """'due-keys:partition' → 1: the partition's states all have their due keys (a table from before them gets
        them from one pass over its states, then never again)"""
        self.assembly = Assembly(self.rollouts, self.events, settings.timing, settings.source, settings.reward_policy,
                                 horizon_ms=int(settings.due_horizon_s * 1000), due_keys=self.due_keys)
        self.calls_log = CallLog(settings)
        """where a revision's calls are read back from (a settled session keeps their offsets, not them)"""
        self.calls_retention_ms: int | None = None
        """the calls topic's retention as the worker found it at its start (-1: forever)"""
        self.counts: Counter[str] = Counter()
        """what the worker itself dropped, deadlettered or read again (the assembly counts the rest)"""
        self.last_time: dict[TP, int] = {}
        """source partition → the latest event time handled (since it was assigned)"""
        self.gaps: dict[TP, float] = {}
        """source partition → when it was last sought back to a gap (monotonic)"""
        self.deadletters: list[Awaitable[object]] = []
        """acknowledgements to await before the positions pass their records"""
        self.handled_at: dict[TP, float] = {}
        """source partition → when a record of it was last handled (or it was first watched, or sought): each
        partition's own clock, so traffic on the others does not hide a stalled one (`_watchdog`)"""
        self.touched: set[int] = set()
        """partitions of the records in the batch so far"""
        self.batched = 0
        self.batch_began = time.monotonic()
        self.partitions = partitions
        self.turn = 0
        """the changelog partition whose held changes are written next (`_flush`): one at a time, in turn"""
        self.turn_at = time.monotonic()
        """when the next turn comes: every --write-every-s / partitions, so each partition's every --write-every-s"""
        self.overdue: dict[int, int] = {}
        """partition → its first due time, past when the timer last looked and not held back (`_until_next`)"""
        self.survivors = Survivors()
        """what is alive at a batch end (the events held until they settle) kept out of the collector's passes"""
        self.lock = asyncio.Lock()
        """records, batch end, timer or rebalance at a time: each changes the state and stages writes"""
        self.recoveries = 0
        """times the table was recovered (at the start, and after each rebalance)"""
        self.recovery: dict[str, Any] = {}
        """what the last recovery's rebuild of the due index read: states (none once the partitions have their due
        keys), due keys, and the partitions whose keys it wrote"""

    @faust.Service.task
    async def _check_calls_retention(self) -> None:
        """Warn when the calls topic forgets calls before the settled conversations that refer to them (beside the
        worker's start, not in its way: a slow broker delays nothing)."""
        self.calls_retention_ms = found = await retention_ms(self.settings)
        referred = self.settings.session_calls == "offsets"
        if referred and found is not None and 0 <= found < self.settings.timing.session_retention_ms:
            log.warning("the calls topic keeps its records %.1f days, --session-retention-s %.1f: feedback on a "
                        "conversation whose calls are gone makes no revision (it goes to the deadletter topic); "
                        "--session-calls whole keeps them in the state", found / 86_400_000,
                        self.settings.session_retention_s / 86_400)

    async def on_stop(self) -> None:
        await self.calls_log.stop()

    async def recovered(self) -> None:
        # the due index rebuilt from its keys in the table (those due within the horizon, no state), in slices, the
        # loop free in between (heartbeats, fetches); a partition without its keys yet gets them from its states
        async with self.lock:
            states, keys = self.rollouts.reads, self.assembly.counts["due_index_keys_read"]
            build = self._unmarked()
            self.assembly.restart(now_ms(), build)
        while (await self._look_ahead_slice())[0]:
            await asyncio.sleep(0)  # (taking a free lock does not yield)
        async with self.lock:
            for partition in self.assembly.built:  # written after the keys the pass put (`_flush`)
                self._mark(partition)
            self.assembly.built.clear()
            self.recovery = {"states_read": self.rollouts.reads - states, "built": sorted(build),
                             "due_keys_read": self.assembly.counts["due_index_keys_read"] - keys}
        self.recoveries += 1
        disk = self.table.disk
        if disk is None:
            log.info("state recovered: %d keys", len(self.table))
        else:  # (counting the keys on disk would read them all)
            log.info("state recovered: %d changelog records read, about %d keys on disk", disk.restored.records,
                     disk.estimated_keys())

    def _unmarked(self) -> set[int]:
        """The active partitions whose states have no due keys (written by a worker from before them); one that holds
        no position has no state (a position is written before the first state of its records): marked now, its
        keys written from its first state on."""
        unmarked = set()
        for partition in self.active_partitions():
            if f"due-keys:{partition}" in self.marks:
                continue
            if any(f"{topic}:{partition}" in self.positions for topic in self.sources):
                unmarked.add(partition)
            else:
                self._mark(partition)
        return unmarked

    def _mark(self, partition: int) -> None:
        self.marks.partition = partition
        self.marks[f"due-keys:{partition}"] = 1

    async def revoked(self, revoked: Iterable[TP]) -> None:
        # after the batch in hand (Faust waits for no record of the inbox: none is tracked as in a stream)
        async with self.lock:
            self.inbox.clear()
            # what is held goes out, acknowledged, before another worker restores these partitions: a write of
            # ours after its own would put its state back behind its positions
            try:
                await self._flush(now=True)
                await self.table.written()
            except (KafkaError, ProducerSendError):  # as a crash would leave it: read again by the next owner
                log.warning("the held changes were not written before the partitions were revoked", exc_info=True)
            for tp in revoked:
                self.last_time.pop(tp, None)
                self.gaps.pop(tp, None)
                self.handled_at.pop(tp, None)

    # --- handling a batch --------------------------------------------------------------------------

    @faust.Service.task
    async def _take_fetched(self) -> None:
        """Take the records fetched since the last take, once the flow is on (not during a rebalance,
        nor before the tables are recovered), and add them."""
        while not self.should_stop:
            await self.inbox.wait()
            await self.app.flow_control.acquire()
            records = self.inbox.take()
            if records:
                await self.handle(records)

    async def handle(self, records: list[Message]) -> None:
        """Add source records to the state, in order; end the batch whenever it is full or old enough."""
        async with self.lock:
            now, inbound = time.monotonic(), self.app.monitor.stream_inbound_time
            for tp in {message.tp for message in records}:
                inbound[tp] = now  # what Faust's "stream idle" check reads (it no longer sees a stream)
            flowing, acknowledge = self.app.flow_control.is_active, self.app.consumer.ack
            for message in records:
                if not flowing():  # a rebalance began: what is left is read again after it
                    return
                await self._handle_one(message)
                acknowledge(message)  # for Faust's commits: the table's positions say what was handled
            if self.batched and self._held_back():
                await self._end_batch_guarded()

    def _held_back(self) -> bool:
        """Whether an attempt of the batch's partitions is due and was held back only by these records
        (the partition is now handled to its end): ending the batch now settles it, rather than at the
        batch's age or the timer's next tick, up to --tick-s later. A worker catching up is behind its
        partitions' ends and keeps its batches."""
        now = now_ms()
        for partition in self.touched:
            upcoming = self.assembly.next_due([partition])
            if upcoming is not None and upcoming <= now and not self._behind(partition):
                return True
        return False

    async def _handle_one(self, message: Message) -> None:
        """Add one source record to the state; end the batch when it is full or old enough."""
        handled_at = self.handled_at[message.tp] = time.monotonic()
        try:
            if not self.touched:
                self.batch_began = handled_at
            if await self._take(message):
                self.touched.add(message.partition)
                self.batched += 1
            if self.batched >= self.settings.batch_max or (
                    handled_at - self.batch_began >= self.settings.batch_wait_s):
                await self._end_batch()
        except (KafkaError, ProducerSendError) as exc:
            # nothing is recorded past the last batch: the next worker handles it again
            await self.app.crash(exc)
            raise
        except Exception:  # settling failed (a bug): the attempts stay due and are tried again
            log.exception("the batch ending at %s:%d@%d failed", message.topic, message.partition, message.offset)

    async def _end_batch_guarded(self, partitions: Iterable[int] = ()) -> None:
        """`_end_batch`, outside a record's handling: a broker's error stops the worker (nothing is
        recorded past the last batch: the next worker handles it again), a bug is logged (the
        attempts stay due and are tried again)."""
        try:
            await self._end_batch(partitions)
        except (KafkaError, ProducerSendError) as exc:
            await self.app.crash(exc)
            raise
        except Exception:
            log.exception("settling due attempts failed")

    async def _end_batch(self, partitions: Iterable[int] = ()) -> None:
        """Settle what the batch made due (and the attempts due in `partitions`), then write the changes held
        in the changelog partitions due a write (`_flush`)."""
        touched, self.touched, self.batched = self.touched, set(), 0
        await self._settle(touched | set(partitions))
        await self._flush()
        self.survivors.batch_ended()

    async def _take(self, message: Message) -> bool:
        """Add one record to the state; whether it was the next of its partition."""
        if not await self._in_order(message):
            return False
        self.gaps.pop(message.tp, None)
        self._point_at(message.partition)
        try:
            await self._add(message)
        except (KafkaError, ProducerSendError):
            raise
        except Exception as exc:  # a bug meeting an odd event: set the event aside, keep going
            log.exception("the assembly failed on %s:%d@%d", message.topic, message.partition, message.offset)
            await self._deadletter(message, "failed", f"the assembly failed on this event: {type(exc).__name__}: {exc}")
        self.positions[f"{message.topic}:{message.partition}"] = message.offset + 1
        return True

    async def _in_order(self, message: Message) -> bool:
        """Whether this record is the next of its partition; after a gap, read it again from there."""
        key = f"{message.topic}:{message.partition}"
        expected = self.positions.get(key)
        if expected is None:
            # the partition's first record this state sees: its offset is written before any state built
            # from it (never ahead of it), so a worker killed after that state was written, whatever Faust
            # committed, reads the partition again from here rather than from past the state's events
            await self.table.write(message.partition, self.positions.prefix + key, message.offset)
            return True
        if message.offset == expected:
            return True
        if message.offset < expected:
            self.counts["redelivered"] += 1
        elif time.monotonic() - self.gaps.get(message.tp, -1e9) > RESEEK_S:
            log.warning("%s:%d: record %d arrived before %d: reading the partition again from %d",
                        message.topic, message.partition, message.offset, expected, expected)
            self.counts["gaps"] += 1
            self.gaps[message.tp] = time.monotonic()
            await self.app.consumer.seek(message.tp, expected)
        return False

    async def _add(self, message: Message) -> None:
        raw = message.value
        if raw is None:
            return await self._deadletter(message, "undecodable", "undecodable: a record without a value (a tombstone)")
        try:
            event: Event = decode(raw)
        except DecodeError as exc:
            return await self._deadletter(message, "undecodable", f"undecodable: {exc}")
        self.last_time[message.tp] = max(self.last_time.get(message.tp, 0), event.time)
        if self.topic_of.get(message.topic) != event.topic:
            return await self._deadletter(message, "misplaced", f"a {event.type} event does not belong on {message.topic}")
        if unusable := policies.untrainable(event):  # (written past the gateway's checks)
            return await self._deadletter(message, "untrainable", unusable)
        if isinstance(event, CallEvent):
            self.windows.add_call(event.data, message.partition, message.timestamp)
        if event.rollout_id is None:
            if isinstance(event, CallEvent):
                self.counts["session_calls"] += 1  # traffic outside any rollout: analytics count it
                return
            return await self._deadletter(message, "unattributed", f"a {event.type} event needs a rollout_id")
        offset = message.offset if self.settings.session_calls == "offsets" else None  # (None: kept whole)
        late = self.assembly.add(event, raw, message.partition, offset)
        if late:
            await self._deadletter(message, None, late)  # the assembly counted it

    async def _deadletter(self, message: Message, kind: str | None, reason: str) -> None:
        if kind:
            self.counts[kind] += 1
        event = deadletter_event(message, reason, self.settings.source)
        event.id = derived_id("streams.deadletter", message.topic, str(message.partition), str(message.offset))
        self.deadletters.append(await self.publish("deadletter", event))

    def _point_at(self, partition: int) -> None:
        """Stage the state's writes for `partition`'s changelog partition (co-partitioned with the sources)."""
        self.rollouts.partition = self.events.partition = self.positions.partition = partition

    # --- settling ----------------------------------------------------------------------------------

    async def _settle(self, partitions: Iterable[int]) -> None:
        """Settle the due attempts of these partitions (sessions' held events folded in first, `release`);
        publish what that yields, together; again for the rollouts whose settling let more held events through
        (a session's feedback timed after its conversation settled: a revision, as a rebuild makes it)."""
        self.assembly.recalled.clear()  # (what a failed settling read back)
        marks = {partition: self.watermark(partition) for partition in partitions}
        due = {partition: self.assembly.due(now, [partition]) for partition, now in marks.items()}
        while due:
            settled: list[Settled] = []
            late: list[tuple[bytes, str]] = []
            released: dict[str, int] = {}
            for partition, rollout_ids in due.items():
                self._point_at(partition)
                for rollout_id in rollout_ids:
                    try:
                        late += self.assembly.release(rollout_id, marks[partition])
                        released[rollout_id] = partition
                    except Exception:  # a bug: the attempt stays due and is tried again
                        log.exception("releasing the held events of rollout %s failed", rollout_id)
            for rollout_id in await self._read_back(released, marks):
                try:
                    settled.append(self.assembly.settle(rollout_id, marks[released[rollout_id]]))
                except Exception:  # a bug: the attempt stays due and is tried again
                    log.exception("settling rollout %s failed", rollout_id)
            if late:  # acknowledged before any state without them is written
                await asyncio.gather(*[await self.publish("deadletter", self._late_deadletter(raw_event, reason))
                                       for raw_event, reason in late])
            settled = [one for one in settled if one.attempts or one.forgotten]
            if not settled:
                return
            await self._emit(settled)
            due = {}
            for one in settled:
                partition = self.rollouts_partition(one.rollout_id)
                if self.assembly.releasable(one.rollout_id, marks[partition]):
                    due.setdefault(partition, []).append(one.rollout_id)

    async def _read_back(self, released: dict[str, int], marks: dict[int, int]) -> list[str]:
        """Read back from the calls topic, in one go, the calls the revisions of these rollouts are built from
        (`Assembly.wanted`); the rollouts to settle now: all, or those that need none if the read failed (the
        others stay due, and are tried again at the next tick)."""
        wanted = {rollout_id: refs for rollout_id, partition in released.items()
                  if (refs := self.assembly.wanted(rollout_id, marks[partition]))}
        if wanted:
            try:
                self.assembly.recalled.update(await self.calls_log.read([r for refs in wanted.values() for r in refs]))
            except (TimeoutError, KafkaError):
                log.warning("reading back the calls of %d rollouts failed", len(wanted), exc_info=True)
                return [rollout_id for rollout_id in released if rollout_id not in wanted]
        return list(released)

    async def _emit(self, settled: list[Settled]) -> None:
        """Publish what settling yielded, acknowledged, before the state says the attempts are settled.

        What each trajectory is built from is in the changelog before it is published: settled again
        after a crash, an attempt yields the same bytes, not a trajectory with events that came since.
        """
        await self._decide(settled)
        await asyncio.gather(*await self._publish_settled(settled))
        self._record(settled)

    async def _decide(self, settled: list[Settled]) -> None:
        """Stage each attempt's decision and await the broker's acknowledgement of them."""
        partitions = set()
        for one in settled:
            partitions.add(partition := self.rollouts_partition(one.rollout_id))
            self._point_at(partition)
            self.assembly.decide(one)
        # what the trajectories are built from: their attempts' decisions (after the due keys added in their
        # partitions: a state is never in the changelog before its key), acknowledged; not every change
        # still on its way (the events and positions of batches before, in the other partitions too), but
        # none of those refused: a worker whose changelog has a hole publishes nothing more
        keys = [change for partition in sorted(partitions) for change in self.due_keys.added_of(partition)]
        states = self.rollouts.changes(one.rollout_id for one in settled)
        await asyncio.gather(*await self.table.write_all([*keys, *states]))
        self.table.check()

    async def _publish_settled(self, settled: list[Settled]) -> list[Awaitable[object]]:
        """Send the rewards, trajectories and deadletters of the settled attempts; their acknowledgements."""
        sent = []
        for one in settled:
            sent += [await self.publish("rewards", reward) for reward in one.rewards]
            sent += [await self.publish("trajectories", trajectory) for trajectory in one.trajectories]
            for raw_event, reason in one.late + one.unscored + one.unrevised:
                sent.append(await self.publish("deadletter", self._late_deadletter(raw_event, reason)))
        return sent

    def _late_deadletter(self, raw_event: bytes, reason: str) -> DeadletterEvent:
        event: Event = decode(raw_event)
        return DeadletterEvent(
            id=derived_id("streams.deadletter", event.id), source=self.settings.source,
            data=Deadletter(topic=self.settings.topics.name(event.topic), key=event.rollout_id,
                            value=raw_event.decode(), reason=reason, consumer=self.settings.source))

    def _record(self, settled: list[Settled]) -> None:
        """The published attempts into the analytics windows and the state (settled)."""
        emitted_at = time.time()
        for one in settled:
            partition = self.rollouts_partition(one.rollout_id)
            for trajectory in one.trajectories:
                self.windows.add_trajectory(trajectory.data, partition, emitted_at)
            self._point_at(partition)
            self.assembly.record(one)

    def rollouts_partition(self, rollout_id: str) -> int:
        state = self.rollouts.get(rollout_id)
        return state["partition"] if state else self.rollouts.partition

    async def _flush(self, now: bool = False) -> None:
        """Write the changes held in the changelog partition whose turn has come (every partition's, `now`):
        deadletters acknowledged, then per partition the state, then the positions.

        One partition a turn, in turn, whatever the pauses between batch ends: partitions written when due
        by each one's own clock would fall into step after a pause (a worker's start, a revocation), and then
        every partition's changes would go in one write, awaited under the lock: a stall that becomes the
        tail of the finish → trajectory delay."""
        clock = time.monotonic()
        if now or not self.settings.write_every_s:  # (0: every partition's at every batch end)
            due = list(range(self.partitions))
        elif clock >= self.turn_at:
            due, self.turn = [self.turn], (self.turn + 1) % self.partitions
            self.turn_at = clock + self.settings.write_every_s / self.partitions
        else:
            return
        if self.deadletters:
            pending, self.deadletters = self.deadletters, []
            await asyncio.gather(*pending)
        changes = []
        for partition in due:  # a due key added before the state that has that due, one dropped after it
            changes += [*self.due_keys.added_of(partition), *self.rollouts.changes_of(partition),
                        *self.due_keys.dropped_of(partition), *self.marks.changes_of(partition),
                        *self.events.changes_of(partition), *self.positions.changes_of(partition)]
        await self.table.write_all(changes)  # one record batch per partition: its state, then its positions
        await self.windows.flush()
        if self.table.unacknowledged > UNACKNOWLEDGED_MAX:
            await self.table.written()

    def watermark(self, partition: int) -> int:
        """The event time up to which attempts of `partition` may settle: now, once every source
        topic's partition has been handled to its end; else the time of the last event handled from
        the one behind. Faust reads the three topics side by side, not in the order they were
        written, so a worker catching up may see an attempt's finish before its calls."""
        return min([now_ms(), *(self.last_time.get(tp, 0) for tp in self._behind(partition))])

    def _behind(self, partition: int) -> list[TP]:
        """The source partitions of `partition` not handled to their end (as last fetched)."""
        behind = []
        for topic in self.sources:
            tp = TP(topic, partition)
            start, end = self.position(tp)
            if end is None or start < end:
                behind.append(tp)
        return behind

    def position(self, tp: TP) -> tuple[int, int | None]:
        """(next offset to handle, the log's end as last fetched) of a source partition.

        A partition the table holds no position for has had none of its records handled: its next
        is its first, whatever offset Faust's consumer group committed.
        """
        return self.positions.get(f"{tp.topic}:{tp.partition}", 0), self.app.consumer.highwater(tp)

    def start_of(self, tp: TP) -> int | None:
        """Where a source partition is read from after a rebalance (transport.py): the next offset the table
        says to handle, the records before it in the state already (fetched again, they would only be skipped);
        None where it holds no position (Faust's committed offset, as `_in_order` takes a partition's first)."""
        start: int | None = self.positions.get(f"{tp.topic}:{tp.partition}")
        return start

    def active_partitions(self) -> set[int]:
        return {tp.partition for tp in self.app.assignor.assigned_actives() if tp.topic == self.sources[0]}

    # --- timers --------------------------------------------------------------------------------------

    @faust.Service.task
    async def _settle_when_due(self) -> None:
        """End a batch that waits for records no longer coming, and settle quiet partitions: when
        their next attempt is due, at least every --tick-s."""
        while not self.should_stop:
            await self.sleep(self._until_next())
            if self.app.rebalancing:
                continue
            async with self.lock:
                await self._end_batch_guarded(self.active_partitions())

    def _until_next(self) -> float:
        """Seconds until the next attempt is due or the batch is old enough, at most --tick-s."""
        wait = self.settings.tick_s
        if self.batched:
            wait = min(wait, self.batch_began + self.settings.batch_wait_s - time.monotonic())
        if self.app.rebalancing:  # until its tables are recovered, a worker has no state to settle
            return max(0.001, wait)
        now, overdue = now_ms(), {}
        for partition in self.active_partitions():
            upcoming = self.assembly.next_due([partition])
            if upcoming is None:
                continue
            if upcoming > now:
                wait = min(wait, (upcoming - now) / 1000)
            elif not self._behind(partition):
                # it came due while the last settling ran, and no record in flight holds it back: settle it now,
                # not a tick later (once the load stops, no record's batch end would settle it sooner); the same
                # one still due at the next look did not settle (a failed settling): it waits a tick
                overdue[partition] = upcoming
                if self.overdue.get(partition) != upcoming:
                    wait = 0
            # else a batch settles it once its partition's records in flight are handled (`_held_back`)
        self.overdue = overdue
        return max(0.001, wait)

    @faust.Service.task
    async def _look_ahead(self) -> None:
        """The pass over the table that extends the due index (`Assembly.look_ahead`, once a horizon), a slice at a
        time between batches, each followed by a pause as long: the loop is held for a slice, never for the pass
        (13 M states: ~5 min), and the pass takes at most half the worker's time while it runs."""
        while not self.should_stop:
            pause = self.settings.tick_s
            if not self.app.rebalancing:  # (the table's recovery restarts the pass: `recovered`)
                under_way, took = await self._look_ahead_slice()
                pause = took if under_way else pause
            await self.sleep(pause)

    async def _look_ahead_slice(self) -> tuple[bool, float]:
        """A slice of the pass, between batches: not while a batch's changes are being written, when a key is in
        neither the staged changes nor the table; (whether the pass is still under way, the slice's seconds)."""
        async with self.lock:
            began = time.monotonic()
            with self.table.uncached():  # (every state read once: its blocks kept out of the cache)
                under_way = self.assembly.look_ahead(now_ms(), SLICE)
            return under_way, time.monotonic() - began

    @faust.Service.timer(STALL_S / 2)
    async def _watchdog(self) -> None:
        """Read again a source partition the worker is behind on but has received no record of for STALL_S
        (records dropped at its end, where no later record shows the gap), whatever the other partitions get."""
        if self.app.rebalancing:
            return
        for tp in self.stalled(time.monotonic()):
            start, end = self.position(tp)
            log.warning("%s:%d stalled at offset %d of %s: reading it again from there", tp.topic, tp.partition,
                        start, end)
            self.counts["stalls"] += 1
            await self.app.consumer.seek(tp, start)
            self.handled_at[tp] = time.monotonic()

    def stalled(self, clock: float) -> list[TP]:
        """The source partitions behind their end and so since STALL_S or more before `clock` (monotonic): no
        record of them handled since, nor were they at their end (a partition seen first starts its clock)."""
        found = []
        for partition in self.active_partitions():
            for topic in self.sources:
                tp = TP(topic, partition)
                start, end = self.position(tp)
                if end is None or start >= end:
                    self.handled_at[tp] = clock  # at its end: records that come now are not overdue yet
                elif clock - self.handled_at.setdefault(tp, clock) >= STALL_S:
                    found.append(tp)
        return found

    # --- the view --------------------------------------------------------------------------------------

    def describe(self, open_attempts: bool = False) -> dict[str, Any]:
        """Counters, partitions and source positions; with `open_attempts`, also how many attempts are
        not settled yet (a scan of the state)."""
        actives = sorted(self.active_partitions())
        extra = {"open_attempts": self.assembly.open_attempts()} if open_attempts else {}
        return {
            "assembly": {**self.assembly.counts, **self.counts, **extra, "partitions": actives,
                         "due_indexed": self.assembly.indexed()},
            "sources": {f"{topic}:{p}": self.position(TP(topic, p)) for p in actives for topic in self.sources},
            "state": self.describe_state(),
        }

    def describe_state(self) -> dict[str, Any]:
        """Where the table is and what it costs: with the disk store, the changelog records recovery read
        (since the start), the changelog offset each partition's database holds up to, and their memory."""
        disk = self.table.disk
        unwritten = (self.rollouts.unwritten + self.events.unwritten + self.positions.unwritten
                     + self.due_keys.unwritten + self.marks.unwritten)
        calls = {"calls_retention_ms": self.calls_retention_ms, "calls_read_back": self.calls_log.reads}
        recovery = {"recoveries": self.recoveries, "recovery": self.recovery}
        if disk is None:
            return {"store": "memory", **recovery, "unwritten_changes": unwritten, **calls}
        return {"store": "rocksdb", **recovery, "unwritten_changes": unwritten, **calls,
                "restored_records": disk.restored.records,
                "restored_by_partition": disk.restored.by_partition, "memory_bytes": disk.budget.usage(), "rocksdb": disk.memory(),
                "memory_budget_bytes": disk.budget.bytes, "held_changes": len(disk.held),
                "changelog_offsets": {partition: disk.persisted_offset(TP(self.table.changelog_name, partition))
                                      for partition in sorted(self.active_partitions())}}

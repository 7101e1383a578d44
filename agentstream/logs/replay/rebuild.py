"""Trajectories rebuilt from the raw log (rollouts, calls, rewards) with the streams worker's fold.

The events of each partition are fed to `streams.assembly.Assembly` in event-time order, merged
across the three topics, and an attempt is settled as soon as an event later than its settle time
comes next (or when the range closes). That is what the live worker decides by its watermark, and
since trajectory ids derive from the attempt and `build` sorts events, the same events make the
same trajectories, byte for byte. Sessions' events are held and released by the assembly in event-time
order at each settling (`Assembly.rounds`), as in the worker.

A resume position holds the read offsets and the open attempts; the settled ones, which the assembly
keeps against late events and repeats, go to a file per partition beside the state (settled.py).

Partitions fold independently (the topics are co-partitioned by rollout id): `parallel.py` runs a
`Rebuild` of some of them in each of `--jobs` processes and merges their positions into this one's.

With a new reward function, every task names it instead of its own, and the rewards computed
earlier (reward events with `reward_fn` set) are left out: only what agents posted is carried
over, and the new function scores every finished attempt. Sessions' rewards are always made again from
their feedback, by `reward_policy` (the worker's `--reward-policy`, or another): the policy's earlier
rewards in the log are its output, never input (`Assembly._add_session`); feedback later than a conversation's
window makes a revision of its trajectory (`Trajectory.revision_of`), written like any trajectory.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentstream.logs.replay.selection import Selection
from agentstream.logs.replay.settled import SettledLog, Tracked
from agentstream.logs.replay.sources import Item
from agentstream.logs.replay.state import int_keys
from agentstream.schemas import collector
from agentstream.schemas.codec import DecodeError, decode, encode
from agentstream.schemas.events import Call, CallEvent, Event, RewardEvent, RolloutQueuedEvent, TrajectoryEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import KAFKA, Bounds, Origin, Record, ScanProgress, scan
from agentstream.streams import policies
from agentstream.streams.assembly import Assembly, Settled, Timing, finalize_at
from agentstream.streams.policies import DEFAULT_POLICY

RAW = ("rollouts", "calls", "rewards")
"""the sources, in the order that breaks ties between events of the same time"""
REASONS_KEPT = 5


@dataclass(frozen=True)
class RebuildSpec:
    """How trajectories are rebuilt from the raw topics: as the live worker's settings say."""

    reward_fn: str | None = None
    timing: Timing = field(default_factory=Timing)
    lookback_ms: int = 3_600_000
    source: str = "streams"
    reward_policy: str = DEFAULT_POLICY
    """the reward policy that turns sessions' feedback into rewards (a rebuild always applies it)"""


@dataclass(frozen=True)
class Fold:
    """How one run folds its range: the spec, and what the run decided (when the range closes, what it selects,
    what its sink needs, where it reads). One process's `Rebuild` and each worker's take the same."""

    spec: RebuildSpec
    closing_ms: int
    selection: Selection
    settled: Path
    """the folder of the partitions' settled rollouts (settled.py), beside the resume state"""
    with_calls: bool = False
    batch_size: int = 5000
    origin: Origin = KAFKA


async def _next(batches: AsyncIterator[list[Record]]) -> list[Record] | None:
    return await anext(batches, None)


@dataclass(slots=True)
class Pending:
    time: int
    offset: int
    event: Event
    raw: bytes


class Rebuild:
    def __init__(self, settings: KafkaSettings, ranges: dict[str, dict[int, tuple[int, int]]],
                 position: dict[str, Any] | None, fold: Fold, counts: Counter[str],
                 partitions: list[int] | None = None):
        """`partitions`: those this rebuild folds, where it is one of several (the others' ranges are empty)."""
        self.settings = settings
        self.timing = timing = fold.spec.timing
        self.closing_ms = fold.closing_ms
        self.selection = fold.selection
        self.reward_fn = fold.spec.reward_fn
        self.with_calls = fold.with_calls
        self.batch_size = fold.batch_size
        self.origin = fold.origin
        settled, source, reward_policy = fold.settled, fold.spec.source, fold.spec.reward_policy
        self.partitions = sorted(ranges["rollouts"]) if partitions is None else sorted(partitions)
        self.ends = {t: {p: end for p, (_, end) in ranges[t].items()} for t in RAW}
        self.counts = counts
        if position:
            self.next = {t: int_keys(position["next"][t]) for t in RAW}
            saved = int_keys(position["assembly"])
            lengths = int_keys(position.get("settled", {}))
        else:
            self.next = {t: {p: start for p, (start, _) in ranges[t].items()} for t in RAW}
            saved, lengths = {}, {}
        self.scanned = {t: dict(self.next[t]) for t in RAW}
        """next offset each scan will deliver, per topic and partition"""
        self.assemblies: dict[int, Assembly] = {}
        self.logs = {p: SettledLog(settled, p, lengths.get(p, 0)) for p in self.partitions}
        self.rollouts: dict[int, Tracked] = {}
        for p in self.partitions:
            state = saved.get(p, {"rollouts": {}, "events": {}})
            rollouts = self.rollouts[p] = Tracked()
            dict.update(rollouts, self.logs[p].load())  # (not changes: the file has them)
            for rollout_id, rollout in state["rollouts"].items():  # the open ones: sorted again at the next position
                rollouts[rollout_id] = rollout
            events = {event_id: raw.encode() for event_id, raw in state["events"].items()}
            self.assemblies[p] = Assembly(rollouts, events, timing, source, reward_policy)
        self.queues: dict[tuple[str, int], deque[Pending]] = {(t, p): deque() for t in RAW for p in self.partitions}
        self.remaining = sum(max(0, self.ends[t][p] - self.next[t][p]) for t in RAW for p in self.partitions)
        self.read = 0
        self.reasons: list[str] = list(position.get("reasons", [])) if position else []
        """the first reasons for late events and failed reward functions, to show"""
        self.explain_open = True
        """whether the range's close adds why attempts are open to `reasons` (a worker process leaves it to
        the parent, which knows them all: see parallel.py)"""
        self.open_due: int | None = None
        """when the last attempt that had ended but was still open at the close is due"""

    # --- reading -----------------------------------------------------------------------------

    async def chunks(self) -> AsyncGenerator[list[Item], None]:
        # each topic's next batch is fetched while the ones before are folded; its positions count
        # as read (for `_waiting` and the resume position) only once the batch is taken
        reached: dict[str, dict[int, int]] = {t: {} for t in RAW}

        def progressed(topic: str) -> Callable[[ScanProgress], None]:
            def update(progress: ScanProgress) -> None:
                reached[topic] = dict(progress.positions)
            return update

        names = {t: self.settings.topics.name(t) for t in RAW}
        scans = {t: scan(self.settings, names[t], Bounds(start_offsets=dict(self.next[t]),
                                                         end_offsets=dict(self.ends[t])),
                         self.batch_size, on_progress=progressed(t), origin=self.origin) for t in RAW}
        fetching: dict[str, asyncio.Future[list[Record] | None]] = {}
        survivors = collector.Survivors()
        # no automatic collections while folding (they would scan every batch's allocations, though what
        # the batches leave alive is frozen): nothing the fold makes holds a cycle, and what else does
        # is frozen at the next batch end and collected by the survivors' full pass
        with collector.paused():
            try:
                while True:
                    out: list[Item] = []
                    for p in self.partitions:
                        self._drain(p, out)
                    self._update_next()
                    wanted = [t for t in RAW if any(self._waiting(t, p) for p in self.partitions)]
                    if not wanted:
                        break
                    yield out
                    survivors.batch_ended()  # (the fold's state lives as long as the range)
                    for t in wanted:  # (every wanted scan fetching at once: the first fetches start their consumers)
                        if t not in fetching:
                            fetching[t] = asyncio.ensure_future(_next(scans[t]))
                    for t in wanted:
                        batch = await fetching.pop(t)
                        if batch is None:  # the scan ended: every partition of it is read to its end
                            self.scanned[t].update(self.ends[t])
                        else:
                            self.scanned[t].update(reached[t])
                            self.read += len(batch)
                            self._queue(t, batch)
                            fetching[t] = asyncio.ensure_future(_next(scans[t]))
                for p in self.partitions:
                    self._settle(p, self.closing_ms, out)
                self._count_open()
                yield out
            finally:
                # a fetch under way is let finish (within a fetch's 1 s), not cancelled: its scan closes
                # its consumer then, never while librdkafka is still reading on the thread
                await asyncio.gather(*fetching.values(), return_exceptions=True)
                for gen in scans.values():
                    await gen.aclose()

    def _count_open(self) -> None:
        """Attempts the range leaves unsettled, and why: still running, or ended too recently to be due."""
        unsettled = [attempt for a in self.assemblies.values() for state in a.rollouts.values()
                     for attempt in state["attempts"].values() if not attempt.get("settled")]
        ended = [finalize_at(attempt, self.timing) for attempt in unsettled if attempt["end"] is not None]
        self.counts["open"] = len(unsettled)
        self.counts["open_ended"] = len(ended)
        self.open_due = max(ended) if ended else None
        if ended and self.explain_open:
            self.add_open_reason(self.reasons, len(ended), max(ended), self.closing_ms)

    @staticmethod
    def add_open_reason(reasons: list[str], ended: int, due: int, closing_ms: int) -> None:
        # the live worker would not have settled them yet either: a reward may still come
        at = datetime.fromtimestamp(due / 1000, UTC).isoformat(timespec="milliseconds")
        reason = (f"{ended} attempt(s) had ended but were not due by the range's close "
                  f"({closing_ms}): their settle time or reward grace runs until {at}; "
                  "rebuild after that (to a new topic) to include them")
        if reason not in reasons:  # a resumed run reaches the close again
            reasons.append(reason)

    def _waiting(self, topic: str, partition: int) -> bool:
        """The merge of this partition needs the next record of this topic, which is not yet read."""
        return not self.queues[topic, partition] and self.scanned[topic][partition] < self.ends[topic][partition]

    def _queue(self, topic: str, records: list[Record]) -> None:
        for record in records:
            raw = record.value or b""  # (a tombstone is undecodable)
            try:
                event: Event = decode(raw)
            except DecodeError:
                self.counts["undecodable"] += 1
                continue
            if event.topic != topic:
                self.counts["misplaced"] += 1
                continue
            if policies.untrainable(event):  # (as the live worker: deadlettered there, never folded)
                self.counts["untrainable"] += 1
                continue
            if event.rollout_id is None:
                self.counts["without_rollout"] += 1  # session calls: no trajectory to make
                continue
            if not self.selection.wants_rollout(event.rollout_id):
                continue  # safe to skip: an attempt settles by its own events' times (see _drain)
            if self.reward_fn:
                if isinstance(event, RewardEvent) and event.data.reward_fn:
                    self.counts["computed_rewards_left_out"] += 1
                    continue
                if isinstance(event, RolloutQueuedEvent):
                    event.data.task.reward_fn = self.reward_fn
                    raw = encode(event)
            self.queues[topic, record.partition].append(Pending(event.time, record.offset, event, raw))

    def _update_next(self) -> None:
        """Resume at the first record not yet handed to the assembly."""
        for (t, p), queue in self.queues.items():
            self.next[t][p] = queue[0].offset if queue else self.scanned[t][p]

    # --- the merge ---------------------------------------------------------------------------

    def _drain(self, partition: int, out: list[Item]) -> None:
        """Feed the partition's events in time order while every topic's next event is known."""
        assembly = self.assemblies[partition]
        queues = [self.queues[t, partition] for t in RAW]
        duplicates = assembly.counts["duplicates"]
        try:
            while True:
                head: deque[Pending] | None = None
                for t, queue in zip(RAW, queues):
                    if queue:
                        if head is None or queue[0].time < head[0].time:  # (a tie: the topic first in RAW)
                            head = queue
                    elif self._waiting(t, partition):
                        return
                if head is None:
                    return
                pending = head.popleft()
                # everything due before this event's time settles first, as the live watermark would have it;
                # an attempt's own later events then come late, whichever rollouts the selection skipped
                self._settle(partition, pending.time - 1, out)
                if late := assembly.add(pending.event, pending.raw, partition):
                    self.counts["late"] += 1
                    self._reason(late)
        finally:
            self.counts["duplicates"] += assembly.counts["duplicates"] - duplicates

    def _settle(self, partition: int, now: int, out: list[Item]) -> None:
        assembly = self.assemblies[partition]
        if not assembly.any_due(now, partition):  # (as for most events: `due` would pop and push back the head)
            return
        late: list[tuple[bytes, str]] = []
        for rollout_id in assembly.due(now, [partition]):
            for settled in assembly.rounds(rollout_id, now, late):
                out += [Item(trajectory, self._calls(assembly, trajectory)) for trajectory in settled.trajectories]
                self._account(settled)
                assembly.record(settled)
        self.counts["late"] += len(late)  # (sessions' events late for a conversation settled before their time)
        for _, reason in late:
            self._reason(reason)

    def _calls(self, assembly: Assembly, trajectory: TrajectoryEvent) -> dict[str, Call]:
        """The turns' calls, read from the assembly's store before `record` forgets them."""
        if not self.with_calls:
            return {}
        found = {}
        for turn in trajectory.data.turns:
            event = assembly.decoded(turn.call_id)  # (validated when read: not again)
            if isinstance(event, CallEvent):
                found[turn.call_id] = event.data
        return found

    def _account(self, settled: Settled) -> None:
        self.counts["trajectories"] += len(settled.trajectories)
        if revisions := sum(t.data.revision_of is not None for t in settled.trajectories):  # (of the trajectories)
            self.counts["revisions"] += revisions
        self.counts["rewards_computed"] += len(settled.rewards)
        self.counts["reward_failures"] += len(settled.unscored)
        self.counts["late"] += len(settled.late)
        if settled.unrevised:  # (none here: a rebuild reads every call it folds)
            self.counts["revisions_unavailable"] += len(settled.unrevised)
        for _, reason in settled.unscored + settled.late + settled.unrevised:
            self._reason(reason)

    def _reason(self, reason: str) -> None:
        if len(self.reasons) < REASONS_KEPT:
            self.reasons.append(reason)

    # --- resuming ----------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        """The read positions and the open attempts' state, the settled ones' files' lengths (those written to
        disk first): what a resume needs besides the counts."""
        lengths = {p: self.logs[p].sync(self.rollouts[p]) for p in self.partitions}
        return {
            "next": {t: dict(self.next[t]) for t in RAW},
            "assembly": {p: {"rollouts": {r: self.rollouts[p][r] for r in self.logs[p].open},
                             "events": {k: v.decode() for k, v in a.events.items()}}
                         for p, a in self.assemblies.items()},
            "settled": lengths,
            "reasons": self.reasons,
        }

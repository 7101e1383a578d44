"""Trajectory assembly as a fold over the log: the state machine of the streams worker and of replay.

Each rollout-scoped event (lifecycle, call, reward) is added to its attempt; an attempt is settled
into a trajectory once it is due. When that is follows from event times alone, so a replay of the
log decides exactly as the live worker did (`finalize_at`):

- a controller-managed attempt ends with the controller's terminal event (`finished`, `failed`,
  `timed_out`); an attempt no controller manages ends with the agent's `finish`;
- a finished attempt that expects a reward from outside (its task names no reward function) waits
  for the first reward up to `reward_grace_ms` after the end, then settles with the reward missing;
- every ending waits `settle_ms` more for stragglers from other producers;
- an attempt with no ending is abandoned `idle_timeout_ms` after its last event.

A trajectory holds the events whose time is at most its attempt's settle time. An event that
comes later, or for an attempt already settled, is late: it goes to the deadletter topic with the
reason. An id seen before is a duplicate and is dropped, settled or not (at-least-once delivery
and restarts replay events). A settled attempt's ids are kept `retention_ms`, for that purpose.

State lives in two mappings the caller provides: plain dicts in replay, changelog-backed Faust
tables in the worker. `rollouts` maps a rollout id to a JSON-able dict (its attempts' event ids,
ending, timings); `events` maps an event id to its encoded value, for the events a trajectory is
built from. The trajectory and any computed reward get ids derived from the attempt, so a worker
that settles an attempt twice (it died before committing) emits the same events again, and
consumers drop the repeats by id.

A session's conversation stays `session_retention_ms` after it settled, for feedback that comes later: a revision
of its trajectory is built from the same events. Its call events (prompt, token ids, logprobs: most of a
session's bytes) are not kept for that: where `add` was given a call's offset (the worker's), the state keeps
that reference (`sessions.call_offsets`), and a revision reads the calls back from the calls topic (`wanted`,
then `recalled`; `rounds` with a `recall` function). Calls the log no longer holds (its retention shorter than
the sessions') make no revision: the feedback goes to the deadletter topic with why (`Settled.unrevised`).
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentstream.schemas.codec import DecodeError, decode, encode
from agentstream.schemas.events import (
    TERMINAL_TYPES,
    CallEvent,
    Event,
    FeedbackEvent,
    RewardEvent,
    RolloutFinishedEvent,
    RolloutHeartbeatEvent,
    RolloutQueuedEvent,
    SessionEndedEvent,
    TrajectoryEvent,
)
from agentstream.schemas.ids import derived_id
from agentstream.schemas.sessions import is_session_rollout
from agentstream.streams import policies, rewards, sessions
from agentstream.streams.trajectory import STATUS_OF, Ending, build, revised, with_reward

NO_ATTEMPT = "-"
"""the attempt of events that name a rollout but no attempt, before any attempt is known"""
DECODED_MAX = 20_000
"""events kept decoded between adding and settling (a worker settles most soon after their batch)"""
DECODED_BYTES_MAX = 16 * 1024 * 1024
"""and their raw size at most: decoded, a call's token ids and logprobs take ~6× their JSON (a worker catching up
on sessions of 8 KiB calls held 20,000 of them in ~1 GiB, whatever its state's store)"""
SLICE = 1_000
"""states a slice of the worker's pass over `rollouts` reads (~15-25 ms from RocksDB): what one holds its loop"""
UNBUILT = -1
"""the due index's horizon while it is rebuilt from nothing (`Assembly.restart`)"""
DUE_WIDTH = 19
"""digits of a due time in a due key: every time up to `sessions.FOREVER_MS` (never due: not indexed)"""


CallRef = tuple[int, int, str]
"""a call event in the calls topic: (partition, offset, event id)"""
Recall = Callable[[list[CallRef]], dict[str, bytes]]
"""call events read back by reference: event id → the record's value, for those the log still holds"""


@dataclass(frozen=True)
class Timing:
    settle_ms: int = 1_000
    reward_grace_ms: int = 30_000
    idle_timeout_ms: int = 600_000
    retention_ms: int = 6 * 3_600_000
    session_idle_ms: int = 1_800_000
    """a session's conversation ends this long after its last call, unless ended before"""
    feedback_window_ms: int = 600_000
    """how long an ended conversation waits for its first feedback before its trajectory goes without"""
    session_retention_ms: int = 30 * 24 * 3_600_000
    """how long a settled conversation is kept for feedback that comes later (and against repeats)"""


@dataclass
class Settled:
    """What settling a rollout yields: events to publish, then the state change to record."""

    rollout_id: str
    trajectories: list[TrajectoryEvent] = field(default_factory=list)
    rewards: list[RewardEvent] = field(default_factory=list)
    """computed by the tasks' reward functions"""
    late: list[tuple[bytes, str]] = field(default_factory=list)
    """(encoded event, reason): events timed after their attempt settled, for the deadletter topic"""
    unscored: list[tuple[bytes, str]] = field(default_factory=list)
    """(encoded trajectory, reason): trajectories whose reward function failed, for the deadletter topic"""
    attempts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """attempt id → its settled marker"""
    decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    """attempt id → what its trajectory was built from (`Assembly.decide` records it before publishing)"""
    forgotten: list[str] = field(default_factory=list)
    """attempts settled longer ago than the retention"""
    unrevised: list[tuple[bytes, str]] = field(default_factory=list)
    """(encoded feedback, reason): later feedback whose revision could not be built (its calls gone from the log)"""

    def extend(self, other: Settled) -> None:
        self.trajectories += other.trajectories
        self.rewards += other.rewards
        self.late += other.late
        self.unscored += other.unscored
        self.attempts.update(other.attempts)
        self.decided.update(other.decided)
        self.forgotten += other.forgotten
        self.unrevised += other.unrevised


def finalize_at(attempt: dict[str, Any], timing: Timing) -> int:
    """When (UTC ms, event time) the attempt settles, from what is known of it so far."""
    if "session" in attempt:
        return sessions.settle_at(attempt, timing)
    end = attempt.get("end")
    if end is None:
        return int(attempt["last"]) + timing.idle_timeout_ms
    ended: int = end["time"]
    if not attempt["awaits_reward"] or end["type"] != "rollout.finished":
        return ended + timing.settle_ms
    reward_at: int | None = attempt.get("reward_at")
    if reward_at is not None and reward_at <= ended + timing.reward_grace_ms:
        return max(ended, reward_at) + timing.settle_ms
    # never before --settle-s: a grace shorter than it would settle the attempt while its calls may
    # still be on their way (a loaded gateway's calls reach the log after the finish)
    return ended + max(timing.reward_grace_ms, timing.settle_ms)


def due_key(partition: int, due: int, rollout_id: str) -> str:
    """The due index's key of a rollout due at `due` (`DueKeys`): by partition, then due time, fixed-width, so the
    keys' order is the order they come due in."""
    return f"{partition:04d}:{max(due, 0):0{DUE_WIDTH}d}:{rollout_id}"


def parse_due_key(key: str) -> tuple[int, int, str]:
    """(partition, due, rollout id) of a due key."""
    partition, due, rollout_id = key.split(":", 2)
    return int(partition), int(due), rollout_id


def next_partition(partition: int) -> str:
    """A key after every due key of `partition` and before the next partition's (`;` follows `:`)."""
    return f"{partition:04d};"


class DueKeys(Protocol):
    """The due index kept in the worker's table (tables.py), a key per rollout (`due_key`), in the keys' order."""

    def put(self, partition: int, key: str) -> None: ...
    def drop(self, partition: int, key: str) -> None: ...
    def keys_from(self, after: str | None) -> Iterator[str]: ...


@runtime_checkable
class Sliced(Protocol):
    """A mapping that lists its keys in an order of its own, from a key on (the worker's table: `Staged`)."""

    def keys_after(self, after: str | None, limit: int) -> list[str]: ...


def keys_after(rollouts: MutableMapping[str, Any], after: str | None, limit: int) -> list[str]:
    """The first `limit` keys after `after` (None: from the first) in the mapping's order; a dict's (replay,
    tests) by the keys' own order."""
    if isinstance(rollouts, Sliced):
        return rollouts.keys_after(after, limit)
    return heapq.nsmallest(limit, (key for key in rollouts if after is None or key > after))


@dataclass
class Pass:
    """A pass over `rollouts` under way: it indexes what is due by `horizon`, a slice of keys at a time."""

    horizon: int
    after: str | None = None
    """the last key read: the next slice reads the keys after it (no cursor kept: keys come and go in between)"""
    later: dict[int, int] = field(default_factory=dict)
    """partition → the first due beyond `horizon` of the states read, or saved, since the pass began"""
    build: frozenset[int] | None = None
    """partitions whose due keys this pass writes from their states (a table from before them); None: with due keys,
    the pass reads them, not the states"""


class Assembly:
    def __init__(self, rollouts: MutableMapping[str, dict[str, Any]], events: MutableMapping[str, bytes],
                 timing: Timing = Timing(), source: str = "streams", policy: str = policies.DEFAULT_POLICY,
                 recall: Recall | None = None, horizon_ms: int | None = None, due_keys: DueKeys | None = None):
        self.rollouts = rollouts
        self.events = events
        self.timing = timing
        self.source = source
        self.policy = policy
        """the reward policy (`module:function`) that turns sessions' feedback into rewards"""
        self.recall = recall
        """how `rounds` reads back the calls a revision is built from (the worker reads them itself: `wanted`)"""
        self.recalled: dict[str, bytes] = {}
        """event id → a call event read back from the log for a revision about to be built (until recorded)"""
        self.counts: Counter[str] = Counter()
        """events, duplicates, late, trajectories, rewards_computed, reward_failures (since start)"""
        self.horizon_ms = horizon_ms
        """how far ahead of the time asked about a pass extends the due index (None: every rollout, forever)"""
        self.due_keys = due_keys
        """the due index in the table (the worker's): a pass reads the keys due by its horizon, not the states"""
        self.built: set[int] = set()
        """partitions a pass wrote the due keys of (from their states), for the worker to mark as done"""
        self._unchecked: set[str] = set()
        """rollouts in the index by a due key a pass read, not by their state: `due` checks the state first (a crash
        may have left a stale key)"""
        self._horizon = sessions.FOREVER_MS
        """every rollout due by then is in the index; the others are found by a pass over `rollouts` once a horizon
        (`look_ahead`): the index holds the open work, not the retained (`UNBUILT`: nothing known yet)"""
        self._later: dict[int, int] = {}
        """partition → a time before which none of its rollouts outside the index is due (their first due, or
        earlier where one changed since the pass: never later)"""
        self._pass: Pass | None = None
        """the pass under way, if any (it extends the index a slice at a time)"""
        self._due_at: dict[str, int] = {}
        """rollout id → when it is next due: an index of `rollouts`, so finding due work is not a scan"""
        self._queue: dict[int, list[tuple[int, str]]] = defaultdict(list)
        """partition → heap of (due, rollout id); entries that no longer match `_due_at` are stale"""
        self._decoded: dict[str, Event] = {}
        self._decoded_sizes: dict[str, int] = {}
        """event id → its raw size, of the events in `_decoded`"""
        self._decoded_bytes = 0
        """event id → the event as added, so settling soon after does not decode it again"""
        self.reindex()

    def reindex(self, now_ms: int = 0) -> None:
        """Rebuild the due index from `rollouts`, up to `horizon_ms` past `now_ms`, at once."""
        self.restart(now_ms)
        self._finish()

    def restart(self, now_ms: int, build: Iterable[int] = ()) -> None:
        """Empty the due index and begin the pass that rebuilds it up to `horizon_ms` past `now_ms` (after a worker
        restored or took over a table): the caller runs it in slices (`look_ahead`); asked what is due before it
        is done, the index finishes it first (nothing is known until then). With due keys the pass reads those
        due by then, no state; `build`: partitions without due keys (a table from before them), whose states it
        reads, every one, writing their keys (once: the worker marks them, `built`)."""
        self._due_at.clear()
        self._queue.clear()
        self._later.clear()
        self._unchecked.clear()
        self._horizon = UNBUILT
        self._begin(now_ms, frozenset(build) if build and self.due_keys is not None else None)

    def look_ahead(self, now_ms: int, limit: int) -> bool:
        """A slice of the pass over `rollouts` (at most `limit` states); whether a pass is still under way.

        A pass begins half a horizon before the index runs out and extends it by a horizon, so slices between
        a worker's batches finish it in time; one that did not (or a fold that never calls this) is finished
        at once by `due`. It reads the keys after the last one it read, in the table's order, each slice anew:
        a rollout changed or added in between, ahead of it or behind it, was indexed as it was saved (`_index`
        reaches as far as the pass does), one removed needs nothing."""
        if self._pass is None and self.horizon_ms is not None and now_ms >= self._horizon - self.horizon_ms // 2:
            self._begin(max(self._horizon, now_ms))
        if self._pass is not None:
            self._step(limit)
        return self._pass is not None

    def _begin(self, now_ms: int, build: frozenset[int] | None = None) -> None:
        if self.horizon_ms is None:
            self._pass = Pass(sessions.FOREVER_MS, build=build)
        else:
            self._pass = Pass(now_ms + self.horizon_ms, build=build)
            self.counts["due_index_passes"] += 1

    def _step(self, limit: int) -> None:
        """Index the next `limit` states of the pass (or due keys); at its end, the index reaches its horizon."""
        under_way = self._pass
        assert under_way is not None
        self.counts["due_index_slices"] += 1
        if self.due_keys is not None and under_way.build is None:
            return self._step_keys(under_way, limit)
        keys = keys_after(self.rollouts, under_way.after, limit)
        for rollout_id in keys:
            self._index_read(rollout_id, self.rollouts[rollout_id], under_way)
        if len(keys) == limit:
            under_way.after = keys[-1]
        else:
            self._done(under_way)

    def _step_keys(self, under_way: Pass, limit: int) -> None:
        """Index the rollouts of the next (at most) `limit` due keys due by the pass's horizon, partition by
        partition: a partition's first key beyond it is where its index ends (`_later`), the rest of its keys
        (its retained sessions) are not read."""
        assert self.due_keys is not None
        read = 0
        while read < limit:
            jumped = False
            for key in self.due_keys.keys_from(under_way.after):
                read += 1
                partition, due, rollout_id = parse_due_key(key)
                if due > under_way.horizon:
                    self._beyond(partition, due, under_way)
                    under_way.after, jumped = next_partition(partition), True
                    break
                under_way.after = key
                self._candidate(partition, due, rollout_id)
                if read >= limit:
                    break
            if not jumped and read < limit:  # no key left
                self._done(under_way)
                break
        self.counts["due_index_keys_read"] += read

    def _done(self, under_way: Pass) -> None:
        self._horizon, self._later, self._pass = under_way.horizon, under_way.later, None
        if under_way.build:
            self.built |= under_way.build
            self.counts["due_keys_built"] += len(under_way.build)

    def _finish(self) -> None:
        """The pass under way done at once: every state read in the mapping's own order, from the first (again,
        for those a slice read: a dict lists no keys from a key on without going over all of them); with due keys,
        the keys due by its horizon."""
        under_way = self._pass
        if under_way is not None and self.due_keys is not None and under_way.build is None:
            while self._pass is under_way:
                self._step_keys(under_way, 100 * SLICE)
        elif under_way is not None:
            for rollout_id, state in self.rollouts.items():  # (one state decoded at a time, not all of them at once)
                self._index_read(rollout_id, state, under_way)
            self._done(under_way)

    def _index_read(self, rollout_id: str, state: dict[str, Any], under_way: Pass) -> None:
        """A state a pass read: indexed, and where the pass builds its partition's due keys, its key written."""
        self.counts["due_index_states_read"] += 1
        self._index(rollout_id, state)
        if under_way.build and state["partition"] in under_way.build and state["due"] < sessions.FOREVER_MS:
            assert self.due_keys is not None
            self.due_keys.put(state["partition"], due_key(state["partition"], state["due"], rollout_id))

    def _candidate(self, partition: int, due: int, rollout_id: str) -> None:
        """A rollout a due key says is due at `due`, by the pass's horizon: indexed there (the earliest, where it is
        already: a stale key comes before the right one or after it), checked against its state when due."""
        known = self._due_at.get(rollout_id)
        if known is None or due < known:
            self._due_at[rollout_id] = due
            self._unchecked.add(rollout_id)
            heapq.heappush(self._queue[partition], (due, rollout_id))

    def _beyond(self, partition: int, due: int, under_way: Pass | None) -> None:
        """A rollout of `partition` due after the index's horizon (or the pass's): none of them is due before the
        first such (`_later`)."""
        self._later[partition] = min(due, self._later.get(partition, due))
        if under_way is not None:  # (what `_later` will be once the pass is done)
            under_way.later[partition] = min(due, under_way.later.get(partition, due))

    def _catch_up(self, now_ms: int) -> None:
        """The index complete up to `now_ms` (or built, after `restart`): the pass under way finished at once, and
        another begun and finished if that is not enough."""
        while now_ms > self._horizon:
            if self._pass is None:
                self._begin(now_ms)
            self._finish()

    def _index(self, rollout_id: str, state: dict[str, Any]) -> None:
        due, under_way = state["due"], self._pass
        self._unchecked.discard(rollout_id)
        if due > (self._horizon if under_way is None else under_way.horizon):  # (a heap entry it had is stale now)
            self._due_at.pop(rollout_id, None)
            self._beyond(state["partition"], due, under_way)
        elif self._due_at.get(rollout_id) != due:
            self._due_at[rollout_id] = due
            heapq.heappush(self._queue[state["partition"]], (due, rollout_id))

    # --- adding events ---------------------------------------------------------------------------

    def add(self, event: Event, raw: bytes, partition: int, offset: int | None = None) -> str | None:
        """Take one event (read at `offset` of its topic's `partition`, where known); return why it is late (for
        the deadletter topic), or None."""
        rollout_id = event.rollout_id
        if rollout_id is None:
            raise ValueError(f"a {event.type} event without a rollout_id belongs to no attempt")
        if is_session_rollout(rollout_id):
            return self._add_session(event, raw, partition, offset)
        state = self.rollouts.get(rollout_id) or {"partition": partition, "latest": None, "attempts": {}}
        attempt_id = event.attempt_id or state["latest"] or NO_ATTEMPT
        attempt = state["attempts"].get(attempt_id)
        heartbeat = type(event) is RolloutHeartbeatEvent  # (exact types: `isinstance` on a model class costs more)
        if attempt is not None and event.id in attempt["ids"]:
            self.counts["duplicates"] += 1
            if not attempt.get("settled") and not heartbeat:
                # a worker that died between writing the state and the event: handled again, it completes
                self.events.setdefault(event.id, raw)
            return None
        if attempt is not None and attempt.get("settled"):
            self.counts["late"] += 1
            return (f"late: attempt {attempt_id} of rollout {rollout_id} was settled "
                    f"(trajectory {attempt['settled']['trajectory']}) before this {event.type} event arrived")
        if attempt is None:
            attempt = state["attempts"][attempt_id] = {"ids": [], "managed": False, "awaits_reward": True,
                                                       "last": event.time, "end": None, "reward_at": None}
        self._apply(attempt, event)
        self.counts["events"] += 1
        if not heartbeat:  # heartbeats only keep an attempt alive
            self.events[event.id] = raw
            self._keep_decoded(event, raw)
        if event.attempt_id and (state["latest"] is None or type(event) is RolloutQueuedEvent):
            state["latest"] = event.attempt_id
        self._save(rollout_id, state)
        return None

    def _keep_decoded(self, event: Event, raw: bytes) -> None:
        if len(self._decoded) >= DECODED_MAX or self._decoded_bytes >= DECODED_BYTES_MAX:
            self._decoded.clear()
            self._decoded_sizes.clear()
            self._decoded_bytes = 0
        self._decoded[event.id] = event
        self._decoded_sizes[event.id] = len(raw)
        self._decoded_bytes += len(raw)

    def _forget_decoded(self, event_id: str) -> None:
        if self._decoded.pop(event_id, None) is not None:
            self._decoded_bytes -= self._decoded_sizes.pop(event_id, 0)

    def decoded(self, event_id: str) -> Event | None:
        """An event held for an open attempt, decoded (once: kept from `add` while there is room), or a call read
        back for a revision."""
        event = self._decoded.get(event_id)
        if event is None and (raw := self.events.get(event_id)) is not None:
            event = decode(raw)
        if event is None and (raw := self.recalled.get(event_id)) is not None:
            try:
                event = decode(raw)
            except DecodeError:
                return None
            if event.id != event_id:  # a record that is not the call referred to (a topic made again): none
                return None
        return event

    @staticmethod
    def _apply(attempt: dict[str, Any], event: Event) -> None:
        attempt["ids"].append(event.id)
        attempt["last"] = max(attempt["last"], event.time)
        if type(event) is RolloutQueuedEvent:
            attempt["managed"] = event.data.managed
            attempt["awaits_reward"] = event.data.task.reward_fn is None
            attempt["reward_fn"] = event.data.task.reward_fn
        elif type(event) is RewardEvent:
            if attempt["reward_at"] is None or event.time < attempt["reward_at"]:
                attempt["reward_at"] = event.time
        elif event.type in TERMINAL_TYPES and attempt["end"] is None:
            by_agent = type(event) is RolloutFinishedEvent and event.data.by == "agent"
            if not (by_agent and attempt["managed"]):  # the controller reports how a managed attempt ended
                attempt["end"] = {"id": event.id, "type": event.type, "time": event.time}

    def _save(self, rollout_id: str, state: dict[str, Any]) -> None:
        indexed = state.get("due")  # (as saved last: its due key's)
        state["due"] = min(map(self._due, state["attempts"].values()), default=sessions.FOREVER_MS)
        if held := state.get("held"):  # a session's events not folded yet: due when they are (`release`)
            state["due"] = sessions.held_due(held, state["due"], self.timing)
        if self.due_keys is not None and state["due"] != indexed:
            self._move_key(rollout_id, state["partition"], indexed, state["due"])
        self.rollouts[rollout_id] = state  # written back whole: a Faust table records changes on assignment
        self._index(rollout_id, state)

    def _move_key(self, rollout_id: str, partition: int, before: int | None, after: int | None) -> None:
        """The rollout's due key from `before` to `after` (None: none; never due: none)."""
        assert self.due_keys is not None
        if after is not None and after < sessions.FOREVER_MS:
            self.due_keys.put(partition, due_key(partition, after, rollout_id))
        if before is not None and before < sessions.FOREVER_MS:
            self.due_keys.drop(partition, due_key(partition, before, rollout_id))

    def _due(self, attempt: dict[str, Any]) -> int:
        settled = attempt.get("settled")
        if settled:
            if "session" in attempt:
                return sessions.settled_due(attempt, self.timing)
            return int(settled["time"]) + self.timing.retention_ms
        decided = attempt.get("decided")
        return int(decided["at"]) if decided else finalize_at(attempt, self.timing)

    # --- settling ----------------------------------------------------------------------------------

    def next_due(self, partitions: Iterable[int]) -> int | None:
        """When the first rollout of these partitions is due (beyond the index's horizon: when the first was due
        at the last pass, or earlier where one changed since; never later).

        Stale entries at the heads are dropped first: `due` leaves the rollouts it found in the heap,
        and settling them re-indexes them, so a stale head in the past would read as "something is
        due now, held back" and the worker's timer would wait a whole tick instead of until the
        next attempt is due, adding that wait to every trajectory's delay.
        """
        if self._horizon == UNBUILT:
            self._finish()
        heads = []
        for partition in partitions:
            heap = self._queue.get(partition)
            while heap and self._due_at.get(heap[0][1]) != heap[0][0]:
                heapq.heappop(heap)
            if heap:
                heads.append(heap[0][0])
            if partition in self._later:
                heads.append(self._later[partition])
        return min(heads) if heads else None

    def any_due(self, now_ms: int, partition: int) -> bool:
        """Whether `due(now_ms, [partition])` may find a rollout (its first entry is due, if stale maybe)."""
        if self._horizon == UNBUILT:
            self._finish()
        heap = self._queue.get(partition)
        if heap and heap[0][0] <= now_ms:
            return True
        return partition in self._later and self._later[partition] <= now_ms  # (`due` passes over the table first)

    def indexed(self) -> int:
        """Rollouts in the due index (those due within its horizon)."""
        return len(self._due_at)

    def due(self, now_ms: int, partitions: Iterable[int] | None = None) -> list[str]:
        """Rollouts of these partitions with an attempt to settle or to forget by `now_ms`."""
        self._catch_up(now_ms)
        found: dict[str, None] = {}
        for partition in list(self._queue) if partitions is None else partitions:
            heap = self._queue.get(partition) or []
            current = []
            while heap and heap[0][0] <= now_ms:
                due, rollout_id = heapq.heappop(heap)
                if self._due_at.get(rollout_id) == due and rollout_id not in found:
                    if rollout_id in self._unchecked and not self._checked(partition, due, rollout_id):
                        continue
                    found[rollout_id] = None
                    current.append((due, rollout_id))
            for entry in current:  # still due until settled: settling re-indexes them
                heapq.heappush(heap, entry)
        return list(found)

    def _checked(self, partition: int, due: int, rollout_id: str) -> bool:
        """Whether a rollout indexed by its due key is due then by its state; a stale key (a crash between the
        changelog records of its state and its keys) dropped, the rollout indexed by its state."""
        assert self.due_keys is not None
        self._unchecked.discard(rollout_id)
        state = self.rollouts.get(rollout_id)
        self.counts["due_index_states_read"] += 1
        if state is not None and state["due"] == due:
            return True
        self.counts["due_keys_stale"] += 1
        self.due_keys.drop(partition, due_key(partition, due, rollout_id))
        self._due_at.pop(rollout_id, None)
        if state is not None:  # (its own key put again: a re-write at worst)
            self._move_key(rollout_id, state["partition"], None, state["due"])
            self._index(rollout_id, state)
        return False

    def open_attempts(self) -> int:
        """Attempts not settled yet (a scan of the state: for checks, not for every request)."""
        return sum(not attempt.get("settled") for state in list(self.rollouts.values())
                   for attempt in state["attempts"].values())

    def settle(self, rollout_id: str, now_ms: int) -> Settled:
        """What settling the rollout's due attempts yields; nothing is changed until `record(settled)`.

        The worker publishes the events first and records after the broker acknowledged them, so a
        crash in between settles the attempt again (same ids) rather than losing its trajectory.
        """
        out = Settled(rollout_id)
        state = self.rollouts.get(rollout_id) or {"attempts": {}}
        # a session's held event comes before what is due at or after its time (`release`)
        held_from = min((entry[1] for entry in state.get("held", ())), default=sessions.FOREVER_MS)
        for attempt_id, attempt in state["attempts"].items():
            due = self._due(attempt)
            if due > now_ms or due >= held_from:
                continue
            if attempt.get("settled"):
                if "session" in attempt and sessions.pending(attempt):
                    self._rescore(out, attempt_id, attempt, now_ms)
                else:
                    out.forgotten.append(attempt_id)
            elif "session" in attempt:
                self._settle_session(out, attempt_id, attempt, now_ms)
            else:
                self._settle(out, attempt_id, attempt, now_ms)
        return out

    def settle_due(self, now_ms: int, partitions: Iterable[int] | None = None) -> Settled:
        """Every attempt due by `now_ms` settled and recorded at once, sessions' held events folded in between
        (`release`): a fold that publishes nothing (replay's, tests'). What it yielded, and the late events."""
        out = Settled("all")
        for rollout_id in self.due(now_ms, partitions):
            for settled in self.rounds(rollout_id, now_ms, out.late):
                self.record(settled)
                out.extend(settled)
        return out

    def rounds(self, rollout_id: str, now_ms: int, late: list[tuple[bytes, str]]) -> Iterator[Settled]:
        """Release, settle, and again while a settling let more held events through; the caller records each
        settling before the next round (late: where the released events late for a conversation go). A settling
        that settles nothing (only held events were due) is not yielded: there is nothing to record."""
        while True:
            late += self.release(rollout_id, now_ms)
            if self.recall is not None and (refs := self.wanted(rollout_id, now_ms)):
                self.recalled.update(self.recall(refs))
            settled = self.settle(rollout_id, now_ms)
            if not (settled.attempts or settled.forgotten or settled.trajectories or settled.late):
                return
            yield settled
            if not self.releasable(rollout_id, now_ms):
                return

    def wanted(self, rollout_id: str, now_ms: int) -> list[CallRef]:
        """The calls that settling the rollout by `now_ms` may build a revision from and that the state holds by
        reference only: to read back from the calls topic (into `recalled`) before `settle`."""
        state = self.rollouts.get(rollout_id)
        if state is None:
            return []
        refs: list[CallRef] = []
        for attempt in state["attempts"].values():
            marker = attempt.get("settled")
            built = marker.get("built") if marker and "session" in attempt else None
            if built is None or self._due(attempt) > now_ms or not sessions.pending(attempt):
                continue
            offsets = sessions.call_offsets(attempt)
            refs += [(state["partition"], offsets[event_id], event_id) for event_id in built["ids"]
                     if event_id in offsets and event_id not in self.events and event_id not in self.recalled]
        return refs

    def decide(self, settled: Settled) -> None:
        """Record what the attempts' trajectories are built from, before they are published.

        Settled again after a crash (the trajectory published, the settled marker lost), an attempt
        is built from these same events, whatever arrived since: the repeat is the same bytes.
        """
        state = self.rollouts.get(settled.rollout_id)
        if state is None or not settled.decided:
            return
        changed = False
        for attempt_id, decided in settled.decided.items():
            attempt = state["attempts"][attempt_id]
            if attempt.get("decided") != decided:
                attempt["decided"] = decided
                changed = True
        if changed:
            self._save(settled.rollout_id, state)

    def record(self, settled: Settled) -> None:
        """Mark what `settle` settled as settled, and forget what it found expired."""
        state = self.rollouts.get(settled.rollout_id)
        if state is None:
            return
        done: list[str] = []
        for attempt_id, marker in settled.attempts.items():
            attempt = state["attempts"][attempt_id]
            attempt.pop("decided", None)
            if "session" in attempt and "settled" not in attempt and marker["trajectory"] is not None:
                self.counts["sessions_without_feedback"] += not marker["feedback"]  # counted, never guessed
            attempt["settled"] = marker
            attempt["ids"] += [reward.id for reward in settled.rewards if reward.attempt_id == attempt_id]
            if "session" in attempt:  # feedback timed after the settling waits, held, to be scored; what the
                # trajectory was built from is held until the conversation is forgotten, for its revisions: its
                # calls as their offsets in the calls topic where those are known, read back for a revision
                built = marker.get("built", {}).get("ids", ())
                referred = sessions.call_offsets(attempt)
                held = {entry[0] for entry in sessions.pending(attempt)} | {i for i in built if i not in referred}
                done += [event_id for event_id in attempt["ids"] if event_id not in held]
                for event_id in built:
                    self.recalled.pop(event_id, None)
                for event_id in held:  # kept raw (on disk with --store rocksdb) for `--session-retention-s`, not
                    self._forget_decoded(event_id)  # decoded in memory: a revision decodes them again
            else:
                done += attempt["ids"]
        for attempt_id in settled.forgotten:
            done += state["attempts"].pop(attempt_id)["ids"]  # a crash may have left some of their events
        if state["attempts"] or "segments" in state:  # (a session keeps its numbering: segment ids stay unique)
            self._save(settled.rollout_id, state)
        else:
            del self.rollouts[settled.rollout_id]
            self._due_at.pop(settled.rollout_id, None)
            self._unchecked.discard(settled.rollout_id)
            if self.due_keys is not None:
                self._move_key(settled.rollout_id, state["partition"], state.get("due"), None)
        for event_id in done:  # after the state: a crash in between leaves events behind, never loses one
            self.events.pop(event_id, None)
            self._forget_decoded(event_id)
        self.counts["trajectories"] += len(settled.trajectories)
        for trajectory in settled.trajectories:
            if trajectory.data.revision_of is not None:
                self.counts["revisions"] += 1
            else:
                self.counts["sessions"] += trajectory.data.session_id is not None
        self.counts["late_feedback_rewards"] += sum(reward.data.trajectory_id is not None for reward in settled.rewards)
        self.counts["rewards_computed"] += len(settled.rewards)
        self.counts["reward_failures"] += len(settled.unscored)
        self.counts["revisions_unavailable"] += len(settled.unrevised)
        self.counts["late"] += len(settled.late)

    def _settle(self, out: Settled, attempt_id: str, attempt: dict[str, Any], now_ms: int) -> None:
        """Settle one attempt of `out`'s rollout into `out`."""
        rollout_id = out.rollout_id
        # an attempt decided before a crash is built as decided then (see `decide`)
        decided = attempt.get("decided") or {
            "at": finalize_at(attempt, self.timing), "end": attempt["end"], "awaits_reward": attempt["awaits_reward"],
            "reward_fn": attempt.get("reward_fn"), "ids": None}
        at, chosen = decided["at"], None if decided["ids"] is None else set(decided["ids"])
        if chosen is not None and not self._holds(chosen, at, now_ms):
            return  # its events are being read again after a restart: settled once they are back
        events: list[Event] = []
        for event_id in attempt["ids"]:
            if event_id not in self.events:
                continue  # a heartbeat (or, long overdue, an event that never came back)
            # (the raw event read only where needed: a worker's table copies it to bytes on each read)
            event = self._decoded.get(event_id) or decode(self.events[event_id])
            if (event.time <= at) if chosen is None else event_id in chosen:
                events.append(event)
            else:
                out.late.append((self.events[event_id], f"late: its time is after attempt {attempt_id} of rollout "
                                                        f"{rollout_id} settled (at {at})"))
        end = decided["end"]
        status = STATUS_OF[end["type"]] if end else "abandoned"
        reward_fn = decided["reward_fn"]
        ending = Ending(status, end["time"] if end else at,
                        reward_expected=status == "finished" and (decided["awaits_reward"] or bool(reward_fn)))
        trajectory = build(rollout_id, attempt_id, events, ending, self.source)
        if reward_fn and status == "finished":
            scored = self._score(reward_fn, rollout_id, attempt_id, events, trajectory)
            if isinstance(scored, RewardEvent):
                out.rewards.append(scored)
                trajectory = with_reward(trajectory, events, scored, ending)
            else:
                out.unscored.append((encode(trajectory), scored))
        out.trajectories.append(trajectory)
        out.attempts[attempt_id] = {"trajectory": trajectory.id, "time": at}
        out.decided[attempt_id] = {**decided, "ids": [event.id for event in events]}

    # --- sessions (streams/sessions.py) ----------------------------------------------------------

    def _add_session(self, event: Event, raw: bytes, partition: int, offset: int | None) -> str | None:
        """Take one event of a session: held (`release` folds it into its conversation once its time is reached)."""
        rollout_id = str(event.rollout_id)
        state = self.rollouts.get(rollout_id) or sessions.new_state(partition)
        attempts = state["attempts"]
        holder = next((attempt for attempt in attempts.values() if event.id in attempt["ids"]), None)
        if type(event) is RewardEvent and event.data.reward_fn:
            # the policy's own output, read back: made again from the feedback, never an input (read twice, as
            # after a worker that published it again, it is a repeat to drop, not an event to keep)
            read_back = attempts.get(event.attempt_id) or attempts.get(state["latest"])
            if holder is not None:
                self.counts["duplicates"] += 1
            elif read_back is not None:
                read_back["ids"].append(event.id)
                self._save(rollout_id, state)
            return None
        if holder is not None or any(entry[0] == event.id for entry in state.get("held", ())):
            self.counts["duplicates"] += 1
            if holder is None or not holder.get("settled") or any(
                    entry[0] == event.id for entry in sessions.pending(holder)):
                self.events.setdefault(event.id, raw)  # (as in `add`: a worker that died between state and event)
            return None
        state.setdefault("held", []).append(sessions.held_entry(event, offset if type(event) is CallEvent else None))
        self.counts["events"] += 1
        self.events[event.id] = raw
        self._keep_decoded(event, raw)
        self._save(rollout_id, state)
        return None

    def release(self, rollout_id: str, now_ms: int) -> list[tuple[bytes, str]]:
        """Fold a session's held events timed at most `now_ms` - `settle_ms` into its conversations, in event-time
        order; the ones late for a conversation already settled, (encoded event, reason), for the deadletter topic.

        The caller passes the watermark, so every source topic was read up to their time, and `settle_ms` more
        lets events other producers wrote after them arrive: an end read ahead of its conversation's calls (the
        rollouts topic fetched before the calls topic, or written first) is folded after them, as a rebuild
        merging the topics by time folds it. An event comes after any settling due before its time: the release
        stops there, and the caller settles and records (`rounds`), then releases the rest."""
        state = self.rollouts.get(rollout_id)
        held = state.get("held") if state else None
        if state is None or not held:
            return []
        held.sort(key=sessions.held_order)
        late: list[tuple[bytes, str]] = []
        taken = 0
        for entry in held:
            event_id, time = entry[0], entry[1]
            if time > now_ms - self.timing.settle_ms or time > self._attempts_due(state):
                break
            event = self.decoded(event_id)
            if event is None:  # a worker that died between state and event: it is being read again
                if now_ms <= time + self.timing.idle_timeout_ms:
                    break
                self.counts["session_events_lost"] += 1
            elif reason := self._apply_session(state, event, sessions.held_offset(entry)):
                late.append((self.events[event_id], reason))
                self.events.pop(event_id, None)
                self._forget_decoded(event_id)
            taken += 1
        del held[:taken]
        if not held:
            del state["held"]
        self._save(rollout_id, state)
        return late

    def releasable(self, rollout_id: str, now_ms: int) -> bool:
        """Whether `release(rollout_id, now_ms)` would fold an event (one held back by a settling due first)."""
        state = self.rollouts.get(rollout_id)
        held = state.get("held") if state else None
        if state is None or not held:
            return False
        first: int = min(entry[1] for entry in held)
        return first <= min(now_ms - self.timing.settle_ms, self._attempts_due(state))

    def _attempts_due(self, state: dict[str, Any]) -> int:
        return min(map(self._due, state["attempts"].values()), default=sessions.FOREVER_MS)

    def _apply_session(self, state: dict[str, Any], event: Event, offset: int | None) -> str | None:
        """Fold one held event of a session into the conversation (segment) it belongs to; why it is late, or None."""
        attempts, kind = state["attempts"], type(event)
        session_id = self._session_id(event, state)
        attempt_id = sessions.route(state, event, session_id, self.timing)
        if attempt_id is None:  # an end that ends nothing: kept against repeats only
            attempts[state["latest"]]["ids"].append(event.id)
            self.counts["session_ends_ignored"] += 1
            self.events.pop(event.id, None)
            return None
        attempt = attempts[attempt_id]
        if attempt.get("settled") and kind is not FeedbackEvent:
            self.counts["late"] += 1
            return (f"late: conversation {attempt_id} of session {session_id} was settled (trajectory "
                    f"{attempt['settled']['trajectory']}) before this {event.type} event arrived")
        attempt["ids"].append(event.id)
        attempt["last"] = max(attempt["last"], event.time)
        if kind is CallEvent:
            attempt["calls"].append([event.id, event.time] if offset is None else [event.id, event.time, offset])
            attempt["call_last"] = max(attempt["call_last"] or event.time, event.time)
            sessions.joined(state, attempt, attempt["calls"][-1])
        elif kind is FeedbackEvent or kind is RewardEvent:  # (a reward posted for the session: its first word too)
            if type(event) is FeedbackEvent:
                attempt["fb"].append([event.id, event.time, event.data.call_id])
            if attempt["reward_at"] is None or event.time < attempt["reward_at"]:
                attempt["reward_at"] = event.time
        elif kind is SessionEndedEvent:
            attempt["end"] = {"id": event.id, "type": event.type, "time": event.time}
            sessions.split_after_end(state, attempt, session_id, self.timing)
        return None

    @staticmethod
    def _session_id(event: Event, state: dict[str, Any]) -> str:
        data = event.data
        found = getattr(data, "session_id", None)
        if found:
            return str(found)
        known = next(iter(state["attempts"].values()), None)
        return str(known["session"]) if known else str(event.rollout_id)

    def _settle_session(self, out: Settled, attempt_id: str, attempt: dict[str, Any], now_ms: int) -> None:
        """Settle one conversation of a session into its trajectory, rewarded by the policy's reading of its
        feedback so far; feedback timed after the settling stays, to be scored when due (`_rescore`)."""
        rollout_id, session_id = out.rollout_id, attempt["session"]
        decided = attempt.get("decided") or {"at": finalize_at(attempt, self.timing), "end": attempt["end"],
                                             "ended_at": sessions.ended_at(attempt, self.timing),
                                             "policy": self.policy, "ids": None}
        at, chosen = decided["at"], None if decided["ids"] is None else set(decided["ids"])
        if chosen is not None and not self._holds(chosen, at, now_ms):
            return
        waiting = {entry[0] for entry in attempt["fb"]}
        events: list[Event] = []
        for event_id in attempt["ids"]:
            if event_id not in self.events:
                continue
            event = self._decoded.get(event_id) or decode(self.events[event_id])
            if (event.time <= at) if chosen is None else event_id in chosen:
                events.append(event)
            elif event_id not in waiting:  # (feedback after the settling is scored later, not late)
                out.late.append((self.events[event_id], f"late: its time is after conversation {attempt_id} of "
                                                        f"session {session_id} settled (at {at})"))
        feedback = sorted((e for e in events if type(e) is FeedbackEvent), key=lambda e: (e.time, e.id))
        end = decided["end"]
        reason = "ended by the client" if end else f"no call for {self.timing.session_idle_ms / 1000:g} s"
        ending = Ending("finished", decided["ended_at"], reward_expected=True, reason=reason)
        if not any(type(e) is CallEvent for e in events):
            for event in feedback:  # nothing to reward: the session is unknown here
                out.late.append((self.events[event.id], f"no calls of session {session_id} are known (never seen "
                                 "here, or forgotten after --session-retention-s): its feedback rewards nothing"))
            out.attempts[attempt_id] = {"trajectory": None, "time": at, "turns": [],
                                        "feedback": [[e.id, e.time, self.events[e.id].decode()] for e in feedback]}
            out.decided[attempt_id] = {**decided, "ids": [event.id for event in events]}
            return
        trajectory = build(rollout_id, attempt_id, events, ending, self.source, session_id=session_id)
        turns = [turn.call_id for turn in trajectory.data.turns]
        if feedback:
            scored = self._policy_reward(out, decided["policy"], session_id, attempt_id, turns, feedback,
                                         derived_id("reward", trajectory.id, decided["policy"], feedback[-1].id),
                                         trajectory.time, None)
            if scored is not None:
                trajectory = with_reward(trajectory, events, scored, ending)
        out.trajectories.append(trajectory)
        # what it was built from stays held (`record`), for a revision when later feedback changes its reward
        built = {"ids": [event.id for event in events], "ended_at": decided["ended_at"], "reason": reason}
        out.attempts[attempt_id] = {"trajectory": trajectory.id, "time": at, "turns": turns, "built": built,
                                    "feedback": [[e.id, e.time, self.events[e.id].decode()] for e in feedback]}
        out.decided[attempt_id] = {**decided, "ids": [event.id for event in events]}

    def _rescore(self, out: Settled, attempt_id: str, attempt: dict[str, Any], now_ms: int) -> None:
        """Feedback that came after a conversation's trajectory: the policy's reward over all its feedback so
        far, as a `reward` event naming the trajectory."""
        marker = attempt["settled"]
        due = [entry for entry in sessions.pending(attempt) if entry[1] + self.timing.settle_ms <= now_ms]
        fresh = [event for entry in due if (event := self.decoded(entry[0])) is not None]
        if not fresh:
            return
        known: list[Event] = [decode(raw) for _, _, raw in marker["feedback"]]
        feedback = sorted((e for e in [*known, *fresh] if type(e) is FeedbackEvent), key=lambda e: (e.time, e.id))
        if marker["trajectory"] is None:
            for event in fresh:
                out.late.append((self.events[event.id], f"no calls of session {attempt['session']} are known (never "
                                 "seen here, or forgotten after --session-retention-s): its feedback rewards nothing"))
        elif feedback:
            newest = max(fresh, key=lambda e: (e.time, e.id))
            reward = self._policy_reward(out, self.policy, attempt["session"], attempt_id, marker["turns"], feedback,
                                         derived_id("reward", marker["trajectory"], self.policy, newest.id),
                                         newest.time, marker["trajectory"])
            if reward is not None:
                self._revise(out, attempt_id, attempt, reward, newest)
        out.attempts[attempt_id] = {**marker, "feedback": [*marker["feedback"], *(
            [e.id, e.time, self.events[e.id].decode()] for e in fresh if e.id in self.events)]}

    def _revise(self, out: Settled, attempt_id: str, attempt: dict[str, Any], reward: RewardEvent,
                feedback: Event) -> None:
        """The conversation's trajectory again, built from the same events, with the reward of its later feedback:
        a revision (`revised`), so the trainer, which reads trajectories only, learns from that feedback too.
        Without all of those events (calls the log no longer holds), no revision: the feedback is deadlettered."""
        marker = attempt["settled"]
        built = marker.get("built")
        if built is None:
            self.counts["revisions_unavailable"] += 1  # (settled by a worker that kept no events for revisions)
            return
        events = [event for event_id in built["ids"] if (event := self.decoded(event_id)) is not None]
        if len(events) != len(built["ids"]):
            found = {event.id for event in events}
            offsets = sessions.call_offsets(attempt)
            missing = [f"{offsets[i]}" if i in offsets else i for i in built["ids"] if i not in found]
            out.unrevised.append((self.events.get(feedback.id) or encode(feedback), (
                f"no revision of trajectory {marker['trajectory']} (conversation {attempt_id} of session "
                f"{attempt['session']}) with this feedback's reward {reward.id}: {len(missing)} of the "
                f"{len(built['ids'])} events it was built from are gone (calls topic partition "
                f"{(self.rollouts.get(out.rollout_id) or {}).get('partition')}, offsets {', '.join(missing[:5])}"
                f"{', …' if len(missing) > 5 else ''}): the calls topic keeps its records for less than "
                "--session-retention-s")))
            return
        ending = Ending("finished", built["ended_at"], reward_expected=True, reason=built["reason"])
        trajectory = build(out.rollout_id, attempt_id, events, ending, self.source, session_id=attempt["session"])
        out.trajectories.append(revised(trajectory, events, reward, ending))

    def _policy_reward(self, out: Settled, policy: str, session_id: str, attempt_id: str, turns: list[str],
                       feedback: list[FeedbackEvent], reward_id: str, time: int,
                       trajectory_id: str | None) -> RewardEvent | None:
        """The policy's reward event over this feedback, added to `out` (None: it scored nothing, or failed:
        then the feedback goes to the deadletter topic with why)."""
        view = policies.SessionFeedback(session_id, out.rollout_id, attempt_id, turns, feedback)
        try:
            reward = policies.score(policy, view)
        except rewards.RewardError as exc:
            out.unscored.append((self.events.get(feedback[-1].id) or encode(feedback[-1]),
                                 f"no reward for conversation {attempt_id} of session {session_id}: {exc}"))
            return None
        if reward is None:
            return None
        if trajectory_id is not None:
            reward = reward.model_copy(update={"trajectory_id": trajectory_id})
        event = RewardEvent(id=reward_id, time=time, source=self.source, rollout_id=out.rollout_id,
                            attempt_id=attempt_id, data=reward)
        out.rewards.append(event)
        return event

    def _holds(self, ids: set[str], at: int, now_ms: int) -> bool:
        """Whether every one of these events is in the state again; after the idle timeout, go on without."""
        return all(event_id in self.events for event_id in ids) or now_ms > at + self.timing.idle_timeout_ms

    def _score(self, reward_fn: str, rollout_id: str, attempt_id: str, events: list[Event],
               trajectory: TrajectoryEvent) -> RewardEvent | str:
        """The computed reward's event, or why there is none."""
        queued = next((e for e in events if type(e) is RolloutQueuedEvent), None)
        if queued is None:
            return f"no reward for attempt {attempt_id} of rollout {rollout_id}: its queued event (the task) is missing"
        by_id = {e.id: e.data for e in events if type(e) is CallEvent}
        calls = [by_id[turn.call_id] for turn in trajectory.data.turns]
        try:
            reward = rewards.score(reward_fn, rewards.Sample(queued.data.task, trajectory.data, calls, events))
        except rewards.RewardError as exc:
            return f"no reward for attempt {attempt_id} of rollout {rollout_id}: {exc}"
        return RewardEvent(id=derived_id("reward", trajectory.id, reward_fn),  # (the attempt's `trajectory_id`)
                           time=trajectory.time, source=self.source, rollout_id=rollout_id, attempt_id=attempt_id,
                           data=reward)


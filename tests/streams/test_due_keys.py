"""The due index kept in the worker's table (`d:` keys, tables.DueKeys): a restarted fold finds what is due from the
keys due within its horizon, reading no state; a table from before the keys gets them from one pass over its
states; a changelog cut between a state and its keys leaves a stale key, which is found out, not trusted.

The table is Faust's memory store (no broker): "written" below puts the staged changes into it as the worker's
`_flush` writes them (due keys added, states, due keys dropped, events), and a new fold over the same table is a
restarted worker's."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence as Seq
from typing import Any

import faust

import agentstream.schemas as s
from agentstream.schemas.codec import encode
from agentstream.streams.assembly import Assembly, Settled, Timing, parse_due_key
from agentstream.streams.sessions import FOREVER_MS
from agentstream.streams.tables import DROPPED, DueKeys, Staged, StateTable
from tests.streams.test_sessions import TIMING, sessions_over_a_minute
from tests.support.streams import Session

HOUR = 3_600_000
PARTITIONS = 3
KEPT = Timing(**{**TIMING.__dict__, "session_retention_ms": 30 * 24 * HOUR})
START = 1_700_000_000_000


class Fold:
    """An assembly over a table in memory, as the worker holds it (its mappings staged over the table)."""

    def __init__(self, table: StateTable, timing: Timing = KEPT, keys: bool = True, horizon_ms: int | None = HOUR):
        self.table = table
        self.rollouts, self.events = Staged(table, "r:"), Staged(table, "e:", bytes.decode, str.encode)
        self.due_keys = DueKeys(table) if keys else None
        self.assembly = Assembly(self.rollouts, self.events, timing, horizon_ms=horizon_ms, due_keys=self.due_keys)

    def written(self, states: bool = True) -> None:
        """The staged changes into the table, in the order the worker writes them; without `states`, the due keys
        added only (a changelog cut there: by a kill between two record batches)."""
        for partition in range(PARTITIONS):
            added = self.due_keys.added_of(partition) if self.due_keys else []
            rest: list[tuple[int, str, Any]] = []
            if states:
                rest = [*self.rollouts.changes_of(partition), *(self.due_keys.dropped_of(partition) if self.due_keys
                                                                 else []), *self.events.changes_of(partition)]
            for _, key, value in [*added, *rest]:
                if value is DROPPED:
                    self.table.data.pop(key, None)
                else:
                    self.table.data[key] = value


def memory_table() -> StateTable:
    app = faust.App("test-due-keys", broker="kafka://127.0.0.1:1", store="memory://")
    return StateTable(app, name="assembly", partitions=PARTITIONS)


def over_copies(table: StateTable) -> Assembly:
    """An index of everything over dicts holding copies of the table's states and events."""
    return Assembly({key[2:]: copy.deepcopy(value) for key, value in table.data.items() if key.startswith("r:")},
                    {key[2:]: value.encode() for key, value in table.data.items() if key.startswith("e:")}, KEPT)


def one_key_each(table: StateTable) -> bool:
    """Whether the table holds one due key per rollout, at its due time (none for one never due)."""
    stored = sorted(parse_due_key(key[2:])[1:] for key in table.data if key.startswith("d:"))
    return stored == sorted((value["due"], key[2:]) for key, value in table.data.items()
                            if key.startswith("r:") and value["due"] < FOREVER_MS)


def same(got: Settled, expected: Settled) -> bool:
    """The same trajectories, the same bytes (in the order settled within each partition; `settle_due` of every
    partition at once goes over them in the order its index met them)."""
    def by_partition(settled: Settled) -> list[list[bytes]]:
        return [[encode(t) for t in settled.trajectories if partition_of(t) == p] for p in range(PARTITIONS)]
    return by_partition(got) == by_partition(expected)


def partition_of(event: s.Event) -> int:
    return int(str(event.rollout_id)[-1], 16) % PARTITIONS


def fold(assembly: Assembly, events: Seq[s.Event], now: int) -> Settled:
    """Add the events in order, settling whatever is due before each one's time; then what is due by `now`."""
    out = Settled("all")
    for event in [*events, None]:
        out.extend(assembly.settle_due(now if event is None else event.time - 1))
        if event is not None:
            assert assembly.add(event, encode(event), partition_of(event)) is None
    return out


def kept_and_open(kept: int, opened: int) -> tuple[list[s.Event], list[Session]]:
    """`kept` conversations settled and kept for later feedback (30 days), `opened` still open."""
    events = []
    for i in range(kept):
        session = Session(f"chat-kept-{i}", START + 10 * i)
        events += [session.call(1_000, [1], [2]), session.end(2_000)]
    sessions = [Session(f"chat-open-{i}", START + 60_000) for i in range(opened)]
    events += [session.call(1_000, [1], [2]) for session in sessions]
    return events, sessions


def written_fold(kept: int, opened: int) -> tuple[StateTable, Fold, list[Session]]:
    """A table holding `kept_and_open` folded (with due keys) up to 70 s after `START`, written; the fold, the open
    sessions."""
    table = memory_table()
    events, sessions = kept_and_open(kept, opened)
    first = Fold(table)
    fold(first.assembly, events, START + 70_000)
    first.written()
    return table, first, sessions


def finish(fold: Fold, now: int) -> None:
    """The restarted fold's rebuild of its index, run to its end in slices (as the worker's recovery runs it)."""
    fold.assembly.restart(now)
    while fold.assembly.look_ahead(now, 100):
        pass


def test_a_restarted_fold_reads_the_due_keys_within_its_horizon_and_no_state():
    """600 conversations kept 30 days and 5 open ones, over three partitions: restarted, the fold reads the keys of
    the open ones and one key beyond its horizon per partition, not one state (the pass it replaced read all 605);
    it then finds due, and settles into the same bytes, what an index of everything over the same states does."""
    table, _, sessions = written_fold(600, 5)
    now = START + 70_000
    assert one_key_each(table)
    restarted = Fold(table)
    reads, keys = restarted.rollouts.reads, restarted.assembly.counts["due_index_keys_read"]
    finish(restarted, now)
    assert restarted.rollouts.reads == reads, "the rebuild read a state"
    assert restarted.assembly.counts["due_index_states_read"] == 0
    assert restarted.assembly.counts["due_index_keys_read"] - keys == 5 + PARTITIONS
    assert restarted.assembly.indexed() == 5
    everything = over_copies(table)
    for partition in range(PARTITIONS):
        assert restarted.assembly.next_due([partition]) == everything.next_due([partition])
    later = [session.end(5_000) for session in sessions]
    got, expected = fold(restarted.assembly, later, now + HOUR), fold(everything, later, now + HOUR)
    assert len(got.trajectories) == 5
    assert same(got, expected)
    assert restarted.assembly.counts["due_index_states_read"] == 0  # (those it settled were read by settling)


def test_a_table_from_before_the_due_keys_gets_them_from_one_pass_then_none():
    """A table written by a worker that kept no due keys: the first restart reads every state once and writes
    their keys, the same keys a table kept with them from the start holds; the next restart reads no state."""
    events, _ = kept_and_open(200, 4)
    now = START + 70_000
    old, kept = memory_table(), memory_table()
    before = Fold(old, keys=False)
    fold(before.assembly, events, now)
    before.written()
    since = Fold(kept)
    fold(since.assembly, events, now)
    since.written()
    assert not [key for key in old.data if key.startswith("d:")]
    upgraded = Fold(old)
    upgraded.assembly.restart(now, build=range(PARTITIONS))
    while upgraded.assembly.look_ahead(now, 50):
        pass
    assert upgraded.assembly.counts["due_index_states_read"] == 204 and upgraded.assembly.built == {0, 1, 2}
    upgraded.written()
    due_keys = sorted(key for key in old.data if key.startswith("d:"))
    assert due_keys == sorted(key for key in kept.data if key.startswith("d:")) and len(due_keys) == 204
    assert one_key_each(old)
    again = Fold(old)
    finish(again, now)
    assert again.assembly.counts["due_index_states_read"] == 0 and again.assembly.indexed() == 4


def test_a_stale_due_key_left_by_a_cut_changelog_is_checked_not_trusted():
    """Killed after the due keys of a batch were written and before its states: the table holds each changed
    rollout's old state, its old key and its new one. Restarted, the fold settles what an index of everything over
    those states settles, when it does: the stale keys found out by their states, dropped."""
    table, first, sessions = written_fold(30, 6)
    now = START + 70_000
    ahead = [session.call(2_000 + 10 * i, [1, 2, 3], [4]) for i, session in enumerate(sessions)]  # due later now
    fold(first.assembly, ahead, now)
    first.written(states=False)  # the keys of their new due times in, their states and the old keys' drops lost
    keys = [parse_due_key(key[2:]) for key in table.data if key.startswith("d:")]
    assert len(keys) == 30 + 2 * 6
    restarted = Fold(table)
    finish(restarted, now)
    everything = over_copies(table)
    got, expected = Settled("all"), Settled("all")
    for at in range(now, now + 30_000, 500):
        for partition in range(PARTITIONS):
            assert restarted.assembly.due(at, [partition]) == everything.due(at, [partition])
            got.extend(restarted.assembly.settle_due(at, [partition]))
            expected.extend(everything.settle_due(at, [partition]))
    assert len(got.trajectories) == 6
    assert same(got, expected)
    # settled at their old due times, re-keyed at their retention's end: the next pass meets the stale keys
    restarted.assembly.reindex(at)
    assert restarted.assembly.due(at) == []
    restarted.written()
    assert restarted.assembly.counts["due_keys_stale"] == 6 and one_key_each(table)


def test_seeded_orders_decide_as_an_index_of_everything_with_the_keys_in_the_table():
    """Passes of slices of one or two due keys between the events (a horizon of 5 s; three partitions), the changes
    written to the table now and then: at every step the fold with due keys finds due exactly what an index of
    everything over dicts finds, and the trajectories are the same bytes."""
    for seed in range(20):
        rng = random.Random(seed)
        events = sessions_over_a_minute(rng)
        table = memory_table()
        bounded, everything = Fold(table, TIMING, horizon_ms=5_000), Assembly({}, {}, TIMING)
        got, expected = Settled("all"), Settled("all")
        for event in [*events, None]:
            at = events[-1].time + 200_000 if event is None else event.time - 1
            while rng.random() < 0.7:
                bounded.assembly.look_ahead(at, rng.choice([1, 2]))
            if rng.random() < 0.3:
                bounded.written()
            assert bounded.assembly.due(at) == everything.due(at), seed
            got.extend(bounded.assembly.settle_due(at))
            expected.extend(everything.settle_due(at))
            if event is not None:
                assert bounded.assembly.add(event, encode(event), partition_of(event)) is None
                assert everything.add(event, encode(event), partition_of(event)) is None
        assert [encode(t) for t in got.trajectories] == [encode(t) for t in expected.trajectories], seed
        assert [encode(r) for r in got.rewards] == [encode(r) for r in expected.rewards]
        bounded.written()
        assert one_key_each(table), seed

"""`Staged.keys_after` on its own: the slices of the due index's pass over a table's keys under a prefix, with
the writes staged and not written yet among them."""

from __future__ import annotations

import faust
import orjson

from agentstream.streams.tables import Staged, StateTable


def staged_over(stored: dict[str, dict]) -> Staged:
    """The `r:` keys of a table in memory (Faust's memory store) holding `stored`."""
    app = faust.App("test-staged", broker="kafka://127.0.0.1:1", store="memory://")
    table = StateTable(app, name="assembly", partitions=2)
    for key, value in stored.items():
        table.data[key] = value
    return Staged(table, "r:")


def changelog_order(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda key: orjson.dumps("r:" + key))


def test_a_slice_lists_the_keys_after_the_last_one_in_the_changelogs_byte_order_with_the_staged_writes():
    """Up to `limit` keys after `after`, ordered by their JSON bytes (the disk store's order; `a"` escaped sorts
    after `a#`, unlike the strings): a staged new key among the stored ones, a staged deletion left out, a staged
    change listed once, another prefix never."""
    rollouts = staged_over({"r:a!": {}, 'r:a"': {}, "r:a#": {}, "r:b": {}, "r:d": {}, "r:f": {}, "e:c": {}})
    rollouts["c"] = {"new": True}
    rollouts["f"] = {"changed": True}
    del rollouts["d"]
    assert rollouts.keys_after(None, 3) == ["a!", "a#", 'a"']
    assert rollouts.keys_after('a"', 2) == ["b", "c"]
    assert rollouts.keys_after("c", 5) == ["f"]
    assert rollouts.keys_after("f", 5) == []
    assert rollouts.keys_after(None, 100) == changelog_order(["a!", 'a"', "a#", "b", "c", "f"])


def test_slices_resumed_after_changes_in_between_read_every_key_once():
    """A pass a slice at a time whatever happens between slices: the last key read dropped (the next slice
    resumes after it all the same), a key added ahead of it (read) and one behind it (not read: the worker
    indexes a rollout as it saves it), a staged new key written to the table meanwhile (read once)."""
    rollouts = staged_over({f"r:{i:02d}": {} for i in range(10)})
    rollouts["045"] = {}
    read: list[str] = []
    after = None
    while found := rollouts.keys_after(after, 3):
        read += found
        after = found[-1]
        if len(read) == 3:
            del rollouts[after]  # ("02": dropped after it was read)
            rollouts["07a"] = {}  # ahead
            rollouts["00a"] = {}  # behind
            for _, key, value in rollouts.changes(["045"]):  # the staged "045" written: in the table, not staged
                rollouts.table.data[key] = value
    expected = changelog_order([f"{i:02d}" for i in range(10)] + ["045", "07a"])
    assert read == expected, "every key once, in order"
    assert len(read) == len(set(read))

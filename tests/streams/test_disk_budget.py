"""The disk store's databases within one memory budget, also when they are opened again (a restarted worker)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import faust
import orjson
import rocksdict
from faust.types import TP

from agentstream.streams.disk import BESIDE_CACHE, MB, WRITE_BUFFER_OUT, BoundedOptions, Budget, ordered_keys
from agentstream.streams.tables import Staged, StateTable


def fill(options: BoundedOptions, path: Path, megabytes: int) -> None:
    """`megabytes` of values (incompressible enough: each its own bytes) written, flushed and closed."""
    db = options.open(path)
    for i in range(megabytes * 64):
        db.put(f"e:{i:08d}".encode(), (str(i) * 2048)[:16 * 1024].encode())
    db.flush()
    db.close()


def read_all(options: BoundedOptions, paths: list[Path], dbs: list[rocksdict.Rdict] | None = None) -> list[rocksdict.Rdict]:
    """The databases at `paths` opened again (or `dbs`, opened), every value read."""
    dbs = dbs or [options.open(path) for path in paths]
    for db in dbs:
        cursor = db.iter()
        cursor.seek_to_first()
        while cursor.valid():
            cursor.value()
            cursor.next()
    return dbs


def test_reopened_databases_share_the_budgets_cache_not_one_each(tmp_path):
    """rocksdict reopens a database with its column family's options read back from its OPTIONS file unless they
    are named: a block cache of its own (8 MiB) per database, outside the budget. Two databases of 12 MiB each,
    opened again and read through: one cache of the budget's size holds their blocks, within it."""
    paths = [tmp_path / "assembly-0.db", tmp_path / "assembly-1.db"]
    for path in paths:
        fill(BoundedOptions(Budget(16)), path, 12)
    budget = Budget(16)  # (a new process: a new cache)
    dbs = read_all(BoundedOptions(budget), paths)
    capacities = {db.property_int_value("rocksdb.block-cache-capacity") for db in dbs}
    assert capacities == {budget.cache_bytes}
    usages = {db.property_int_value("rocksdb.block-cache-usage") for db in dbs}
    assert usages == {budget.usage()}, "each database reports the one shared cache"
    assert 8 * MB < budget.usage() <= 16 * MB + MB  # more than a cache of its own held (24 MiB read), within the budget


def test_the_keys_in_order_from_a_key_on_across_the_databases_and_the_held_changes(tmp_path):
    """A pass over the table's keys a slice at a time (`ordered_keys`): each slice seeks every partition's database
    to the last key read and merges them with the changes held (not acknowledged yet), in the changelog's byte
    order; what changed between two slices, ahead of the last key, is read, and every key once."""
    options = BoundedOptions(Budget(8))
    dbs = [options.open(tmp_path / f"assembly-{n}.db") for n in range(2)]
    for i in range(20):
        dbs[i % 2].put(f'"r:{i:02d}"'.encode(), b"{}")
    dbs[0].put(b'"e:00"', b"{}")  # another prefix
    dbs[1].put(b"__offset__", b"7")
    held = {b'"r:03"': (1, None), b'"r:04"': (1, b"{}"), b'"r:045"': (1, b"{}")}  # dropped, changed, added
    read: list[bytes] = []
    after = None
    while True:
        found = list(itertools.islice(ordered_keys(dbs, b'"r:', after, held, b"__offset__"), 3))
        read += found
        if len(found) < 3:
            break
        after = found[-1]
        if len(read) == 6:  # between two slices: one added ahead of the last key read, one behind it
            dbs[1].put(b'"r:99"', b"{}")
            held[b'"r:00a"'] = (2, b"{}")
    expected = sorted([f'"r:{i:02d}"'.encode() for i in range(20) if i != 3] + [b'"r:045"', b'"r:99"'])
    assert read == expected


def test_the_key_index_holds_keys_of_their_own_size_not_orjsons_buffers(tmp_path):
    """Faust's store keeps the last 1,000 keys read (its key index: key → partition), as the store encodes them.
    orjson's bytes keep the whole buffer they were written in (4 KiB): 1,000 keys held 4 MiB outside the budget.
    Read through the disk store, 1,000 keys of ~15 bytes cost the index their size."""
    app = faust.App("test-key-index", broker="kafka://127.0.0.1:1", datadir=str(tmp_path))
    table = StateTable(app, name="assembly", partitions=1, budget=Budget(8))
    store = table.disk
    assert store is not None
    db = store._db_for_partition(0)
    keys = [f"r:chat-{i}" for i in range(1000)]
    for key in keys:
        db.put(orjson.dumps(key), b"{}")
    assert store[keys[0]] == {}  # (the modules' and the index's first allocations, before measuring)
    tracemalloc.start()
    try:
        for key in keys[1:]:
            assert store[key] == {}
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(store._key_index) == 1000
    assert held < 512 * 1024, f"{held / MB:.1f} MiB for 1,000 keys"
    db.close()


def test_the_due_index_pass_reads_every_state_without_filling_the_cache(tmp_path, monkeypatch):
    """The due index's pass reads every state once: its keys a slice at a time (`Staged.keys_after`), each state by
    key, within `StateTable.uncached` (as the worker runs a slice). 24 MiB of states through an 8 MiB budget leave the
    cache where it was; the same pass read through the cache fills it to the budget (at recovery it turned the cache
    over, evicting the blocks the worker reads, and the heap kept the holes: ~1 MiB past the budget at 30 days)."""
    app = faust.App("test-uncached-pass", broker="kafka://127.0.0.1:1", datadir=str(tmp_path))
    budget = Budget(8)
    table = StateTable(app, name="assembly", partitions=1, budget=budget)
    store = table.disk
    assert store is not None
    monkeypatch.setattr(app.assignor, "assigned_actives", lambda: {TP(table.changelog_topic_name, 0)})
    db = store._db_for_partition(0)
    count = 24 * 64  # states of 16 KiB (random hex: as many bytes in the files)
    for i in range(count):
        db.put(orjson.dumps(f"r:chat-{i:05d}"), orjson.dumps({"due": i, "x": os.urandom(8 * 1024).hex()}))
    db.flush()
    rollouts = Staged(table, "r:")

    def one_pass() -> int:
        read, after = 0, None
        while keys := rollouts.keys_after(after, 100):
            read += sum(1 for key in keys if rollouts[key]["due"] >= 0)
            after = keys[-1]
        return read

    before = budget.usage()  # (the write buffers' reservation, the index and filter blocks)
    with table.uncached():
        assert one_pass() == count
    assert budget.usage() - before < MB, f"{(budget.usage() - before) / MB:.1f} MiB of the pass's blocks cached"
    assert one_pass() == count  # read through the cache again, out of the pass
    assert budget.usage() > budget.cache_bytes - MB
    db.close()


FILLED = """
import sys
from pathlib import Path
from agentstream.streams.disk import BoundedOptions, Budget
from tests.streams.test_disk_budget import read_all, resident

options = BoundedOptions(Budget(8))
dbs = [options.open(Path(path)) for path in sys.argv[1:]]
before = resident()
read_all(options, [Path(path) for path in sys.argv[1:]], dbs)
print(resident() - before, options.budget.usage())
"""


def resident() -> int:
    """This process's resident memory (VmRSS), bytes."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def test_a_cache_filled_by_reads_leaves_the_budget_what_the_store_takes_beside_it(tmp_path):
    """A process whose reads fill an 8 MiB budget's cache (24 MiB of databases read through) grows by the cache and the
    heap's own beside it, within the budget less `BESIDE_CACHE` (what the store takes beside its cache whatever it
    holds: the worker's libraries' pages, RocksDB's threads, its table readers): a cache of the whole budget filled
    made the process grow by 7.4 MiB, so the worker's RSS by the budget and ~1.6 MiB (streams/README.md)."""
    paths = [tmp_path / "assembly-0.db", tmp_path / "assembly-1.db"]
    for path in paths:
        fill(BoundedOptions(Budget(16)), path, 12)
    done = subprocess.run([sys.executable, "-c", FILLED, *map(str, paths)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=120, check=True)
    grown, cached = map(int, done.stdout.split())
    assert cached > 4 * MB  # filled
    assert grown <= 8 * MB - BESIDE_CACHE, f"grown {grown / MB:.2f} MiB, the cache holding {cached / MB:.2f}"


def test_flushes_and_compactions_write_their_files_a_small_buffer_at_a_time(tmp_path):
    """RocksDB's background threads hold a file's output up to `writable_file_max_buffer_size` (1 MiB by default)
    in arenas of their own, outside the cache: the databases are opened with `WRITE_BUFFER_OUT`, also when opened
    again (read back from the OPTIONS file RocksDB writes)."""
    path = tmp_path / "assembly-0.db"
    fill(BoundedOptions(Budget(8)), path, 1)
    BoundedOptions(Budget(8)).open(path).close()
    written = sorted(path.glob("OPTIONS-*"))[-1].read_text()
    assert f"writable_file_max_buffer_size={WRITE_BUFFER_OUT}" in written

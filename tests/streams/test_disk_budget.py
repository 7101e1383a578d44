"""The disk store's databases within one memory budget, also when they are opened again (a restarted worker)."""

from __future__ import annotations

from pathlib import Path

import rocksdict

from agentstream.streams.disk import MB, BoundedOptions, Budget


def fill(options: BoundedOptions, path: Path, megabytes: int) -> None:
    """`megabytes` of values (incompressible enough: each its own bytes) written, flushed and closed."""
    db = options.open(path)
    for i in range(megabytes * 64):
        db.put(f"e:{i:08d}".encode(), (str(i) * 2048)[:16 * 1024].encode())
    db.flush()
    db.close()


def read_all(options: BoundedOptions, paths: list[Path]) -> list[rocksdict.Rdict]:
    """The databases at `paths` opened again, every value read."""
    dbs = [options.open(path) for path in paths]
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
    assert capacities == {16 * MB}
    usages = {db.property_int_value("rocksdb.block-cache-usage") for db in dbs}
    assert usages == {budget.usage()}, "each database reports the one shared cache"
    assert 8 * MB < budget.usage() <= 16 * MB + MB  # more than a cache of its own held (24 MiB read), within the budget

"""The assembly's table on disk: Faust's RocksDB store (the rocksdict driver), in one memory budget, holding
exactly a prefix of its changelog.

Faust's store writes a key to its database when the table is assigned it, and records the changelog offset
it reached only as Faust's own path sends the change. The worker writes its changes as record batches
(tables.py), and a change must not be in the database before it is in the changelog: a worker killed in
between would restart from a state its changelog does not have, and write after it changes whose positions
say that state was written (another worker restoring the changelog would lose it). So a change is held in
memory (`held`, which reads see) until the broker acknowledges its batch; then the batch goes into the
database together with its last offset, in one write. A restarted worker reads its database and the
changelog from that offset on: the tail, not the whole log.

Memory: every partition's database shares one block cache of `--state-memory-mb` less what the store takes beside
it (`BESIDE_CACHE`), and their write buffers (memtables) are charged to it (a write buffer manager of half of it), as
are the index and filter blocks: what the state takes in RAM is that budget whatever the retention; the rest is on
disk. A pass over the keys, and
the reads of the due index's pass over every state (`DiskStore.uncached`), leave the cache as it is: their blocks
are not read again, and through the cache they turned the budget over, evicting the blocks the worker reads.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import rocksdict
from faust.stores.rocksdb import RocksDBOptions
from faust.stores.rocksdb import Store as RocksStore
from faust.types import EventT

MB = 1024 * 1024
MEMORY_PROPERTIES = {
    "rocksdb.estimate-table-readers-mem": "table_readers",  # index and filter blocks held outside the cache
    "rocksdb.cur-size-all-mem-tables": "memtables",
    "rocksdb.total-sst-files-size": "files",
    "rocksdb.num-live-versions": "live_versions",
}


def read_options(*, fill_cache: bool) -> rocksdict.ReadOptions:
    """RocksDB's read options; `fill_cache=False`: a block read from a file is not put in the cache (one found
    there is still read from it)."""
    options = rocksdict.ReadOptions()
    options.fill_cache(fill_cache)  # type: ignore[call-arg]  # (the stub omits the argument the binding takes)
    return options


def dumps(value: Any) -> bytes:
    """`value`'s JSON as orjson writes it, in bytes of their own size: orjson's bytes keep the whole buffer it wrote
    them in (4 KiB at least), so each key Faust's key index holds (1,000) took 4 KiB, not its ~40 bytes: 4 MiB
    outside the budget once the state had 1,000 keys (tracemalloc, a restarted worker at 30 days)."""
    return bytes(memoryview(orjson.dumps(value)))


WRITE_BUFFER_OUT = 64 * 1024
"""how much of a file RocksDB's flushes and compactions hold before they write it"""
BESIDE_CACHE = 2 * MB
"""what the disk store takes beside its cache whatever the cache holds: measured after a kill -9 and a restart
(the cache nearly empty), over a worker restarted over an empty log, 1.0-1.2 MiB at 1 day of sessions and 1.6-1.9
MiB at 30 (the libraries' pages the store's paths touch, RocksDB's threads' arenas, its table readers, Faust's key
index; bench.streams_state, streams/README.md)"""
BESIDE_CACHE_SHARE = 32
"""and per byte the cache holds, the heap's own beside it (a block's allocation, its holes): 1/32 of the budget;
measured past what the cache is charged with once reads filled it, 1.6 % at 64 MiB, 3 % where a pass turned it over"""


class Budget:
    """The memory every partition's database of a table shares: one block cache, which their write buffers
    and their index and filter blocks are charged to, of the budget less what the store takes beside it (so the
    budget bounds the state's memory, not only its cache's)."""

    def __init__(self, megabytes: int):
        self.bytes = megabytes * MB
        self.cache_bytes = self.bytes - BESIDE_CACHE - self.bytes // BESIDE_CACHE_SHARE
        if self.cache_bytes < MB:
            raise ValueError(f"a memory budget of {megabytes} MiB leaves the cache {self.cache_bytes / MB:.1f} MiB "
                             f"beside what the store takes outside it ({BESIDE_CACHE / MB:.0f} MiB and 1/"
                             f"{BESIDE_CACHE_SHARE} of the budget)")
        self.cache = rocksdict.Cache(self.cache_bytes)
        # memtables past half the cache are flushed to disk (no stall: a write never waits for a flush)
        self.write_buffers = rocksdict.WriteBufferManager.new_write_buffer_manager_with_cache(
            self.cache_bytes // 2, False, self.cache)

    def usage(self) -> int:
        """Bytes of the cache in use (blocks read, memtables, index and filter blocks)."""
        return int(self.cache.get_usage())


class BoundedOptions(RocksDBOptions):
    """Faust's RocksDB options, within a `Budget` shared by all the databases opened with them."""

    def __init__(self, budget: Budget, max_open_files: int = 256):
        super().__init__(max_open_files=max_open_files, use_rocksdict=True)
        self.budget = budget

    def open(self, path: Path, *, read_only: bool = False) -> rocksdict.Rdict:
        options = self.as_options()
        # the column family's options named too: given only `options`, rocksdict reopens an existing database with
        # its column families' options read back from its OPTIONS file, where the shared cache and the bloom filter
        # are not kept (a cache of its own, 8 MiB, per database, outside the budget; no filter)
        db = rocksdict.Rdict(str(path), options=options, column_families={"default": options},
                             access_type=rocksdict.AccessType.read_write())
        db.set_read_options(read_options(fill_cache=True))
        return db

    def as_options(self) -> rocksdict.Options:
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_max_open_files(self.max_open_files or -1)
        # one memtable a database may fill before it is flushed: a quarter of the cache, at most 64 MiB;
        # the write buffer manager flushes earlier when all of them together pass half of it
        options.set_write_buffer_size(min(64 * MB, self.budget.cache_bytes // 4))
        options.set_max_write_buffer_number(2)
        # a flush's or a compaction's output written 64 KiB at a time, not 1 MiB: RocksDB's background threads keep
        # their buffers' pages in arenas of their own, outside the cache (a compaction of four databases' level 0:
        # +2.4 MiB of anonymous maps, +0.7 MiB with 64 KiB)
        options.set_writable_file_max_buffer_size(WRITE_BUFFER_OUT)
        options.set_write_buffer_manager(self.budget.write_buffers)
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(self.budget.cache)
        table.set_bloom_filter(10, False)  # a missing key is answered without reading a block
        table.set_cache_index_and_filter_blocks(True)  # charged to the budget, not held beside it
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        options.set_block_based_table_factory(table)
        return options


@dataclass
class OnItsWay:
    """A batch of changes of one changelog partition, sent and not acknowledged yet."""

    acknowledged: asyncio.Future[Any]
    changes: list[tuple[bytes, bytes | None]]
    number: int
    """the order the batches were sent in (`held` keeps the number of the latest batch to change a key)"""


@dataclass
class Restored:
    """What recovery read of the changelog, since the worker started."""

    records: int = 0
    by_partition: dict[int, int] = field(default_factory=dict)


def ordered_keys(dbs: list[rocksdict.Rdict], prefix: bytes, after: bytes | None,
                 held: dict[bytes, tuple[int, bytes | None]], skipped: bytes) -> Iterator[bytes]:
    """The keys starting with `prefix` and after `after`, in order: the databases' (one cursor each, merged),
    where `held` has no change of them, and `held`'s (those it does not delete); `skipped` left out."""
    changed = {key for key in held if key.startswith(prefix)}
    stored = [_keys_of(db, prefix, after, changed | {skipped}) for db in dbs]
    kept = sorted(key for key in changed if held[key][1] is not None and (after is None or key > after))
    return heapq.merge(*stored, kept)


def _keys_of(db: rocksdict.Rdict, prefix: bytes, after: bytes | None, skipped: set[bytes]) -> Iterator[bytes]:
    cursor = db.iter(read_options(fill_cache=False))  # (a pass: its blocks are not read again)
    cursor.seek(prefix if after is None else after)
    while cursor.valid() and (key := cursor.key()).startswith(prefix):
        if key != after and key not in skipped:
            yield key
        cursor.next()


class DiskStore(RocksStore):
    """Faust's RocksDB store whose writes come from the worker's record batches once the broker has them.

    Keys and values are the changelog's bytes (JSON by orjson, as tables.py writes them), so what Faust's
    recovery puts in the database and what the worker puts there are one format.
    """

    def __init__(self, *args: Any, budget: Budget, **kwargs: Any):
        super().__init__(*args, driver="rocksdict", **kwargs)
        self.rocksdb_options = BoundedOptions(budget)
        self.budget = budget
        self.held: dict[bytes, tuple[int, bytes | None]] = {}
        """key → (number of the batch, value or None for a deletion): changes sent, not acknowledged yet"""
        self.on_its_way: dict[int, deque[OnItsWay]] = {}
        self.sent = 0
        self.restored = Restored()

    # --- the format: the changelog's bytes ----------------------------------------------------------

    def _encode_key(self, key: Any) -> bytes:
        return dumps(key)

    def _encode_value(self, value: Any) -> bytes | None:
        return None if value is None else dumps(value)

    def _decode_key(self, key: bytes | None) -> Any:
        return None if key is None else orjson.loads(key)

    def _decode_value(self, value: bytes | None) -> Any:
        return None if value is None else orjson.loads(value)

    # --- writes: held until acknowledged, then into the database with their offset ------------------

    def new_batch(self) -> int:
        """The number of a record batch about to be filled (batches are numbered in the order they are begun)."""
        self.sent += 1
        return self.sent

    def hold(self, number: int, key: bytes, value: bytes | None) -> None:
        """A change going in batch `number`: read from `held` until the batch is acknowledged."""
        self.held[key] = (number, value)

    def sent_batch(self, partition: int, number: int, changes: list[tuple[bytes, bytes | None]],
                   acknowledged: asyncio.Future[Any]) -> None:
        """The held batch `number` was sent to `partition`: into the database once `acknowledged`."""
        self.on_its_way.setdefault(partition, deque()).append(OnItsWay(acknowledged, changes, number))
        acknowledged.add_done_callback(lambda _: self._store_acknowledged(partition))

    def _store_acknowledged(self, partition: int) -> None:
        """Write the acknowledged batches at the head of `partition`'s queue (in the order sent) to its
        database, each with its last offset; a refused batch stops them (the worker stops: `check`)."""
        queue = self.on_its_way.get(partition)
        while queue and queue[0].acknowledged.done():
            batch = queue[0]
            if batch.acknowledged.cancelled() or batch.acknowledged.exception() is not None:
                return
            queue.popleft()
            metadata = batch.acknowledged.result()
            write = rocksdict.WriteBatch(raw_mode=True)
            for key, value in batch.changes:
                if value is None:
                    write.delete(key)
                else:
                    write.put(key, value)
            write.put(self.offset_key, str(metadata.offset + len(batch.changes) - 1).encode())
            self._db_for_partition(partition).write(write)
            for key, _ in batch.changes:
                if self.held.get(key, (None,))[0] == batch.number:
                    del self.held[key]

    def apply_changelog_batch(self, batch: Iterable[EventT[Any]], to_key: Any, to_value: Any) -> None:
        """Faust's recovery (and standby replicas): changelog records into the databases, counted."""
        records = list(batch)
        for event in records:
            partition = event.message.partition
            self.restored.by_partition[partition] = self.restored.by_partition.get(partition, 0) + 1
        self.restored.records += len(records)
        super().apply_changelog_batch(records, to_key, to_value)

    # --- reads: what is held, else the databases --------------------------------------------------------

    def _get(self, key: bytes) -> bytes | None:
        held = self.held.get(key)
        if held is not None:
            return held[1]
        value: bytes | None = super()._get(key)
        return value

    def _contains(self, key: bytes) -> bool:
        held = self.held.get(key)
        if held is not None:
            return held[1] is not None
        return bool(super()._contains(key))

    def _iterkeys(self) -> Iterator[bytes]:
        yield from self._keys_from(b"")

    def keys_under(self, prefix: str, after: str | None = None) -> Iterator[str]:
        """The keys starting with `prefix` (and after `after`), in the order of their bytes in the changelog,
        across the partitions' databases (a seek in each, not a scan of all keys)."""
        start = None if after is None else orjson.dumps(after)
        for key in self._keys_from(orjson.dumps(prefix)[:-1], start):  # the JSON string without its closing quote
            yield orjson.loads(key)

    def _keys_from(self, prefix: bytes, after: bytes | None = None) -> Iterator[bytes]:
        return ordered_keys(list(self._dbs_for_actives()), prefix, after, self.held, self.offset_key)

    @contextmanager
    def uncached(self) -> Iterator[None]:
        """Reads by key that leave the cache as it is, for a pass over every state (the due index's): through the
        cache, a pass at recovery filled it with blocks it does not read again (a pass of 24 MiB of states, the whole
        of an 8 MiB budget's cache: test_disk_budget.py), evicting those the worker reads, and the heap kept the
        holes between the blocks evicted and those kept."""
        dbs = list(self._dbs.values())
        for db in dbs:
            db.set_read_options(read_options(fill_cache=False))
        try:
            yield
        finally:
            for db in dbs:
                db.set_read_options(read_options(fill_cache=True))

    def memory(self) -> dict[str, int]:
        """Where RocksDB's memory is, summed over the active partitions' databases (bytes)."""
        totals = dict.fromkeys(MEMORY_PROPERTIES.values(), 0)
        for db in self._dbs_for_actives():
            for prop, name in MEMORY_PROPERTIES.items():
                totals[name] += db.property_int_value(prop) or 0
        return {"cache_capacity": self.budget.cache_bytes, "cache_usage": self.budget.usage(),
                "cache_pinned": int(self.budget.cache.get_pinned_usage()),
                **totals}

    def estimated_keys(self) -> int:
        """RocksDB's estimate of the keys of the active partitions (counting them would read them all)."""
        return sum(db.property_int_value("rocksdb.estimate-num-keys") or 0 for db in self._dbs_for_actives())


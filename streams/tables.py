"""The assembly's state in one Faust table, written a batch at a time.

Faust writes a table key to the changelog partition of the event being handled, one record per
assignment. The assembly handles events in batches and writes to the partition it names: each key
changed in a batch is written once, at the end of it, and a key created and dropped within the
batch (the events of an attempt settled in the batch that brought them) is not written at all.

Records stay in Faust's table format (JSON keys and values), so Faust restores the table as its own,
whether it was written a batch at a time or one record per event. A table given a memory `Budget` is on
disk (disk.py: Faust's RocksDB store); else in memory (Faust's memory store).
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from itertools import islice
from typing import Any

import faust
import orjson
from aiokafka.producer.message_accumulator import BatchBuilder
from faust.types import AppT, StoreT

from agentstream.streams.disk import Budget, DiskStore, dumps
from agentstream.streams.transport import Producer

DROPPED = object()
"""a staged deletion"""


@dataclass
class Batch:
    """A record batch of one changelog partition being filled, and its records as the store keeps them."""

    builder: BatchBuilder
    number: int
    """its number in the disk store (disk.py), 0 in memory"""
    records: list[tuple[bytes, bytes | None]] = field(default_factory=list)

    def append(self, key: bytes, value: bytes | None) -> bool:
        """Whether the record fits."""
        if self.builder.append(key=key, value=value, timestamp=None) is None:
            return False
        self.records.append((key, value))
        return True


class StateTable(faust.Table[str, Any]):
    """A table written by partition (`write`, `drop`, `write_all`), whose changes can be awaited until the broker has them.

    Written only through these two (not `table[key] = value`, which writes to the partition of
    Faust's current event).

    faust-streaming 0.15.3 commits a source offset after `producer.flush()`, but its buffer's flush
    returns while a changelog message is still on its way to the client. The worker does not rely on
    those commits (its positions are in this table); it awaits its changes to bound how many are on
    their way, and a batch's decisions (what its trajectories are built from) before it publishes them.
    """

    def __init__(self, *args: Any, budget: Budget | None = None, **kwargs: Any) -> None:
        self.budget = budget
        """on disk within this memory (disk.py), or None: in memory"""
        super().__init__(*args, **kwargs)
        self._unacknowledged: list[asyncio.Future[Any]] = []
        self._records_unacknowledged = 0

    def _new_store(self) -> StoreT[str, Any]:
        if self.budget is None:
            return super()._new_store()
        return DiskStore("rocksdb://", self.app, self, table_name=self.name, key_type=self.key_type,
                         key_serializer=self.key_serializer, value_serializer=self.value_serializer,
                         value_type=self.value_type, loop=self.loop, options=self.options, budget=self.budget)

    @property
    def disk(self) -> DiskStore | None:
        """The table's store when it is on disk. Asked `is not None`, never for its truth: a Faust store is a
        mapping whose truth is its length, which it counts by reading every key of every database (through the
        block cache): `if disk` read the whole table, at every slice of the due index's pass and every batch."""
        store = self.data
        return store if isinstance(store, DiskStore) else None

    def uncached(self) -> AbstractContextManager[None]:
        """Reads that leave the disk store's cache as it is (`DiskStore.uncached`: a pass over every state)."""
        disk = self.disk
        return disk.uncached() if disk is not None else nullcontext()

    @cached_property
    def changelog_name(self) -> str:
        return self.changelog_topic.get_topic_name()

    @property
    def unacknowledged(self) -> int:
        """Changes on their way to the broker (since the last `written`)."""
        return self._records_unacknowledged

    async def write(self, partition: int, key: str, value: Any) -> asyncio.Future[Any]:
        """Write `key` to the table and its changelog; the broker's acknowledgement, to await."""
        if self.budget is not None:  # on disk: written with its offset once acknowledged (a batch of one)
            (acknowledged,) = await self.write_all([(partition, key, value)])
            return acknowledged
        self.data[key] = value
        return await self._send_one(partition, key, orjson.dumps(value))

    async def drop(self, partition: int, key: str) -> asyncio.Future[Any]:
        if self.budget is not None:
            (acknowledged,) = await self.write_all([(partition, key, DROPPED)])
            return acknowledged
        self.data.pop(key, None)
        return await self._send_one(partition, key, None)  # a tombstone, as Faust writes one

    async def _send_one(self, partition: int, key: str, value: bytes | None) -> asyncio.Future[Any]:
        # to the producer itself, as records of Faust's table format: Faust's own path (`send_changelog`)
        # queues them in a buffer that hands on one record at a time, and its topic's `send` yields to
        # the event loop on every record. The order of a partition's records is the order of these calls.
        # faust declares an Awaitable; its aiokafka driver returns aiokafka's future, whose state `check` reads
        acknowledged: asyncio.Future[Any] = await self.app.producer.send(  # type: ignore[assignment]
            self.changelog_name, orjson.dumps(key), value, partition=partition, timestamp=None,
            headers=None)
        self._unacknowledged.append(acknowledged)
        self._records_unacknowledged += 1
        return acknowledged

    async def write_all(self, changes: Iterable[tuple[int, str, Any]]) -> list[asyncio.Future[Any]]:
        """Write (partition, key, value or `DROPPED`) changes, in order within each partition, one record
        batch per partition: the producer's per-record step (a future, the accumulator's lookup and
        append, paid for every change) is left out. The batches' acknowledgements, to await.

        A partition's batch waits for the one before it to go out (aiokafka's `add_batch`), so a
        batch end's changes of a partition go in one batch, not one per kind of key.
        """
        if not isinstance(self.app.producer, Producer):
            raise TypeError("the table writes record batches: run it with streams.transport.Transport")
        batches: dict[int, Batch] = {}
        sent = []
        for partition, key, value in changes:
            # (held until acknowledged: bytes of their own size, not orjson's buffer: disk.dumps)
            raw = None if value is DROPPED else dumps(value)  # None: a tombstone, as Faust writes one
            encoded = dumps(key)
            batch = batches.get(partition) or batches.setdefault(partition, self._new_batch())
            if not batch.append(encoded, raw):  # full: send it, start one
                sent.append(await self._send(batch, partition))
                batch = batches[partition] = self._new_batch()
                if not batch.append(encoded, raw):
                    raise ValueError(f"a change of {key} does not fit in a batch")
            self._apply(key, value, batch)
            self._records_unacknowledged += 1
        for partition, batch in batches.items():
            sent.append(await self._send(batch, partition))
        self._unacknowledged += sent
        return sent

    def _new_batch(self) -> Batch:
        producer = self.app.producer
        assert isinstance(producer, Producer)
        disk = self.disk
        return Batch(producer.create_batch(), disk.new_batch() if disk is not None else 0)

    def _apply(self, key: str, value: Any, batch: Batch) -> None:
        """A change into the store now: the memory store's, or the disk store's held changes (disk.py)."""
        disk = self.disk
        if disk is not None:
            disk.hold(batch.number, *batch.records[-1])
        elif value is DROPPED:
            self.data.pop(key, None)
        else:
            self.data[key] = value

    async def _send(self, batch: Batch, partition: int) -> asyncio.Future[Any]:
        producer = self.app.producer
        assert isinstance(producer, Producer)
        acknowledged: asyncio.Future[Any] = await producer.send_batch(batch.builder, self.changelog_name,
                                                                      partition=partition)
        if (disk := self.disk) is not None:
            disk.sent_batch(partition, batch.number, batch.records, acknowledged)
        return acknowledged

    def check(self) -> None:
        """Raise the error of a change on its way that the broker refused (the producer gave up on it)."""
        for acknowledged in self._unacknowledged:
            if acknowledged.done() and not acknowledged.cancelled() and (error := acknowledged.exception()) is not None:
                raise error

    async def written(self) -> None:
        pending, self._unacknowledged = self._unacknowledged, []
        self._records_unacknowledged = 0
        if pending:
            await asyncio.gather(*pending)


def registered(app: AppT, table: StateTable) -> StateTable:
    """`table`, added to the app's tables (whose `add` returns it typed as any collection)."""
    app.tables.add(table)
    return table


class Staged(MutableMapping[str, Any]):
    """The keys of a `StateTable` under `prefix`, with writes held until they are taken (`changes_of` a
    partition, `changes` of keys) and written: one write per key.

    Every write goes to the partition `partition` names when it is made (the worker sets it before it
    handles an event or settles a rollout of that partition). Reads see the staged writes. Values are
    held as the table holds them: `encode` and `decode` convert (the raw events are text there).
    """

    def __init__(self, table: StateTable, prefix: str, encode: Callable[[Any], Any] | None = None,
                 decode: Callable[[Any], Any] | None = None):
        self.table = table
        self.prefix = prefix
        self.encode = encode
        self.decode = decode
        self.partition = 0
        self._staged: dict[str, tuple[int, Any]] = {}
        self._new: set[str] = set()
        """staged keys the table does not hold: dropping one drops its staged write, and writes nothing"""
        self._keys_of: dict[int, dict[str, None]] = {}
        """partition → the keys staged in it (some since written or dropped), in order"""
        self.reads = 0
        """values read by key (what a pass over the state costs: the worker's recovery counts them)"""

    def __getitem__(self, key: str) -> Any:
        self.reads += 1
        staged = self._staged.get(key)
        if staged is None:
            value = self.table.data[self.prefix + key]
        elif staged[1] is DROPPED:
            raise KeyError(key)
        else:
            value = staged[1]
        return self.decode(value) if self.decode else value

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        staged = self._staged.get(key)
        if staged is not None:
            return staged[1] is not DROPPED
        return self.prefix + key in self.table.data

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self._staged and self.prefix + key not in self.table.data:
            self._new.add(key)
        self._staged[key] = (self.partition, self.encode(value) if self.encode else value)
        self._keys_of.setdefault(self.partition, {})[key] = None

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        if key in self._new:
            self._new.discard(key)
            del self._staged[key]
        else:
            self._staged[key] = (self.partition, DROPPED)
        self._keys_of.setdefault(self.partition, {})[key] = None

    def __iter__(self) -> Iterator[str]:
        """The table's keys one at a time (on disk, 30 days of them are not listed in memory), then the staged
        ones it does not hold."""
        cut, disk = len(self.prefix), self.table.disk
        under = disk.keys_under(self.prefix) if disk is not None else (
            key for key in list(self.table.data.keys()) if key.startswith(self.prefix))
        for key in under:
            staged = self._staged.get(key[cut:])
            if staged is None or staged[1] is not DROPPED:
                yield key[cut:]
        yield from [key for key in self._staged if key in self._new]

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def keys_after(self, after: str | None, limit: int) -> list[str]:
        """Up to `limit` keys after `after` (None: from the first), in the order of their bytes in the changelog
        (the disk store's), the staged ones among them: a pass over the keys a slice at a time, each slice
        resumed from the last key it read, whatever was written or dropped in between."""
        return list(islice(self.keys_from(after), limit))

    def keys_from(self, after: str | None) -> Iterator[str]:
        """The keys after `after` as `keys_after` lists them, read one at a time (on disk: from a cursor, so a
        range read stops where its reader does). Valid until the next change: read it within one step."""
        cut, disk = len(self.prefix), self.table.disk
        start = None if after is None else self.prefix + after
        beyond = None if start is None else orjson.dumps(start)
        if disk is not None:
            under: Iterable[str] = disk.keys_under(self.prefix, start)
        else:  # (the memory store: tests, development)
            under = sorted((key for key in self.table.data if key.startswith(self.prefix)
                            and (beyond is None or orjson.dumps(key) > beyond)), key=orjson.dumps)
        new = sorted((key for key in (self.prefix + key for key in self._new)
                      if beyond is None or orjson.dumps(key) > beyond), key=orjson.dumps)
        for key in heapq.merge(under, new, key=orjson.dumps):
            staged = self._staged.get(key[cut:])
            if staged is None or staged[1] is not DROPPED:
                yield key[cut:]

    @property
    def unwritten(self) -> int:
        """Keys whose change is staged and not written yet."""
        return len(self._staged)

    def changes(self, keys: Iterable[str]) -> list[tuple[int, str, Any]]:
        """What is staged of `keys`, as (partition, table key, value or `DROPPED`), and no longer staged."""
        out = []
        for key in dict.fromkeys(keys):
            staged = self._staged.pop(key, None)
            if staged is not None:
                self._new.discard(key)
                out.append((staged[0], self.prefix + key, staged[1]))
        return out

    def changes_of(self, partition: int, drops: bool = True) -> list[tuple[int, str, Any]]:
        """What is staged in `partition`, as `changes` gives it, and no longer staged (without `drops`: its writes,
        its deletions left staged)."""
        out: list[tuple[int, str, Any]] = []
        left: dict[str, None] = {}
        for key in self._keys_of.pop(partition, {}):
            staged = self._staged.get(key)
            if staged is not None and staged[0] == partition:
                if not drops and staged[1] is DROPPED:
                    left[key] = None
                    continue
                del self._staged[key]
                self._new.discard(key)
                out.append((partition, self.prefix + key, staged[1]))
        if left:
            self._keys_of.setdefault(partition, {}).update(left)
        return out


class DueKeys:
    """The due index in the table (`assembly.due_key`: `d:<partition>:<due>:<rollout id>`, one key per rollout): the
    rollouts due by a time are a range of its keys, read without reading any state.

    Written with the state they index, in an order that keeps any prefix of a changelog partition right: a key
    added before the state that has that due (`added_of`, `_flush`), a key dropped after it. A prefix cut in
    between holds a key too many (a stale one, met and dropped by `Assembly.due`), never one too few.
    """

    def __init__(self, table: StateTable):
        self.staged = Staged(table, "d:")

    def put(self, partition: int, key: str) -> None:
        self.staged.partition = partition
        self.staged[key] = 1

    def drop(self, partition: int, key: str) -> None:
        if key in self.staged:
            self.staged.partition = partition
            del self.staged[key]

    def keys_from(self, after: str | None) -> Iterator[str]:
        return self.staged.keys_from(after)

    def added_of(self, partition: int) -> list[tuple[int, str, Any]]:
        """The keys staged as added in `partition`, no longer staged: written before the states they index."""
        return self.staged.changes_of(partition, drops=False)

    def dropped_of(self, partition: int) -> list[tuple[int, str, Any]]:
        """The rest of `partition`'s staged changes (the deletions): written after the states."""
        return self.staged.changes_of(partition)

    @property
    def unwritten(self) -> int:
        return self.staged.unwritten

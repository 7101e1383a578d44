"""Where a replay's trajectories go: a new topic, a JSONL file, or a Parquet file.

Every sink buffers what it is given and makes it durable in `commit()`, which returns the sink's
position; the replay saves that position in its state after the commit. `open(position)` makes
the output match a saved position again, whatever a killed run left behind:
- a file is cut back to the bytes (JSONL) or parts (Parquet) the state counts;
- a topic cannot be cut: the trajectories written after the saved end offsets are read back, and
  the same trajectories (a rebuild makes the same ids) are not written again.

A rebuild in worker processes into a topic has each worker write its own trajectories to the topic
(`TopicShare`); the command's sink then only keeps the position their flushed writes cover.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import orjson
import polars as pl

from agentstream.logs.replay import dataset
from agentstream.logs.replay.sources import Chunk, Item
from agentstream.logs.replay.state import ReplayError, int_keys
from agentstream.schemas.codec import encode
from agentstream.schemas.durable import write_atomically
from agentstream.schemas.kafka import KafkaSettings, ensure_topics, librdkafka_auth
from agentstream.schemas.kafka_reader import _quiet
from agentstream.schemas.scan import Bounds, resolve, scan
from agentstream.schemas.topics import TopicSpec, topic_specs

if TYPE_CHECKING:
    from confluent_kafka import KafkaError, Message, Producer


class Sink(Protocol):
    written: int
    """trajectories written (and durable at the last commit), over every run of the replay"""

    async def create(self) -> dict[str, Any]:
        """Make the empty output, refusing to overwrite one; return its position."""

    async def open(self, position: dict[str, Any]) -> None:
        """Continue the output from a saved position."""

    async def write(self, items: list[Item]) -> None: ...

    async def commit(self) -> dict[str, Any]:
        """Make everything written durable; return the position to save."""

    async def finish(self) -> None:
        """The source is done and committed: complete the output."""

    async def close(self) -> None:
        """Release what the sink holds (also after an error)."""

    def discard(self) -> None:
        """Delete the output (to start over)."""


# --- topics --------------------------------------------------------------------------------------

LIVE_TOPICS = frozenset(spec.base for spec in topic_specs(1))


DELIVERY_S = 60
"""how long librdkafka tries to deliver a trajectory before reporting it failed"""


def _producer(settings: KafkaSettings) -> Producer:
    from confluent_kafka import Producer

    return Producer({
        **librdkafka_auth(settings),
        "enable.idempotence": True,  # (and acks=all): a retried batch is not written twice
        "partitioner": "murmur2_random",  # keyed as Kafka's Java client and aiokafka do: by rollout id
        "linger.ms": 20,
        "message.max.bytes": 16 * 1024 * 1024,  # as make_producer's max_request_size
        "message.timeout.ms": DELIVERY_S * 1000,  # then a delivery fails (and the commit with it)
        "logger": _quiet,
    })


@dataclass
class TopicShare:
    """What a rebuild's worker process needs to write its trajectories to the sink's topic itself."""

    base: str
    partitions: int
    ends: dict[int, int]
    """the topic's ends at the saved position (what the worker's writes come after)"""
    present: set[str]
    """ids written after the saved position by a run that was killed: not written again"""


class TopicSink:
    """Trajectory events to a new topic under the prefix, keyed by rollout id like the live one."""

    def __init__(self, settings: KafkaSettings, base: str, partitions: int):
        if base in LIVE_TOPICS:
            raise ReplayError(f"--to-topic {base} is a live topic of agentstream; write the rebuild to a new one, "
                              f"e.g. --to-topic {base}-rebuilt")
        self.settings = settings
        self.base = base
        self.topic = settings.topics.name(base)
        self.partitions = partitions
        self.producer: Producer | None = None
        self.failures: list[str] = []
        """delivery errors since the last commit (librdkafka reports them on its own thread)"""
        self.ends: dict[int, int] = {}
        self.present: set[str] = set()
        """ids written after the saved position by a run that was killed: not written again"""
        self.written = 0
        self.shares: list[tuple[dict[int, int], int]] = []
        """per worker process writing to the topic itself: its delivered ends and trajectories written, as far as
        its last flush covers (`share`, `covered`)"""

    async def create(self) -> dict[str, Any]:
        report = await ensure_topics(self.settings, [TopicSpec(self.base, self.partitions)])
        if not report.ok:
            raise ReplayError(f"output topic {self.topic}: {'; '.join(report.mismatches)}; choose another --to-topic")
        ranges = await resolve(self.settings, self.topic)
        if any(end > start for start, end in ranges.values()):
            raise ReplayError(f"output topic {self.topic} already holds records; choose a new --to-topic "
                              "(a topic cannot be emptied, and a second copy would be read twice)")
        return {"ends": {p: end for p, (_, end) in ranges.items()}, "written": 0}

    async def open(self, position: dict[str, Any]) -> None:
        self.ends = int_keys(position["ends"])
        self.written = position["written"]
        after = Bounds(start_offsets=dict(self.ends))
        async for batch in scan(self.settings, self.topic, after):
            self.present.update(orjson.loads(record.value or b"")["id"] for record in batch)

    def resume(self, share: TopicShare) -> None:
        """In a worker process: continue the topic from the command's position (it read what is present)."""
        self.ends, self.present = dict(share.ends), share.present

    def share(self, workers: int) -> TopicShare:
        """`workers` processes write to the topic from now on, each through a sink `resume`d from this share,
        and report what their flushes cover (`covered`)."""
        self.shares = [(dict(self.ends), 0) for _ in range(workers)]
        return TopicShare(self.base, self.partitions, dict(self.ends), self.present)

    def covered(self, worker: int, position: dict[str, Any]) -> None:
        """A worker's sink position as of its last flush, sent with the source position that covers it."""
        before = self.shares[worker][1]
        self.shares[worker] = (position["ends"], position["written"])
        self.written += position["written"] - before

    def _shared_ends(self) -> dict[int, int]:
        """Each partition's end as the workers' covered flushes found it (their last delivered records).

        A resume reads back what follows and does not write it again: everything a worker wrote after its
        last covered flush follows its own last delivered record. The output is keyed as the raw topics are,
        with as many partitions, so each output partition is written by the worker of that raw partition
        alone; were it written by two, a record of one written before the other's covered ones would be
        written again on resume: a repeat, which readers drop by id."""
        return {p: max(ends.get(p, start) for ends, _ in self.shares) for p, start in self.ends.items()}

    async def write(self, items: list[Item]) -> None:
        if not items:
            return
        if self.producer is None:
            # librdkafka's producer: it batches and sends on its own threads, so the rebuild goes on
            # meanwhile (aiokafka's took a share of the event loop per record and waited on full batches)
            self.producer = _producer(self.settings)
        for item in items:
            if item.id in self.present:
                self.written += 1
                continue
            value = item.raw or encode(item.event)
            while True:
                try:
                    self.producer.produce(self.topic, value, item.key, on_delivery=self._delivered)
                    break
                except BufferError:  # its queue is full: let it send
                    await asyncio.to_thread(self.producer.poll, 0.5)
            self.written += 1
        self.producer.poll(0)

    def _delivered(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self.failures.append(f"{error.str()} (partition {message.partition()})")
        else:
            self.ends[message.partition()] = max(self.ends.get(message.partition(), 0), message.offset() + 1)

    async def commit(self) -> dict[str, Any]:
        if self.shares:
            return {"ends": self._shared_ends(), "written": self.written}
        if self.producer is None:
            return {"ends": dict(self.ends), "written": self.written}
        left = await asyncio.to_thread(self.producer.flush, DELIVERY_S + 30)
        if left or self.failures:
            failures, self.failures = self.failures, []
            raise ReplayError(f"writing to {self.topic}: {left} trajectories not acknowledged in "
                              f"{DELIVERY_S + 30} s" if left else
                              f"writing to {self.topic}: {failures[0]} ({len(failures)} failed)")
        return {"ends": dict(self.ends), "written": self.written}

    async def finish(self) -> None:
        pass

    async def close(self) -> None:
        if self.producer is not None:  # what is not committed may be lost: a resume writes it again
            await asyncio.to_thread(self.producer.flush, 5)
            self.producer = None

    def discard(self) -> None:
        pass  # nothing to delete: create() refuses a topic that holds records


# --- files ---------------------------------------------------------------------------------------


def _refuse_existing(*paths: Path) -> None:
    for path in paths:
        if path.exists():
            raise ReplayError(f"{path} exists and no resume state says this replay wrote it; move it away, "
                              "or pass --restart to overwrite it")


class JsonlSink:
    """One JSON line per row: encoded trajectory events (the trainer's offline file), or dataset rows."""

    def __init__(self, path: Path, lines: Callable[[Item], list[bytes]], of_rows: bool = False):
        self.path = path
        self.lines = lines
        self.of_rows = of_rows
        """its lines are dataset rows: a chunk's, where the source made them (`Chunk.rows`)"""
        self.file: IO[bytes] | None = None
        self.written = 0

    @classmethod
    def events(cls, path: Path) -> JsonlSink:
        return cls(path, lambda item: [item.raw or encode(item.event)])

    @classmethod
    def chat(cls, path: Path) -> JsonlSink:
        return cls(path, lambda item: [orjson.dumps(row) for row in dataset.rows(item.event, item.calls)],
                   of_rows=True)

    async def create(self) -> dict[str, Any]:
        _refuse_existing(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        return {"bytes": 0, "written": 0}

    async def open(self, position: dict[str, Any]) -> None:
        size = self.path.stat().st_size if self.path.exists() else -1
        if size < position["bytes"]:
            raise ReplayError(f"{self.path} is shorter than this replay's resume state says it wrote "
                              f"({max(size, 0)} < {position['bytes']} bytes): it was changed since; "
                              "pass --restart to write it again")
        self.file = file = self.path.open("r+b")
        file.truncate(position["bytes"])  # what a killed run wrote after its last saved state
        file.seek(position["bytes"])
        self.written = position["written"]

    @property
    def _file(self) -> IO[bytes]:
        if self.file is None:
            raise ReplayError(f"{self.path} is written before it is opened")
        return self.file

    async def write(self, items: list[Item]) -> None:
        if self.of_rows and isinstance(items, Chunk) and items.rows is not None:
            # polars' JSON lines: the bytes orjson writes for the dicts `dataset.rows` makes (keys in the
            # schema's order; floats, ints and strings written alike: tests/logs/test_replay_export.py), without
            # a Python object per value
            items.rows.write_ndjson(self._file)
            self.written += len(items)
            return
        for item in items:
            for line in self.lines(item):
                self._file.write(line + b"\n")
            self.written += 1

    async def commit(self) -> dict[str, Any]:
        file = self._file
        file.flush()
        os.fsync(file.fileno())
        return {"bytes": file.tell(), "written": self.written}

    async def finish(self) -> None:
        pass

    async def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


class ParquetSink:
    """Dataset rows as one Parquet file, written as numbered parts (one per commit) and joined at the end.

    A Parquet file cannot be appended to, so a killed run leaves parts; the state counts the
    durable ones, and parts beyond the count are deleted on resume.
    """

    def __init__(self, path: Path):
        self.path = path
        self.parts = path.with_name(path.name + ".parts")
        self.frames: list[pl.DataFrame] = []
        """rows since the last commit, a frame per chunk"""
        self.count = 0
        self.written = 0

    def _part(self, index: int) -> Path:
        return self.parts / f"part-{index:06d}.parquet"

    async def create(self) -> dict[str, Any]:
        _refuse_existing(self.path, self.parts)
        self.parts.mkdir(parents=True)
        return {"parts": 0, "written": 0}

    async def open(self, position: dict[str, Any]) -> None:
        self.count, self.written = position["parts"], position["written"]
        missing = [i for i in range(self.count) if not self._part(i).is_file()]
        if missing:
            raise ReplayError(f"{self.parts} lacks parts this replay's resume state counts ({self._part(missing[0])}); "
                              "pass --restart to write the dataset again")
        for path in self.parts.iterdir():
            if path.suffix != ".parquet" or int(path.stem.rpartition("-")[2]) >= self.count:
                path.unlink()  # a temporary file, or a part written after the last saved state

    async def write(self, items: list[Item]) -> None:
        if isinstance(items, Chunk) and items.rows is not None:
            frame = items.rows.cast(dataset.SCHEMA)
        else:
            frame = pl.DataFrame([row for item in items for row in dataset.rows(item.event, item.calls,
                                                                                messages_as_json=True)],
                                 schema=dataset.SCHEMA)
        if frame.height:
            self.frames.append(frame)
        self.written += len(items)

    async def commit(self) -> dict[str, Any]:
        if self.frames:
            frame = pl.concat(self.frames)
            write_atomically(self._part(self.count), frame.write_parquet)
            self.count += 1
            self.frames = []
        return {"parts": self.count, "written": self.written}

    async def finish(self) -> None:
        parts = [self._part(i) for i in range(self.count)]
        if parts:
            joined = pl.scan_parquet(parts, schema=dataset.SCHEMA)
            write_atomically(self.path, lambda tmp: joined.sink_parquet(tmp))
        else:
            write_atomically(self.path, pl.DataFrame(schema=dataset.SCHEMA).write_parquet)

    async def close(self) -> None:
        pass

    def cleanup(self) -> None:
        """After the replay is done: the parts are in the file."""
        shutil.rmtree(self.parts, ignore_errors=True)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self.cleanup()



"""Live rollouts at a steady rate, and when each one's trajectory is read: a process of its own.

`bench.streams_assembly` runs this beside the worker for its latency phase. The bench's asyncio
producer awaited each event's acknowledgement before the next, and could not hold 5,000 events/s
(it failed with KafkaTimeoutError); this one holds it on 12-19 % of a core (librdkafka's threads
included; 0.025-0.037 ms per event):

* librdkafka's producer (`confluent_kafka`), pipelined: a rollout's five events are produced at its
  scheduled time without waiting; librdkafka batches them (`linger.ms` 5) and reports each finish
  event's delivery on a thread that waits for nothing else, so the time the broker's
  acknowledgement reached this process (the latency's start) is taken as it arrives.
* events are not built per rollout (pydantic and JSON would cost ~0.1 ms each): a few rollouts are
  built and encoded once, with sentinel ids and times, and each live event is a template with its
  rollout id, event id and times (now, when produced) put in by `bytes.replace`.
* the trajectories (and the pings) are read by librdkafka's consumer, assigned the partitions at
  their ends before the first event is produced; a thread of its own takes each record as it comes.

Baseline, meanwhile, on the same broker, producer and consumer: a record produced to the ping topic
and read back (the time from producing it to reading it).

Writes one JSON object to `--out`: per rollout the finish's acknowledgement and its trajectory's
reading (wall times), the round trips, the schedule's lag, and this process's own CPU.

    python -m bench.live_load --bootstrap-servers HOST:PORT --topic-prefix PFX. --ping-topic PFX.bench-ping
                              --rate 1000 --seconds 20 [--ping-rate 10] [--wait-s 30] --out live.json
"""

from __future__ import annotations

import argparse
import random
import re
import resource
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from confluent_kafka import OFFSET_END, Consumer, KafkaError, Message, Producer, TopicPartition

import agentstream.schemas as s
from agentstream.schemas.kafka import KafkaSettings
from samples.rollouts import rollout_events

TEMPLATES = 32
"""distinct rollouts built once; live rollouts cycle through them"""
RID, EID = "@@rollout@@", "@@event-{k}@@"
TICK_S = 0.002
"""the shortest wait between producing what is due"""
TIME, STARTED = 7_777_777_777_777, 7_777_777_776_977
"""sentinel event time, and a call's `started_at` (the time - 800 ms, as `call_event` writes it)"""


SLOTS = re.compile(rb"@@rollout@@|@@event-\d@@|%d|%d" % (TIME, STARTED))


@dataclass
class Template:
    """One rollout's events, encoded, cut at the sentinels that each live rollout fills with its own."""

    events: list[tuple[str, list[bytes], list[bytes]]]
    """(topic base name, the bytes between the sentinels, the sentinels in order)"""
    finish: int
    """the index of the finish event"""

    @classmethod
    def of(cls, encoded: list[tuple[str, bytes]], finish: int) -> Template:
        return cls([(topic, SLOTS.split(raw), SLOTS.findall(raw)) for topic, raw in encoded], finish)

    def fill(self, rollout_id: str, now_ms: int) -> list[tuple[str, bytes]]:
        """The events of one live rollout, timed `now_ms` (the calls started 800 ms before)."""
        values = {RID.encode(): rollout_id.encode(), b"%d" % TIME: b"%d" % now_ms,
                  b"%d" % STARTED: b"%d" % (now_ms - 800)}
        filled = []
        for topic, between, slots in self.events:
            parts = [between[0]]
            for slot, after in zip(slots, between[1:]):
                parts += (values.get(slot) or str(uuid.uuid4()).encode(), after)  # else an event id
            filled.append((topic, b"".join(parts)))
        return filled


def templates(written: Callable[[s.Event], bytes], count: int = TEMPLATES) -> list[Template]:
    """`count` rollouts of `samples.rollouts.rollout_events`, encoded by `written`."""

    rng = random.Random(2)
    out = []
    for _ in range(count):
        events = list(rollout_events(RID, random.Random(rng.random()), lambda: TIME))
        for k, event in enumerate(events):
            event.id = EID.format(k=k)
        encoded = [(event.topic, written(event)) for event in events]
        assert all(raw.count(b"%d" % TIME) == 1 and raw.count(EID.format(k=k).encode()) == 1
                   for k, (_, raw) in enumerate(encoded))
        finish = next(k for k, event in enumerate(events) if isinstance(event, s.RolloutFinishedEvent))
        out.append(Template.of(encoded, finish))
    return out


@dataclass
class Run:
    """What the two threads record (each key written by one thread)."""

    acked: dict[str, float] = field(default_factory=dict)
    """rollout id → wall time its finish event's acknowledgement reached this process"""
    read: dict[str, tuple[float, int]] = field(default_factory=dict)
    """rollout id → (wall time its first trajectory record was read, that record's timestamp ms)"""
    pinged: dict[bytes, float] = field(default_factory=dict)
    round_trips: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    """how late each rollout was produced against its schedule"""
    publishing: tuple[float, float] = (0.0, 0.0)


class Requests:
    """Requests a librdkafka client sent to the brokers, from its statistics (every second)."""

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, stats: str) -> None:
        self.sent = sum(broker["tx"] for broker in orjson.loads(stats)["brokers"].values())

    @property
    def config(self) -> dict:
        return {"statistics.interval.ms": 1000, "stats_cb": self}


def producer(bootstrap: str, requests: Requests | None = None) -> Producer:
    """The generator's producer; with `requests`, counting the requests it sends (bench.replay's fill needs no count)."""
    return Producer({
        **(requests.config if requests else {}),
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,  # and acks=all, as the gateway's and the bench's producers
        "partitioner": "murmur2_random",  # keyed as Kafka's Java client and aiokafka: by rollout id
        "linger.ms": 5,
        "message.max.bytes": 16 * 1024 * 1024,
        "queue.buffering.max.messages": 1_000_000,
    })


def consumer(bootstrap: str, topics: list[str], requests: Requests) -> Consumer:
    """A consumer assigned every partition of `topics` at its current end (resolved now, not at the
    first fetch, which could come after the first event)."""
    reader = Consumer({**requests.config, "bootstrap.servers": bootstrap, "group.id": f"bench-live-{uuid.uuid4().hex[:8]}",
                       "enable.auto.commit": False, "auto.offset.reset": "latest",
                       "fetch.wait.max.ms": 100, "fetch.min.bytes": 1})
    partitions = []
    for topic in topics:
        for p in reader.list_topics(topic, timeout=10).topics[topic].partitions:
            _, high = reader.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            partitions.append(TopicPartition(topic, p, high if high >= 0 else OFFSET_END))
    reader.assign(partitions)
    return reader


def read(reader: Consumer, ping_topic: str, run: Run, done: threading.Event) -> None:
    while not done.is_set():
        message = reader.poll(0.1)
        if message is None:
            continue
        now = time.time()
        if message.error():
            if message.error().code() != KafkaError._PARTITION_EOF:
                run.failures.append(str(message.error()))
            continue
        if message.topic() == ping_topic:
            run.round_trips.append(now - run.pinged[message.value()])
        else:
            run.read.setdefault(message.key().decode(), (now, message.timestamp()[1]))


def publish(writer: Producer, topics: dict[str, str], ping_topic: str, shapes: list[Template], prefix: str,
            rate: float, seconds: float, ping_rate: float, run: Run) -> None:
    """Rollouts at `rate`/s and pings at `ping_rate`/s, each produced when due; deliveries served as
    they come (the thread waits in `poll` between)."""

    def finished(err: KafkaError | None, message: Message) -> None:
        if err is not None:
            run.failures.append(str(err))
        else:
            run.acked[message.key().decode()] = time.time()

    def delivered(err: KafkaError | None, message: Message) -> None:
        if err is not None:
            run.failures.append(str(err))

    count, pings = int(rate * seconds), int(ping_rate * seconds)
    began = time.monotonic()
    run.publishing = (time.time(), 0.0)
    n = ping = 0
    while n < count or ping < pings:
        now = time.monotonic()
        while n < count and began + n / rate <= now:
            rollout_id, shape = f"{prefix}{n}", shapes[n % len(shapes)]
            for k, (topic, raw) in enumerate(shape.fill(rollout_id, int(time.time() * 1000))):
                produce(writer, topics[topic], raw, rollout_id.encode(),
                        finished if k == shape.finish else delivered)
            run.lag_s.append(time.monotonic() - (began + n / rate))
            n += 1
        while ping < pings and began + ping / ping_rate <= now:
            value = str(ping).encode()
            run.pinged[value] = time.time()
            produce(writer, ping_topic, value, b"ping", delivered)
            ping += 1
        upcoming = min(began + n / rate if n < count else float("inf"),
                       began + ping / ping_rate if ping < pings else float("inf"))
        # at least TICK_S: what fell due meanwhile goes together (a shorter wait is a busy loop, librdkafka's
        # timeouts being whole milliseconds); a delivery report ends the wait at once
        writer.poll(min(max(upcoming - time.monotonic(), TICK_S), 0.05))
    run.publishing = (run.publishing[0], time.time())
    while writer.flush(0.1):
        pass


def produce(writer: Producer, topic: str, value: bytes, key: bytes, on_delivery: Callable) -> None:
    while True:
        try:
            return writer.produce(topic, value, key, on_delivery=on_delivery)
        except BufferError:  # its queue is full: let it send
            writer.poll(0.01)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic-prefix", required=True, help="the prefix of the topics the worker reads")
    parser.add_argument("--ping-topic", required=True)
    parser.add_argument("--schema-version", type=int, default=s.SCHEMA_VERSION, help="what the worker reads")
    parser.add_argument("--rate", type=float, required=True, help="rollouts per second")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--ping-rate", type=float, default=10.0)
    parser.add_argument("--wait-s", type=float, default=30.0, help="for the last trajectories: give up once none came "
                        "for this long")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from bench.streams_assembly import written_for

    names = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=args.topic_prefix).topics
    topics = {base: names.name(base) for base in ("rollouts", "calls", "rewards")}
    shapes = templates(written_for(args.schema_version))
    produced, fetched = Requests(), Requests()
    writer, run, done = producer(args.bootstrap_servers, produced), Run(), threading.Event()
    reader = consumer(args.bootstrap_servers, [names.trajectories, args.ping_topic], fetched)
    reading = threading.Thread(target=read, args=(reader, args.ping_topic, run, done), daemon=True)
    reading.start()
    cpu_began = resource.getrusage(resource.RUSAGE_SELF)
    requests_began = produced.sent, fetched.sent
    prefix = f"live-{uuid.uuid4().hex[:6]}-"
    publish(writer, topics, args.ping_topic, shapes, prefix, args.rate, args.seconds, args.ping_rate, run)
    cpu_published = resource.getrusage(resource.RUSAGE_SELF)
    requests_published = produced.sent, fetched.sent  # as of the last statistics, within a second
    # until every trajectory is read, or none came for --wait-s (a worker far behind still drains)
    last, progress = len(run.read), time.monotonic()
    while len(run.read) < len(run.acked) and time.monotonic() < progress + args.wait_s and not run.failures:
        time.sleep(0.05)
        if len(run.read) > last:
            last, progress = len(run.read), time.monotonic()
    done.set()
    reading.join()
    reader.close()
    wall = run.publishing[1] - run.publishing[0]
    cpu = (cpu_published.ru_utime + cpu_published.ru_stime) - (cpu_began.ru_utime + cpu_began.ru_stime)
    args.out.write_bytes(orjson.dumps({
        "acked": run.acked, "read": run.read, "round_trips": run.round_trips, "failures": run.failures[:20],
        "produced": len(run.lag_s), "lag_p99_s": sorted(run.lag_s)[int(0.99 * len(run.lag_s))] if run.lag_s else None,
        "publishing": run.publishing, "cpu_s": cpu, "cpu_share": cpu / wall if wall > 0 else None,
        "requests": {"producer": requests_published[0] - requests_began[0],
                     "consumer": requests_published[1] - requests_began[1]}}))


if __name__ == "__main__":
    main()

"""The loop on a three-broker cluster, with one of each kind of process killed -9 in turn: nothing lost, nothing doubled.

A local KRaft cluster of three brokers (`KafkaCluster`; topics with 3 replicas, `min.insync.replicas=2`), the
fake model server (`bench.fake_upstream`, which takes weight swaps and loads nothing: the CPU goes to the
loop, not to a model), two gateway replicas behind a round-robin TCP balancer, two streams workers, the trainer
(GRPO on the tiny model) and the controller, whose agents (`bench.cluster_agent`) make streamed calls through the
balancer and post a reward. After a warm-up, the broker leading the most partitions, gateway 1, streams worker 1
and the trainer are killed -9, one per phase, and started again at its end. Then the controller stops, the loop
drains, and the run counts, from the topics and the agents' own notes:

- calls: every call an agent saw answered is in the calls topic once (lost, doubled);
- trajectories: every finished attempt is one trajectory (missing, more than one; records re-published with the
  same id, which readers drop by id, are counted apart);
- training: every trajectory is in one weights event's lineage at most (twice), and every finished one that fills
  a group of the trainer's is trained (what is left over of a group whose other attempt the controller's stop cut
  off waits for a peer that never comes; failed attempts are rerun, not trained);
- the partitions: how long the surviving streams worker took to hold all of them; the rates: answered calls/s
  before each kill and in the second half of its phase.

    python -m bench.cluster_chaos [--agents 6] [--phase-s 40] [--out DIR]

Prints the counts and writes bench/results/cluster_chaos.json. Memory: three brokers at -Xmx384m, the trainer
(~1.5 GB), two gateways and two workers (~0.2 GB each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import agentstream.schemas as s
from agentstream.controller.settings import ControllerSettings
from agentstream.gateway.settings import GatewaySettings
from agentstream.models.tiny_model import build_tiny_model
from agentstream.schemas.kafka import KafkaSettings, ensure_topics, make_admin, make_consumer, partitions_of
from agentstream.schemas.topics import ROLLOUT_SCOPED
from agentstream.stack.kafka import KafkaCluster
from agentstream.stack.process import free_port, spawn, stop_pid
from agentstream.stack.service import Service
from agentstream.streams.settings import StreamsSettings
from agentstream.trainer.batcher import group_of
from agentstream.trainer.settings import TrainerSettings

REPO = Path(__file__).parents[1]
RESULTS = Path(__file__).parent / "results"
SECRET = "chaos-token-secret"
KEY = "chaos-operator-key"
PARTITIONS = 4
GROUP_SIZE = 2


@dataclass
class Proc:
    """One service process, which the run kills and starts again."""

    service: Service
    log: Path
    ready: Callable[[], bool] = lambda: True
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.popen = spawn(self.service.argv(), self.log, env=self.service.env, cwd=REPO)
        wait_for(lambda: self._alive() and self.ready(), 180, f"{self.service.name} to serve (log {self.log})")
        return self

    def _alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            raise RuntimeError(f"{self.service.name} exited ({self.popen.returncode}); log {self.log}")
        return True

    def kill(self) -> None:
        assert self.popen is not None
        os.killpg(self.popen.pid, signal.SIGKILL)  # its own session: the controller's agents go with it
        self.popen.wait(30)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            stop_pid(self.popen.pid, grace=30)
            self.popen.wait(30)


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.25)
    return value


class Balancer:
    """A TCP balancer in front of the gateway replicas: each connection goes to the next replica that accepts
    it (a killed one refuses, and the agent's call goes to the other), as a Kubernetes Service would."""

    def __init__(self, ports: list[int]):
        self.ports = ports
        self.port = free_port()
        self.turn = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        self.server = await asyncio.start_server(self._connect, "127.0.0.1", self.port)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in self.ports:
            self.turn += 1
            try:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.ports[self.turn % len(self.ports)])
                break
            except OSError:
                continue
        else:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except OSError:
        pass
    finally:
        sink.close()


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def held_partitions(port: int) -> int:
    """The partitions a streams worker assembles (0 while it does not answer)."""
    try:
        view = httpx.get(f"http://127.0.0.1:{port}/analytics", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return 0
    return len(view["assembly"]["partitions"])


@dataclass
class Loop:
    out: Path
    agents: int
    cluster: KafkaCluster = field(init=False)
    kafka: KafkaSettings = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict)

    def start(self) -> None:
        self.cluster = KafkaCluster(self.out / "kafka", brokers=3)
        self.kafka = KafkaSettings(bootstrap_servers=self.cluster.start(), topic_prefix="chaos.", partitions=PARTITIONS)
        report = asyncio.run(ensure_topics(self.kafka))
        assert report.ok, report.mismatches
        model = build_tiny_model(self.out / "model")
        upstream = free_port()
        self.upstream = spawn([sys.executable, "-m", "bench.fake_upstream", "--port", str(upstream), "--delay-ms", "50"],
                              self.out / "logs" / "upstream.log", cwd=REPO)
        wait_for(lambda: healthy(f"http://127.0.0.1:{upstream}/health"), 60, "the fake model server")
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports, 1):
            self._add(f"gateway-{i}", "agentstream.gateway", self._settings(
                GatewaySettings, port=port, upstreams=[f"tiny=http://127.0.0.1:{upstream}"], token_secret=SECRET,
                api_keys=[KEY], replica_id=f"gw-{i}", create_topics=False, health_interval_s=0.5),
                ready=lambda port=port: healthy(f"http://127.0.0.1:{port}/readyz"))
        self.balancer = Balancer(ports)
        self.streams_ports = [free_port(), free_port()]
        for i, port in enumerate(self.streams_ports, 1):
            self._add(f"streams-{i}", "agentstream.streams", self._settings(
                StreamsSettings, settle_s=0.3, data_dir=self.out / f"streams-{i}", web_port=port), command=("worker",),
                ready=lambda port=port: held_partitions(port) > 0)
        self._add("trainer", "agentstream.trainer", self._settings(
            TrainerSettings, model="tiny", base_model=model, checkpoint_dir=self.out / "checkpoints", group_size=GROUP_SIZE,
            groups_per_batch=1, batch_timeout_s=5.0, consumer_group="chaos-trainer", max_staleness=1000))
        tasks = self.out / "tasks.jsonl"
        tasks.write_text("".join(json.dumps({"id": f"t{n}", "input": {"prompt": f"task {n}"}}) + "\n" for n in range(50)))
        self._add("controller", "agentstream.controller", self._settings(
            ControllerSettings, tasks=tasks, agent=f"{sys.executable} -m bench.cluster_agent {self.out / 'seen'}",
            samples=GROUP_SIZE, epochs=1000, concurrency=self.agents, gateway_url=self.balancer.url, token_secret=SECRET,
            model="tiny", run_id="chaos", timeout_s=120, logs_dir=self.out / "attempts", progress=False,
            shutdown_grace_s=0))
        for proc in self.procs.values():
            proc.start()
        wait_for(lambda: sum(held_partitions(port) for port in self.streams_ports) == PARTITIONS, 120,
                 "the streams workers to split the partitions")

    def _settings(self, kind: type, **fields: object) -> object:
        return kind(bootstrap_servers=self.kafka.bootstrap_servers, topic_prefix=self.kafka.topic_prefix, **fields)

    def _add(self, name: str, module: str, settings: object, command: tuple[str, ...] = (),
             ready: Callable[[], bool] = lambda: True) -> None:
        service = Service(name, module, settings, command=command)  # type: ignore[arg-type]  # a settings model
        self.procs[name] = Proc(service, self.out / "logs" / f"{name}.log", ready)

    def stop(self) -> None:
        for proc in reversed(self.procs.values()):
            proc.stop()
        if getattr(self, "upstream", None):
            stop_pid(self.upstream.pid, grace=5)
        self.cluster.stop(grace=0)


def answered(seen: Path) -> list[tuple[str, str, float]]:
    lines = [line.split() for path in seen.glob("*.log") for line in path.read_text().splitlines()]
    return [(call_id, attempt, float(at)) for call_id, attempt, at in lines]


def rate(calls: list[tuple[str, str, float]], start: float, end: float) -> float:
    return sum(start <= at < end for _, _, at in calls) / max(end - start, 1e-9)


async def read_topic(kafka: KafkaSettings, base: str) -> list[s.Event]:
    topic = kafka.topics.name(base)
    tps = await partitions_of(kafka, topic)
    consumer = make_consumer(kafka, group_id=None)
    await consumer.start()
    try:
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        events: list[s.Event] = []
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                events += [s.decode(record.value) for record in records]
        return events
    finally:
        await consumer.stop()


def counts(loop: Loop) -> dict[str, object]:
    async def read() -> dict[str, list[s.Event]]:
        return {base: await read_topic(loop.kafka, base) for base in ("calls", "rollouts", "trajectories", "weights")}

    topics = asyncio.run(read())
    seen = answered(loop.out / "seen")
    logged = Counter(event.id for event in topics["calls"])
    seen_ids = Counter(call_id for call_id, _, _ in seen)
    finished = {(e.rollout_id, e.attempt_id) for e in topics["rollouts"] if e.type == "rollout.finished"}
    trajectories: dict[tuple[str, str | None], set[str]] = {}
    for event in topics["trajectories"]:
        trajectories.setdefault((event.rollout_id, event.attempt_id), set()).add(event.id)
    distinct = {event.id: event.data for event in topics["trajectories"] if isinstance(event, s.TrajectoryEvent)}
    trained = Counter(tid for event in topics["weights"] if isinstance(event, s.WeightsEvent)
                      for tid in event.data.lineage)
    # a group trains in whole groups of GROUP_SIZE: what is left over (a group whose other attempt was cut off when
    # the controller stopped) waits for a peer that never comes
    # the trainer learns from finished attempts (a failed one, cut off by a kill or by the controller's stop, is
    # rerun), in whole groups
    done = {tid: trajectory for tid, trajectory in distinct.items() if trajectory.status == "finished"}
    groups = Counter(group_of(tid, trajectory) for tid, trajectory in done.items())
    trainable = len(done) - sum(size % GROUP_SIZE for size in groups.values())
    return {
        "calls_answered": len(seen_ids), "calls_logged": sum(logged.values()),
        "calls_lost": sum(call_id not in logged for call_id in seen_ids),
        "calls_doubled": sum(times > 1 for times in logged.values()),
        "attempts_finished": len(finished),
        "trajectories": len(distinct), "trajectories_finished": len(done),
        "trajectory_records": len(topics["trajectories"]),
        "trajectories_of_unfinished_attempts": len(trajectories.keys() - finished),
        "finished_without_trajectory": len(finished - trajectories.keys()),
        "attempts_with_two_trajectories": sum(len(ids) > 1 for ids in trajectories.values()),
        "trainable": trainable, "trained": len(trained), "trained_twice": sum(times > 1 for times in trained.values()),
        "trainable_not_trained": max(0, trainable - len(trained.keys() & done.keys())),
        "trained_unfinished": len(trained.keys() - done.keys()),
        "weight_versions": len(topics["weights"]),
    }


def run(args: argparse.Namespace, out: Path) -> dict[str, object]:
    loop = Loop(out, args.agents)
    phases: list[dict[str, object]] = []
    try:
        loop.start()
        print(f"the loop is up on {loop.kafka.bootstrap_servers}; warming up {args.phase_s:.0f} s", flush=True)
        time.sleep(args.phase_s)  # traffic the rates are measured over, not a synchronization
        for victim in ("broker", "gateway-1", "streams-1", "trainer"):
            phases.append(kill_phase(loop, victim, args.phase_s))
        loop.procs["controller"].stop()
        drained = drain(loop)
        result = {"phases": phases, "drain_s": drained, **counts(loop)}
    finally:
        loop.stop()
    return result


def kill_phase(loop: Loop, victim: str, phase_s: float) -> dict[str, object]:
    killed_at = time.time()
    before = rate(answered(loop.out / "seen"), killed_at - phase_s, killed_at)
    phase: dict[str, object] = {"killed": victim}
    if victim == "broker":
        node = asyncio.run(busiest_broker(loop.kafka))
        loop.cluster.kill_node(node)
        phase["killed"] = f"broker {node}"
    else:
        loop.procs[victim].kill()
    if victim == "streams-1":
        survivor = loop.streams_ports[1]
        wait_for(lambda: held_partitions(survivor) == PARTITIONS, 120, "the surviving worker to take every partition")
        phase["rebalanced_s"] = round(time.time() - killed_at, 1)
    time.sleep(max(0.0, killed_at + phase_s - time.time()))  # the phase's traffic, measured below
    after = rate(answered(loop.out / "seen"), killed_at + phase_s / 2, killed_at + phase_s)
    if victim == "broker":
        loop.cluster.start_node(int(str(phase["killed"]).split()[1]))
    else:
        loop.procs[victim].start()
    phase.update(calls_per_s_before=round(before, 2), calls_per_s_second_half=round(after, 2))
    print(f"  {phase}", flush=True)
    return phase


async def busiest_broker(kafka: KafkaSettings) -> int:
    admin = make_admin(kafka)
    await admin.start()
    try:
        described = await admin.describe_topics([kafka.topics.name(base) for base in ROLLOUT_SCOPED])
    finally:
        await admin.close()
    leaders = Counter(p["leader"] for topic in described for p in topic["partitions"])
    return leaders.most_common(1)[0][0]


def drain(loop: Loop, timeout: float = 600.0) -> float:
    """Wait until every finished attempt has its trajectory and every trajectory that fills a group is trained
    (or `timeout`); the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        now = counts(loop)
        if not now["finished_without_trajectory"] and not now["trainable_not_trained"]:
            break
        time.sleep(5)
    return round(time.monotonic() - start, 1)


def phases_of(result: dict[str, object]) -> list[dict[str, object]]:
    phases = result["phases"]
    assert isinstance(phases, list)
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=6, help="attempts running at once")
    parser.add_argument("--phase-s", type=float, default=40.0, help="seconds of traffic per phase (one kill each)")
    parser.add_argument("--out", type=Path, default=None, help="folder of the run (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cluster-chaos-") as tmp:
        out = (args.out or Path(tmp)).resolve()
        result = run(args, out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster_chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=2))
    bad = [name for name in ("calls_lost", "calls_doubled", "finished_without_trajectory",
                             "attempts_with_two_trajectories", "trained_twice", "trainable_not_trained") if result[name]]
    print("nothing lost, nothing doubled" if not bad else f"FAILED: {', '.join(bad)}")
    rates = [float(str(phase["calls_per_s_second_half"])) for phase in phases_of(result)]
    print(f"answered calls/s in each phase's second half: {rates} (median {statistics.median(rates):.2f})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

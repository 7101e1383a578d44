"""The local Kafka broker: the real Apache Kafka 4.x in KRaft mode on 127.0.0.1, a single node
(`LocalKafka`) or a cluster of several (`KafkaCluster`, each node a controller and a broker).

Its jars come from Maven Central through Maven (`pom.xml` beside this file) on first use and are
cached under AGENTSTREAM_HOME. The data directory is formatted once and kept across stop and
start, so every record survives a restart.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from agentstream.settings import StackSettings, agentstream_home
from agentstream.stack.process import (
    ServerState,
    StackError,
    await_ready,
    free_port,
    locked,
    pid_alive,
    port_free,
    spawn,
    stop_pid,
)

STACK_FILES = resources.files("agentstream.stack")
STARTED_LINE = "Kafka Server started"
DEFAULT_PORT = 9092
JVM_OPTIONS = ("-Xms256m", "-Xmx512m", "-XX:+UseSerialGC")
"""the broker's heap and collector. Not G1: with its 1 MB regions each request of 512 KB or more
(the streams worker's larger changelog writes) is a humongous object that starts a concurrent
marking, so at a live rate G1 costs several times the serial collector's CPU per event, and this
small heap keeps the serial collector's young pauses short (the figures: streams/README.md, "The
broker's share")"""
Spawned = tuple[subprocess.Popen[bytes], int, int, int]
"""a broker's process just started, its port and controller port, and where its log stood before"""
CLUSTER_JVM_OPTIONS = ("-Xms128m", "-Xmx384m", "-XX:+UseSerialGC")
"""each node's of a cluster on one machine: three brokers in the memory of one and a half"""
CONTROLLERS = 3
"""the quorum of a cluster of three nodes or more (its first three); the others are brokers only"""


def kafka_libs(home: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """The folder of broker jars, fetched with Maven the first time (keyed by the pom's content)."""
    pom = STACK_FILES.joinpath("pom.xml").read_bytes()
    libs = (home or agentstream_home()) / "kafka" / f"libs-{hashlib.sha256(pom).hexdigest()[:12]}"
    if (libs / ".complete").exists():
        return libs
    with locked(libs.with_name(libs.name + ".lock")):
        if not (libs / ".complete").exists():
            _fetch_jars(pom, libs, say)
    return libs


def _fetch_jars(pom: bytes, libs: Path, say: Callable[[str], None]) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven (mvn) is needed once to fetch the Kafka jars: install it (apt install maven), "
                         "or set KAFKA_BOOTSTRAP_SERVERS to use an existing cluster")
    say("Fetching the Kafka broker's jars from Maven Central (first run only)…")
    work = libs.with_name(libs.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "pom.xml").write_bytes(pom)
    result = subprocess.run(
        [mvn, "-q", "-B", "-f", str(work / "pom.xml"), "dependency:copy-dependencies",
         f"-DoutputDirectory={work / 'jars'}", "-DincludeScope=runtime"],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise StackError(f"Maven could not fetch the Kafka jars (exit {result.returncode}):\n"
                         f"{(result.stdout + result.stderr)[-3000:]}")
    (work / ".complete").touch()
    shutil.rmtree(libs, ignore_errors=True)
    work.rename(libs)


@dataclass
class LocalKafka:
    """One broker whose data, logs and state live in `data_dir`."""

    data_dir: Path
    home: Path | None = None
    default_port: int | None = DEFAULT_PORT
    """taken when free and no port is given; None: always a free port (tests)"""
    jvm_options: tuple[str, ...] = JVM_OPTIONS
    extra_properties: tuple[str, ...] = ()
    """`key=value` lines after the broker's own (a later key wins): for benchmarks of its settings"""
    node: ClusterNode | None = None
    """its place in a cluster (`KafkaCluster` sets it); None: a single node, its own quorum"""

    @property
    def state_file(self) -> Path:
        return self.data_dir / "broker.json"

    @property
    def log(self) -> Path:
        return self.data_dir / "logs" / "server.log"

    def state(self) -> ServerState | None:
        state = ServerState.load(self.state_file)
        return state if state and state.alive else None

    def start(self, port: int | None = None, timeout: float = 90.0, say: Callable[[str], None] = print) -> ServerState:
        """Start the broker (or return the running one) and wait until it accepts clients."""
        running = self.state()
        if running:
            return running
        libs = kafka_libs(self.home, say)
        for attempt in range(3):
            ports = self._ports(port)
            try:
                return self._launch(libs, *ports, timeout)
            except StackError as exc:
                # a free port can be taken by another process before the broker binds it
                if port is not None or "Address already in use" not in str(exc) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _launch(self, libs: Path, port: int, controller_port: int, timeout: float) -> ServerState:
        return self._await(*self._spawn(libs, port, controller_port), timeout)

    def _spawn(self, libs: Path, port: int, controller_port: int) -> Spawned:
        """The broker's process, started (not yet serving), with its ports and where its log stood."""
        config = self._write_config(port, controller_port)
        if not (self.data_dir / "kraft" / "meta.properties").exists():
            self._format(libs, config)
        log_start = self.log.stat().st_size if self.log.exists() else 0
        proc = spawn(self._java(libs, "kafka.Kafka", str(config)), self.data_dir / "logs" / "stdout.log",
                     env={"KAFKA_HEAP_OPTS": ""})
        return proc, port, controller_port, log_start

    def _await(self, proc: subprocess.Popen[bytes], port: int, controller_port: int, log_start: int,
               timeout: float) -> ServerState:
        name = f"Kafka node {self.node.node_id}" if self.node else "Kafka"
        await_ready(name, proc, lambda: self._started(port, log_start), self.log, timeout)
        state = ServerState.of_process(proc.pid, f"127.0.0.1:{port}", str(self.log),
                                       details={"controller_port": controller_port, "data_dir": str(self.data_dir)})
        state.save(self.state_file)
        return state

    def stop(self, grace: float = 60.0) -> bool:
        """Controlled shutdown, killed after `grace` seconds; True if a broker was running."""
        state = ServerState.load(self.state_file)
        return state is not None and state.alive and stop_pid(state.pid, grace=grace)

    def _ports(self, port: int | None) -> tuple[int, int]:
        previous = ServerState.load(self.state_file)
        if port is None and previous:
            # keep the address clients were told, if nothing else took it meanwhile
            old = int(previous.url.rsplit(":", 1)[1])
            controller: int = previous.details["controller_port"]
            if port_free(old) and port_free(controller):
                return old, controller
        if port is not None and not port_free(port):
            raise StackError(f"port {port} is in use: pick another with --port, or omit it to take a free one")
        if port is None:
            # Kafka's usual port, so tools with default settings find the broker
            free_default = self.default_port is not None and port_free(self.default_port)
            port = self.default_port if free_default and self.default_port is not None else free_port()
        return port, free_port()

    def _write_config(self, port: int, controller_port: int) -> Path:
        kraft = self.data_dir / "kraft"
        config = self.data_dir / "server.properties"
        config.parent.mkdir(parents=True, exist_ok=True)
        node = self.node or ClusterNode(1, f"1@127.0.0.1:{controller_port}", replicas=1)
        controller = node.voter
        roles = "broker,controller" if controller else "broker"
        listeners = [f"PLAINTEXT://127.0.0.1:{port}"] + ([f"CONTROLLER://127.0.0.1:{controller_port}"] if controller else [])
        replicas, min_isr = node.replicas, max(1, node.replicas - 1)
        config.write_text("\n".join([
            f"process.roles={roles}",
            f"node.id={node.node_id}",
            # a single node's quorum is itself (formatted --standalone); a cluster's, its fixed voters
            f"controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}" if self.node is None
            else f"controller.quorum.voters={node.voters}",
            f"listeners={','.join(listeners)}",
            f"advertised.listeners={','.join(listeners)}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={kraft}",
            # internal topics: one partition each (one machine's few clients), on every broker up to three,
            # written to all but one of them, so that acks=all survives one broker down
            f"offsets.topic.replication.factor={replicas}",
            "offsets.topic.num.partitions=1",
            f"transaction.state.log.replication.factor={replicas}",
            f"transaction.state.log.min.isr={min_isr}",
            "transaction.state.log.num.partitions=1",
            f"share.coordinator.state.topic.replication.factor={replicas}",
            f"share.coordinator.state.topic.min.isr={min_isr}",
            f"default.replication.factor={replicas}",
            f"min.insync.replicas={min_isr}",
            "group.initial.rebalance.delay.ms=0",
            # one machine's few clients: fewer threads hand each request over fewer times (3 and 8 by default)
            "num.network.threads=1",
            "num.io.threads=2",
            "num.partitions=1",
            "log.retention.ms=-1",
            "message.max.bytes=16777216",
            *self.extra_properties,
            "",
        ]))
        return config

    def _format(self, libs: Path, config: Path) -> None:
        # the cluster id may start with "-", so it is passed as --cluster-id=ID, not as a separate argument;
        # a cluster's voters are in the config, a single node is its own quorum
        cluster_id = self.node.cluster_id if self.node else new_cluster_id()
        quorum = () if self.node else ("--standalone",)
        result = subprocess.run(
            self._java(libs, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(config),
                       *quorum),
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            raise StackError(f"formatting Kafka storage in {self.data_dir} failed:\n{result.stdout}{result.stderr}")

    def _java(self, libs: Path, main: str, *args: str) -> list[str]:
        java_home = StackSettings().java_home
        java = java_home / "bin" / "java" if java_home else shutil.which("java")
        if not java:
            raise StackError("Java 17+ is needed for the local Kafka broker: install it (apt install openjdk-17-jre), "
                             "or set KAFKA_BOOTSTRAP_SERVERS to use an existing cluster")
        log4j = STACK_FILES.joinpath("log4j2.properties")
        return [str(java), *self.jvm_options, "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={log4j}", f"-Dkafka.logs.dir={self.log.parent}",
                "-cp", f"{libs / 'jars'}/*", main, *args]

    def _started(self, port: int, log_start: int) -> bool:
        """The broker logged its start in this run, and its port accepts connections."""
        try:
            with open(self.log, "rb") as log:
                log.seek(log_start)
                if STARTED_LINE.encode() not in log.read():
                    return False
        except FileNotFoundError:
            return False
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0


def new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes in URL-safe base64 without padding."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


@dataclass(frozen=True)
class ClusterNode:
    """One node's place in a cluster: its id, the quorum's voters (`id@host:port,…`), and how many brokers
    hold each internal topic."""

    node_id: int
    voters: str
    replicas: int
    cluster_id: str = ""

    @property
    def voter(self) -> bool:
        return any(voter.split("@")[0] == str(self.node_id) for voter in self.voters.split(","))


@dataclass
class ClusterLayout:
    """What stays fixed across restarts: the cluster id and every node's ports (the voters name them, so a
    node killed and started again must come back on the same ones)."""

    cluster_id: str
    ports: dict[int, tuple[int, int]] = field(default_factory=dict)
    """node id: (listener port, controller port)"""

    @classmethod
    def new(cls, brokers: int) -> ClusterLayout:
        taken: set[int] = set()
        ports = {}
        for node_id in range(1, brokers + 1):
            ports[node_id] = (_fresh_port(taken), _fresh_port(taken))
        return cls(new_cluster_id(), ports)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cluster_id": self.cluster_id,
                                    "nodes": [[n, *ports] for n, ports in sorted(self.ports.items())]}))

    @classmethod
    def load(cls, path: Path) -> ClusterLayout | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(data["cluster_id"], {n: (port, controller) for n, port, controller in data["nodes"]})

    @property
    def voters(self) -> str:
        return ",".join(f"{n}@127.0.0.1:{self.ports[n][1]}" for n in sorted(self.ports)[:CONTROLLERS])


def _fresh_port(taken: set[int]) -> int:
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


@dataclass
class KafkaCluster:
    """`brokers` Kafka nodes on this machine, node N in `data_dir/node-N` with ports of its own: the first three
    form the controller quorum (each also a broker), any more are brokers only. Internal topics have
    min(3, brokers) replicas and take writes with one of them down."""

    data_dir: Path
    brokers: int = 3
    home: Path | None = None
    jvm_options: tuple[str, ...] = CLUSTER_JVM_OPTIONS

    @property
    def layout_file(self) -> Path:
        return self.data_dir / "cluster.json"

    def layout(self) -> ClusterLayout:
        """The cluster's layout, made on first use; refuses a data directory that holds something else."""
        layout = ClusterLayout.load(self.layout_file)
        if layout is not None:
            if len(layout.ports) != self.brokers:
                raise StackError(f"{self.data_dir} holds a cluster of {len(layout.ports)} brokers, not {self.brokers}: "
                                 "start it with that many, or give another --data-dir")
            return layout
        if (self.data_dir / "kraft").exists():
            raise StackError(f"{self.data_dir} holds a single broker's data: give a cluster another --data-dir")
        layout = ClusterLayout.new(self.brokers)
        layout.save(self.layout_file)
        return layout

    def node(self, node_id: int, layout: ClusterLayout | None = None) -> LocalKafka:
        layout = layout or self.layout()
        place = ClusterNode(node_id, layout.voters, replicas=min(CONTROLLERS, self.brokers), cluster_id=layout.cluster_id)
        return LocalKafka(self.data_dir / f"node-{node_id}", home=self.home, default_port=None,
                          jvm_options=self.jvm_options, node=place)

    def nodes(self) -> list[LocalKafka]:
        layout = self.layout()
        return [self.node(n, layout) for n in sorted(layout.ports)]

    @property
    def bootstrap(self) -> str:
        """Every node's address: a client finds the cluster through any of them that is up."""
        layout = self.layout()
        return ",".join(f"127.0.0.1:{layout.ports[n][0]}" for n in sorted(layout.ports))

    def states(self) -> dict[int, ServerState | None]:
        return {node.node.node_id: node.state() for node in self.nodes() if node.node}

    def start(self, timeout: float = 180.0, say: Callable[[str], None] = print) -> str:
        """Start every node that is not running, all at once (a controller waits for a majority of the quorum),
        and wait until each serves; the bootstrap address."""
        layout = self.layout()  # before the jars: a data directory that holds something else is refused first
        libs = kafka_libs(self.home, say)
        stopped = [node for node_id in sorted(layout.ports) if (node := self.node(node_id, layout)).state() is None]
        try:
            # each node's first start formats its storage, a JVM of its own: side by side
            with ThreadPoolExecutor(max_workers=max(len(stopped), 1)) as pool:
                spawned: list[Spawned] = list(pool.map(
                    lambda node: node._spawn(libs, *self._free_ports(layout, _id(node))), stopped))
            for node, started in zip(stopped, spawned, strict=True):
                node._await(*started, timeout)
        except StackError:
            self.stop(grace=0)
            raise
        return self.bootstrap

    def start_node(self, node_id: int, timeout: float = 180.0) -> ServerState:
        """Start one node again (after `kill_node`) on its own ports, and wait until it serves."""
        layout = self.layout()
        node = self.node(node_id, layout)
        if running := node.state():
            return running
        return node._await(*node._spawn(kafka_libs(self.home), *self._free_ports(layout, node_id)), timeout)

    def kill_node(self, node_id: int) -> int:
        """SIGKILL one node, as a crash would end it; its pid."""
        state = self.node(node_id).state()
        if state is None:
            raise StackError(f"Kafka node {node_id} is not running")
        os.kill(state.pid, signal.SIGKILL)
        while pid_alive(state.pid):
            time.sleep(0.05)
        return state.pid

    def stop(self, grace: float = 60.0) -> bool:
        """Stop every node (brokers first, the quorum last, so the brokers' controlled shutdown has a
        controller to talk to); True if any was running."""
        if not self.layout_file.exists():
            return False
        stopped = [node.stop(grace) for node in reversed(self.nodes())]
        return any(stopped)

    @staticmethod
    def _free_ports(layout: ClusterLayout, node_id: int) -> tuple[int, int]:
        ports = layout.ports[node_id]
        if taken := [port for port in ports if not port_free(port)]:
            raise StackError(f"Kafka node {node_id}'s port {taken[0]} is taken by another process: the other nodes "
                             "know it by that port; free it, or start the cluster anew in another --data-dir")
        return ports


def _id(node: LocalKafka) -> int:
    assert node.node is not None
    return node.node.node_id


def cluster_size(data_dir: Path) -> int | None:
    """How many brokers the cluster in `data_dir` has; None where it holds no cluster."""
    layout = ClusterLayout.load(data_dir / "cluster.json")
    return len(layout.ports) if layout else None

"""The local Kafka broker: the real Apache Kafka 4.x, single node in KRaft mode on 127.0.0.1.

Its jars come from Maven Central through Maven (`pom.xml` beside this file) on first use and are
cached under AGENTSTREAM_HOME. The data directory is formatted once and kept across stop and
start, so every record survives a restart.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import socket
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from agentstream.settings import StackSettings, agentstream_home
from agentstream.stack.process import (
    ServerState,
    StackError,
    await_ready,
    free_port,
    locked,
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
        config = self._write_config(port, controller_port)
        if not (self.data_dir / "kraft" / "meta.properties").exists():
            self._format(libs, config)
        log_start = self.log.stat().st_size if self.log.exists() else 0
        proc = spawn(self._java(libs, "kafka.Kafka", str(config)), self.data_dir / "logs" / "stdout.log",
                     env={"KAFKA_HEAP_OPTS": ""})
        await_ready("Kafka", proc, lambda: self._started(port, log_start), self.log, timeout)
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
        config.write_text("\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}",
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={kraft}",
            # one node: internal topics with one partition and one replica
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=1",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "transaction.state.log.num.partitions=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
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
        # a Kafka cluster id is 16 random bytes in URL-safe base64 without padding; it may start
        # with "-", so it is passed as --cluster-id=ID, not as a separate argument
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        result = subprocess.run(
            self._java(libs, "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(config),
                       "--standalone"),
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

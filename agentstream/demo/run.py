"""Running a loop on this machine: the local stack, each service of the preset's `Loop` as its own process, the
topics followed into a live table until the preset says the run is done, and every process stopped however the
run ends."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.live import Live

from agentstream.demo.loop import Loop, Stack
from agentstream.demo.overrides import ServiceFlags
from agentstream.demo.progress import Progress
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.kafka import KafkaSettings, ensure_topics, make_consumer
from agentstream.stack import StackError, configured_kafka, default_kafka_dir
from agentstream.stack.exits import how_it_ended, oom_kills
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import ServerState, free_port, spawn, spawned, stop_pid, tail
from agentstream.stack.service import Service
from agentstream.stack.vllm import LocalVLLM, Lora, healthy

T = TypeVar("T")

QUIET_S = 15.0
STOP_GRACE_S = 20.0
"""each service's time to stop (SIGTERM) before it is killed: its own shutdown must fit in it"""
RESTARTS = 3
"""times a restartable service (`Service.restartable`) is started again in one run before its deaths end the run"""
HEALTH_EVERY_S = 5.0
UNHEALTHY_S = 60.0
"""an inference server whose process lives but that has not answered /health for this long is taken for dead: its
engine died and left the API process behind; a busy server may be slow to answer, not for this long"""
SUPERVISE_EVERY_S = 1.0


def run_folder(name: str) -> Path:
    return Path("runs") / time.strftime(f"{name}-%Y%m%d-%H%M%S")


class StackConfig(BaseModel):
    """What every preset has (the stack, the output); a preset adds its knobs and derives its `Loop`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = "tiny"
    versions: int = 1
    concurrency: int = 2
    out: Path = Field(default_factory=lambda: run_folder("demo"))
    keep_stack: bool = False
    """leave Kafka and vLLM running afterwards"""
    vllm_name: str = "demo"
    """the local vLLM server's name (one server per name)"""
    base_model: Path | None = None
    """a model folder to start from instead of the one built for `model` (tests: the session's)"""
    flags: ServiceFlags = Field(default_factory=dict)
    """the services' own settings over the preset's, by service (`--trainer.lr 1e-4`: demo/overrides.py)"""

    @property
    def batch(self) -> int:
        """rollouts one weight version trains on"""
        raise NotImplementedError

    def build_model(self, out: Path, say: Callable[[str], None]) -> Path:
        """The starting weights (a model folder), built under the run's folder or once per AGENTSTREAM_HOME."""
        raise NotImplementedError

    def prepare(self, out: Path) -> None:
        """Write what the run's processes read besides their settings (task files) into its folder."""

    def loop(self, stack: Stack) -> Loop:
        raise NotImplementedError


@dataclass
class Running:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    oom_kills: int | None = None
    """the kernel's out-of-memory kills when it started (`stack.exits`)"""
    service: Service | None = None
    """what started it, to start it again if it dies and is `restartable`"""
    restarts: int = 0


class Demo:
    """Runs a preset's loop: the stack, its services, the topics followed until the preset's end."""

    starting = "Starting the local stack…"

    def __init__(self, config: StackConfig, console: Console):
        self.config = config
        self.console = console
        self.out = config.out.resolve()
        self.running: list[Running] = []
        self.servers: list[ServerState] = []
        """the inference servers the gateway routes to, watched with the services (`check_alive`)"""
        self.unhealthy_since: dict[str, float] = {}
        self.health_checked = 0.0
        self.started_kafka: LocalKafka | None = None
        self.vllm = LocalVLLM(config.vllm_name)
        self.progress = Progress()

    def say(self, message: str) -> None:
        self.console.print(f"[dim]{message}[/dim]")

    # the stack

    def kafka(self) -> str:
        if configured := configured_kafka():
            return configured
        broker = LocalKafka(default_kafka_dir())
        if broker.state() is None:
            self.started_kafka = broker
        return broker.start(say=self.say).url

    def inference(self, model_dir: Path) -> list[ServerState]:
        """The servers the gateway routes to, serving the starting weights."""
        return [self.serve(model_dir, self.vllm)]

    def serve(self, model_dir: Path, server: LocalVLLM, lora: Lora | None = None) -> ServerState:
        """`server` with the starting weights (and LoRA adapters loaded at run time, given `lora`): one left by an
        earlier run (--keep-stack) that serves this model so is reset to them (seconds) instead of started again
        (a minute or more)."""
        running = server.state()
        if running and running.details.get("model") == str(model_dir.resolve()) \
                and running.details.get("served_name") == self.config.model \
                and running.details.get("lora", False) == (lora is not None) and reset_weights(running.url, model_dir):
            self.say(f"Reusing the vLLM server at {running.url}, reset to the starting weights")
            return running
        server.stop()  # serves another model, or could not be reset
        return server.start(model_dir, served_name=self.config.model, say=self.say, timeout=1800, lora=lora)

    def start(self, service: Service) -> Running:
        log = self.out / "logs" / f"{service.name}.log"
        running = Running(service.name, spawn(service.argv(), log, env=service.env), log, oom_kills(), service)
        self.running.append(running)
        return running

    def check_alive(self) -> None:
        """The run's supervisor, called every second or less while it waits: a service that died is started again
        if it is `restartable` (up to RESTARTS times), else the run fails saying which died, how (`stack.exits`),
        and the end of its log; so does an inference server that died or stopped answering. A service that
        finished its work (exit 0: the trainer's last version, the controller's last rollout) is done, not dead."""
        for service in self.running:
            if (code := service.process.poll()) in (None, 0):
                continue
            ended = how_it_ended(code, service.log, service.oom_kills)
            if service.service is None or not service.service.restartable or service.restarts >= RESTARTS:
                again = f" (after {service.restarts} restarts)" if service.restarts else ""
                raise StackError(f"the {service.name} {ended}{again}. Its log ({service.log}):\n{tail(service.log)}")
            self.restart(service, ended)
        self.check_servers()

    def restart(self, service: Running, ended: str) -> None:
        assert service.service is not None  # check_alive: restartable
        service.restarts += 1
        self.console.print(f"[yellow]the {service.name} {ended}; starting it again ({service.restarts} of "
                           f"{RESTARTS}): it reads on from its committed offsets. Its log ({service.log}):\n"
                           f"{tail(service.log, 10)}[/yellow]")
        with open(service.log, "a") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} the run starts it again: it {ended} ---\n")
        service.process = spawn(service.service.argv(), service.log, env=service.service.env)
        service.oom_kills = oom_kills()

    def check_servers(self) -> None:
        """Fail on an inference server whose process ended (said as a service's is, when this process started it),
        or that has not answered /health for UNHEALTHY_S (checked every HEALTH_EVERY_S)."""
        for server in self.servers:
            log = Path(server.log)
            started = spawned(server.pid)
            if started is not None and (code := started.poll()) is not None:
                ended = how_it_ended(code, log, server.details.get("oom_kills"))
                raise StackError(f"the vLLM server at {server.url} {ended}. Its log ({log}):\n{tail(log)}")
            if not server.alive:
                raise StackError(f"the vLLM server at {server.url} (pid {server.pid}) is gone. Its log ({log}):\n"
                                 f"{tail(log)}")
        now = time.monotonic()
        if now - self.health_checked < HEALTH_EVERY_S:
            return
        self.health_checked = now
        for server in self.servers:
            if healthy(server.url):
                self.unhealthy_since.pop(server.url, None)
            elif now - self.unhealthy_since.setdefault(server.url, now) > UNHEALTHY_S:
                raise StackError(f"the vLLM server at {server.url} (pid {server.pid}) has not answered /health for "
                                 f"{UNHEALTHY_S:.0f} s: its engine died? Its log ({server.log}):\n{tail(Path(server.log))}")

    async def supervised(self, work: Awaitable[T]) -> T:
        """`work`'s result, the services checked (`check_alive`) every SUPERVISE_EVERY_S meanwhile: a death that
        ends the run cancels `work` at once instead of leaving it to wait for what will never come."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=SUPERVISE_EVERY_S)
                if done:
                    return task.result()
                self.check_alive()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def stop_all(self) -> None:
        for service in reversed(self.running):  # the traffic first: no new agents
            stop_pid(service.process.pid, grace=STOP_GRACE_S)
        if not self.config.keep_stack:
            self.vllm.stop()
            if self.started_kafka:
                self.started_kafka.stop()

    # the run

    async def run(self) -> Progress:
        """The stack, the inputs and the model (under a spinner), then the services, followed to the end."""
        self.out.mkdir(parents=True, exist_ok=True)
        with self.console.status(self.starting):
            kafka = await self.topics()
            self.prepare()
            model_dir = self.config.base_model or self.base_model()
            servers = self.servers = self.inference(model_dir)
        stack = Stack(kafka=kafka, model_dir=model_dir, servers=servers, gateway_port=free_port(),
                      token_secret=secrets.token_urlsafe(24), api_key=secrets.token_urlsafe(24), out=self.out)
        self.say(f"Kafka {kafka.bootstrap_servers}, topics {kafka.topic_prefix}*, vLLM {servers[0].url} "
                 f"({self.config.model}), output in {self.out}")
        await self.launch(stack)
        await self.follow(kafka)
        return self.progress

    async def topics(self) -> KafkaSettings:
        """Kafka (the local broker unless KAFKA_BOOTSTRAP_SERVERS), with this run's topics under its own prefix."""
        kafka = KafkaSettings(bootstrap_servers=self.kafka(), topic_prefix=f"{self.out.name}.", partitions=4)
        await ensure_topics(kafka)
        return kafka

    def prepare(self) -> None:
        self.config.prepare(self.out)

    def base_model(self) -> Path:
        return self.config.build_model(self.out, self.say)

    def loop(self, stack: Stack) -> Loop:
        return self.config.loop(stack)

    async def launch(self, stack: Stack) -> None:
        """The loop's services, then, once the gateway is ready (Kafka and an upstream answer it), what sends it
        traffic: its /healthz answers as soon as it listens, before it could serve an agent's first call."""
        loop = self.loop(stack).overridden(self.config.flags)
        self.progress.loop = loop
        for service in loop.services():
            self.start(service)
        await self.await_http("gateway", f"{stack.gateway_url}/readyz")
        for service in loop.traffic():
            self.start(service)

    async def await_http(self, name: str, url: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while True:
                self.check_alive()
                try:
                    if (await client.get(url, timeout=2)).status_code < 500:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise StackError(f"the {name} did not answer {url} with a success within {timeout:.0f} s")
                await asyncio.sleep(0.25)

    async def follow(self, kafka: KafkaSettings) -> None:
        """Until the last version has a full batch of answers, or the controller ran every rollout and
        their trajectories are in (nothing came for QUIET_S)."""
        last_record = time.monotonic()

        async def done(fetched: bool) -> bool:
            nonlocal last_record
            if fetched:
                last_record = time.monotonic()
            return self.finished() or (self.service_done("controller") and time.monotonic() - last_record > QUIET_S)

        topics = kafka.topics
        await self.watch(kafka, [topics.trajectories, topics.weights, topics.pool], done)

    async def watch(self, kafka: KafkaSettings, topics: list[str], done: Callable[[bool], Awaitable[bool]],
                    refresh_per_second: float = 2) -> None:
        """Fold `topics` into the progress table, redrawn after each fetch, until `done(anything fetched)`."""
        consumer = make_consumer(kafka, *topics, group_id=None)
        await consumer.start()
        try:
            with Live(self.progress.table(), console=self.console, refresh_per_second=refresh_per_second) as live:
                while True:
                    self.check_alive()
                    batches = await consumer.getmany(timeout_ms=500)
                    for records in batches.values():
                        for record in records:
                            try:
                                self.progress.add(decode(record.value))
                            except DecodeError:
                                continue
                    live.update(self.progress.table())
                    if await done(bool(batches)):
                        return
        finally:
            await consumer.stop()

    def service(self, name: str) -> Running:
        return next(s for s in self.running if s.name == name)

    def service_done(self, name: str) -> bool:
        """Whether the process `name` finished its work (exit 0)."""
        return any(s.name == name and s.process.poll() == 0 for s in self.running)

    def finished(self) -> bool:
        last = self.progress.rows.get(self.config.versions)
        return bool(last and last.published_at is not None and len(last.rewards) >= self.config.batch)


def reset_weights(url: str, model_dir: Path, version: int = 0) -> bool:
    """Load the folder's weights into a running server as `version` (0: the starting weights; a resumed run's
    latest checkpoint: its own); False if the server refuses."""
    steps: list[tuple[str, dict[str, Any]]] = [
        ("/pause", {"params": {"mode": "keep"}}),
        ("/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}}),
        ("/reset_prefix_cache", {}),
        ("/update_weight_version", {"json": {"new_version": str(version)}}),
        ("/resume", {})]
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            for path, kwargs in steps:
                client.post(path, **kwargs).raise_for_status()
        return True
    except httpx.HTTPError:
        return False


Summarize = Callable[[Any, Any, Console, float], dict[str, Any]]


def run_to_summary(run: Demo, summarize: Summarize) -> dict[str, Any]:
    """Run a preset with its services stopped however it ends, then summarize it
    (`summarize(progress, config, console, elapsed_s)`)."""
    started = time.monotonic()
    try:
        progress = asyncio.run(run.run())
    finally:
        run.stop_all()
    return summarize(progress, run.config, run.console, time.monotonic() - started)

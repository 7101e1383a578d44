"""`agentstream demo --tenants N`: N agents, each a tenant with its own task and its own LoRA adapter, on one
vLLM-CPU server, and proof that none pauses another.

The demo's loop (`demo.preset`) with these differences: each tenant has a key of its own in the gateway's
AGENTSTREAM_TENANTS and a controller of its own, whose ordinary OpenAI-SDK agents (`examples/single_turn.py`) act
for it (their rollout tokens carry the tenant, `ControllerSettings.tenant`); the server serves LoRA adapters
loaded at run time; the trainer trains one adapter per tenant in one process (`--tenant-adapters`); the gateway
loads each new version as `<tenant>@<version>` beside the others, with no hold and no pause (`gateway/lora.py`).

Each tenant's task asks for answers of its own characters (`TASKS`: digits, vowels, capitals; scored by
`streams.rewards:character_share`), so an adapter trained on another tenant's trajectories would learn the wrong
characters. The report shows per tenant the reward by adapter version and what loading each version cost, and
checks from the topics that every call was recorded as its tenant's adapter (`tenant@version`, the base before its
first), that each version trained only on its own tenant's trajectories, and that no update held or paused
anyone (the pool events' hold and pause, the gateway's hold counters).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
from pydantic import Field
from rich.console import Console
from rich.table import Table

from agentstream.controller.settings import ControllerSettings
from agentstream.demo.loop import Loop, Stack
from agentstream.demo.overrides import ServiceFlags, given, overridden
from agentstream.demo.preset import AGENT, DemoConfig, Task
from agentstream.demo.progress import Progress, VersionRow, plot_by_version
from agentstream.demo.run import QUIET_S, Demo, run_folder, run_to_summary
from agentstream.models.tiny_model import build_tiny_model
from agentstream.schemas.events import CallEvent, Event, PoolUpdateEvent, TrajectoryEvent, WeightsEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.releases import adapter_name
from agentstream.stack.process import ServerState, free_port
from agentstream.stack.service import Service
from agentstream.stack.vllm import Lora
from agentstream.streams.settings import StreamsSettings
from agentstream.trainer.settings import TrainerSettings


@dataclass(frozen=True)
class TenantTask:
    """One tenant's task: answers scored by the share of `characters` in them."""

    name: str
    characters: str
    prompts: tuple[str, ...]

    def tasks(self, count: int) -> list[Task]:
        return [{"id": f"{self.name}-{i}", "input": {"prompt": self.prompts[i % len(self.prompts)]},
                 "reward_fn": "streams.rewards:character_share", "metadata": {"characters": self.characters}}
                for i in range(count)]


TASKS = (
    TenantTask("digits", "0123456789", ("Reply with digits only.", "Write a number.", "Say some digits.")),
    TenantTask("vowels", "aeiouAEIOU", ("Reply with vowels only.", "Sing a vowel.", "Only a, e, i, o, u:")),
    TenantTask("capitals", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", ("SHOUT IT.", "Reply in capitals.", "Initials only:")),
)
BATCH_TIMEOUT_S = 600.0
"""how long a tenant's group waits for its last answers: N tenants' agents share the machine, so a group fills N
times slower than the demo's; at the trainer's 30 s a loaded machine trained versions on 2-5 answers"""
LORA_RANK = 8
LORA_LR = {"tiny": 3e-2, "smollm2": 2e-4}
"""an adapter's step: larger than the full fine-tune's (`DEMO_MODELS`), it moves only a few weights"""
TINY_OUTPUT_GAIN = 4.0
"""the tiny base's final norm weight (`build_tiny_model`): at a fresh model's 1 its logits stay within ±2.6, and
no adapter (which trains neither that norm nor the head) can raise the digits' or the lower-case vowels' share of
an answer above 0.10 or the capitals' above 0.16 (gradient ascent on the norm's sphere); the demo measured 0.063,
0.039 and 0.161 after 6 versions. At 4 the head's logits span 4 times as wide; offline (on-policy, 8 versions of
16 answers, rank 8, lr 3e-2) digits rose 0.00 → 0.91 and capitals 0.12 → 0.94; at 8 the rewards jumped about
(capitals 0.74, 0.04, 0.80) and the vowels never began"""


def tenant_name(task: TenantTask) -> str:
    return f"agent-{task.name}"


class TenantLoop(Loop):
    """The loop with a controller per tenant in place of the one controller (`--controller.*` sets each)."""

    tenants: dict[str, ControllerSettings]

    def overridden(self, flags: ServiceFlags) -> Self:
        own = {name: given_flags for name, given_flags in flags.items() if name != "controller"}
        loop = super().overridden(own)
        if "controller" not in flags:
            return loop
        return loop.model_copy(update={"tenants": {
            tenant: overridden(settings, flags["controller"], "controller.") for tenant, settings in self.tenants.items()}})

    def traffic(self) -> list[Service]:
        return [Service(f"controller-{tenant}", "agentstream.controller", settings, env=self.agent_env)
                for tenant, settings in self.tenants.items()]


class TenantDemoConfig(DemoConfig):
    tenants: int = Field(3, ge=1, le=len(TASKS))
    """agents, each a tenant with its own task (`TASKS`), key, controller and adapter"""
    keys: dict[str, str] = Field(default_factory=dict)
    """tenant → its gateway key (made for the run)"""
    versions: int = 8
    tasks: int = 2
    """prompts (groups) per version: a version trains on 16 of its tenant's answers"""
    concurrency: int = 2
    """each tenant's agents at once"""
    timeout_s: float = 3600.0
    """the run ends, every tenant's last version in or not, after this long with the services up"""
    out: Path = Field(default_factory=lambda: run_folder("demo-tenants"))

    def model_post_init(self, context: Any) -> None:
        self.keys = self.keys or {tenant_name(task): secrets.token_urlsafe(24) for task in self.tasks_of()}

    def build_model(self, out: Path, say: Callable[[str], None]) -> Path:
        if self.model == "tiny":
            return build_tiny_model(out / "base-model", output_gain=TINY_OUTPUT_GAIN)
        return super().build_model(out, say)

    def tasks_of(self) -> tuple[TenantTask, ...]:
        return TASKS[:self.tenants]

    def tasks_file(self, out: Path, tenant: str) -> Path:
        return out / f"tasks-{tenant}.jsonl"

    def prepare(self, out: Path) -> None:
        for task in self.tasks_of():
            lines = task.tasks(self.tasks)
            self.tasks_file(out, tenant_name(task)).write_text("".join(json.dumps(line) + "\n" for line in lines))

    @property
    def resident(self) -> int:
        """adapters the server holds: each tenant's current one, and its next beside it while the old drains (at a
        bound of one per tenant, loading a new version evicts another tenant's current adapter)"""
        return 2 * self.tenants

    @property
    def lora(self) -> Lora:
        return Lora(max_loras=self.tenants, max_rank=LORA_RANK, max_cpu_loras=self.resident)

    def loop(self, stack: Stack) -> TenantLoop:
        spec, model, out = self.spec, self.model, stack.out
        return TenantLoop(
            gateway=stack.gateway(model, app_keys=list(self.keys.values()),
                                  tenants={tenant: [key] for tenant, key in self.keys.items()},
                                  max_resident_adapters=self.resident),
            streams=stack.settings(StreamsSettings, settle_s=0.3, data_dir=out / "streams", web_port=free_port()),
            trainer=stack.settings(
                TrainerSettings, model=model, base_model=stack.model_dir, checkpoint_dir=out / "checkpoints",
                group_size=self.samples, groups_per_batch=self.tasks, max_staleness=self.max_staleness,
                max_versions=self.versions * self.tenants, seed=self.seed, batch_timeout_s=BATCH_TIMEOUT_S,
                **{**given(spec.trainer), "lr": LORA_LR[model]}, tenant_adapters=True, lora_rank=LORA_RANK),
            tenants={tenant: stack.controller(
                tasks=self.tasks_file(out, tenant), agent=AGENT, samples=self.samples, epochs=self.versions + 3,
                concurrency=self.concurrency, model=model, tenant=tenant, max_staleness=self.max_staleness,
                run_id=f"demo-{model}-{tenant}-seed{self.seed}", train_batch_size=self.batch, timeout_s=120,
                logs_dir=out / "attempts" / tenant) for tenant in self.keys},
            agent_env={"AGENT_MAX_TOKENS": str(self.max_tokens or spec.max_tokens), "AGENT_TEMPERATURE": "1.0"})


# --- what the run shows -----------------------------------------------------------------------


@dataclass
class TenantRow(VersionRow):
    lineage: list[str] = field(default_factory=list)
    load_ms: float | None = None
    """what loading this adapter version on the server cost (0 pause, 0 hold: the pool event)"""


@dataclass
class Checks:
    """What the topics say about isolation: calls recorded as their tenant's adapter, training on one's own
    trajectories only, no one held or paused."""

    calls: dict[str, int] = field(default_factory=dict)
    misnamed: list[str] = field(default_factory=list)
    """calls whose recorded model is not their tenant's adapter (`tenant@version`, the base before version 1)"""
    failed: dict[str, int] = field(default_factory=dict)
    held_or_paused: list[str] = field(default_factory=list)
    """adapter loads that held requests or paused the server (pool events), base weight swaps"""
    trajectory_tenants: dict[str, str | None] = field(default_factory=dict)
    holds: dict[str, float] = field(default_factory=dict)
    """the gateway's hold counters at the end"""


class TenantProgress(Progress):
    """Per tenant, per adapter version: the rewards of its answers, what it trained on, its load; and `Checks`."""

    row_type = TenantRow

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model
        self.tenants: dict[str, dict[int, TenantRow]] = {}
        self.checks = Checks()

    def tenant_row(self, tenant: str, version: int) -> TenantRow:
        return self.tenants.setdefault(tenant, {}).setdefault(version, TenantRow(version))

    def take(self, event: Event) -> None:
        if isinstance(event, TrajectoryEvent):
            self.checks.trajectory_tenants[event.id] = event.data.tenant
            if event.data.tenant is not None and event.data.reward is not None and event.data.split == "train":
                versions = [turn.weight_version for turn in event.data.turns if turn.weight_version is not None]
                self.tenant_row(event.data.tenant, min(versions) if versions else 0).rewards.append(event.data.reward)
        elif isinstance(event, WeightsEvent) and event.data.tenant is not None:
            row = self.tenant_row(event.data.tenant, event.data.version)
            row.trained, row.lineage = len(event.data.lineage), list(event.data.lineage)
            row.published_at = time.monotonic() - self.started
        elif isinstance(event, PoolUpdateEvent):
            self.take_update(event)
        elif isinstance(event, CallEvent):
            self.take_call(event)

    def take_update(self, event: PoolUpdateEvent) -> None:
        update = event.data
        if update.tenant is None or update.pause_ms or update.held_ms:
            self.checks.held_or_paused.append(f"{update.tenant or 'the base'} version {update.version}: paused "
                                              f"{update.pause_ms:.0f} ms, held {update.held_ms or 0:.0f} ms")
        if update.tenant is not None and update.status == "ok":
            self.tenant_row(update.tenant, update.version).load_ms = update.load_ms

    def take_call(self, event: CallEvent) -> None:
        call = event.data
        tenant = call.tenant or "(none)"
        self.checks.calls[tenant] = self.checks.calls.get(tenant, 0) + 1
        if call.status != 200:
            self.checks.failed[tenant] = self.checks.failed.get(tenant, 0) + 1
        version = call.weight_version or 0
        expected = adapter_name(tenant, version) if version > 0 else self.model
        if call.tenant is None or call.model != expected:
            self.checks.misnamed.append(f"{event.id}: tenant {call.tenant}, model {call.model}, version {version}")

    def foreign_samples(self) -> dict[str, int]:
        """Per tenant, samples its versions trained on that were another tenant's trajectories (or unknown)."""
        tenant_of = self.checks.trajectory_tenants
        return {tenant: sum(tenant_of.get(sample) != tenant for row in rows.values() for sample in row.lineage)
                for tenant, rows in self.tenants.items()}

    def table(self) -> Table:
        table = Table(title="agentstream demo --tenants: reward of the answers each tenant's adapter version wrote")
        for column in ("tenant", "version", "answers", "reward mean", "trained on", "adapter load", "published at"):
            table.add_column(column, justify="right")
        for tenant in sorted(self.tenants):
            for version, row in sorted(self.tenants[tenant].items()):
                table.add_row(
                    tenant, str(version), str(len(row.rewards)),
                    f"{row.reward_mean:.3f}" if row.reward_mean is not None else "",
                    "" if row.trained is None else f"{row.trained} samples",
                    "" if row.load_ms is None else f"{row.load_ms:.0f} ms",
                    "" if row.published_at is None else f"{row.published_at:.0f} s")
        return table


class TenantDemo(Demo):
    config: TenantDemoConfig
    starting = "Starting the local stack (Kafka, vLLM-CPU with LoRA adapters)…"

    def __init__(self, config: TenantDemoConfig, console: Console):
        super().__init__(config, console)
        self.progress: TenantProgress = TenantProgress(config.model)
        self.gateway_url = ""
        self.deadline = float("inf")

    def inference(self, model_dir: Path) -> list[ServerState]:
        return [self.serve(model_dir, self.vllm, lora=self.config.lora)]

    async def launch(self, stack: Stack) -> None:
        self.gateway_url = stack.gateway_url
        await super().launch(stack)
        self.deadline = time.monotonic() + self.config.timeout_s

    async def follow(self, kafka: KafkaSettings) -> None:
        """Until every tenant's last version has a full batch of answers, or every controller ran its rollouts and
        their trajectories are in, or the time is up; then the gateway's hold counters."""
        last_record = time.monotonic()

        async def done(fetched: bool) -> bool:
            nonlocal last_record
            if fetched:
                last_record = time.monotonic()
            if time.monotonic() > self.deadline:
                self.say(f"Stopping after {self.config.timeout_s:.0f} s without every tenant's last version.")
                return True
            controllers = [s.name for s in self.running if s.name.startswith("controller-")]
            return self.finished() or (all(self.service_done(name) for name in controllers)
                                       and time.monotonic() - last_record > QUIET_S)

        topics = kafka.topics
        await self.watch(kafka, [topics.trajectories, topics.weights, topics.pool, topics.calls], done)
        self.progress.checks.holds = await hold_counters(self.gateway_url)

    def finished(self) -> bool:
        lasts = [self.progress.tenants.get(tenant, {}).get(self.config.versions) for tenant in self.config.keys]
        return all(last is not None and last.published_at is not None and len(last.rewards) >= self.config.batch
                   for last in lasts)


HOLD_METRICS = ("gateway_hold_wait_seconds_count", "gateway_hold_timeouts_total")


async def hold_counters(gateway_url: str) -> dict[str, float]:
    """The gateway's counters of requests held for a weight update (its Prometheus text)."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{gateway_url}/metrics", timeout=10)).text
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in HOLD_METRICS:
            counters[name] = float(value)
    return counters


# --- the summary ----------------------------------------------------------------------------


def tenant_summary(progress: TenantProgress, config: TenantDemoConfig, console: Console,
                   elapsed_s: float) -> dict[str, Any]:
    checks, foreign = progress.checks, progress.foreign_samples()
    per_tenant = {}
    for task in config.tasks_of():
        tenant = tenant_name(task)
        rows = progress.tenants.get(tenant, {})
        loads = sorted(row.load_ms for row in rows.values() if row.load_ms is not None)
        first, last = rows.get(0), rows.get(config.versions)
        per_tenant[tenant] = {
            "task": task.name, "characters": task.characters,
            "reward_start": first.reward_mean if first else None, "reward_end": last.reward_mean if last else None,
            "load_ms_p50": loads[len(loads) // 2] if loads else None, "load_ms_max": loads[-1] if loads else None,
            "calls": checks.calls.get(tenant, 0), "failed_calls": checks.failed.get(tenant, 0),
            "trained_on_other_tenants": foreign.get(tenant, 0),
            "per_version": {v: {"answers": len(row.rewards), "reward_mean": row.reward_mean,
                                "trained_on": row.trained, "load_ms": row.load_ms} for v, row in sorted(rows.items())},
        }
    result = {
        "model": config.model, "seed": config.seed, "tenants": config.tenants, "lora_rank": LORA_RANK,
        "lr": LORA_LR[config.model], "versions": config.versions, "samples_per_version": config.batch,
        "wall_time_s": round(elapsed_s, 1), "per_tenant": per_tenant,
        "calls_misnamed": checks.misnamed[:20], "calls_of_no_tenant": checks.calls.get("(none)", 0),
        "held_or_paused": checks.held_or_paused, "hold_counters": checks.holds,
    }
    (config.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(progress, config, config.out / "reward.png")
    console.print(progress.table())
    for tenant, numbers in per_tenant.items():
        console.print(f"{tenant} ({numbers['task']}): reward {numbers['reward_start']} at version 0, "
                      f"{numbers['reward_end']} at version {config.versions}; adapter load p50 "
                      f"{numbers['load_ms_p50']} ms; {numbers['calls']} calls, {numbers['failed_calls']} failed; "
                      f"{numbers['trained_on_other_tenants']} samples of another tenant trained on")
    console.print(f"Calls not recorded as their tenant's adapter: {len(checks.misnamed)}. Updates that held or "
                  f"paused anyone: {len(checks.held_or_paused)}. Gateway hold counters: {checks.holds}. "
                  f"Wall time {elapsed_s:.0f} s. Plot: {config.out / 'reward.png'}")
    return result


def plot(progress: TenantProgress, config: TenantDemoConfig, path: Path) -> None:
    versions = sorted({v for rows in progress.tenants.values() for v in rows})
    lines = {f"{tenant} ({task.name})": [rows.get(v, TenantRow(v)).reward_mean for v in versions]
             for task in config.tasks_of() if (rows := progress.tenants.get(tenant := tenant_name(task), {}))}
    plot_by_version(path, f"agentstream demo --tenants {config.tenants}: one adapter per tenant ({config.model})",
                    versions, lines, ylabel="mean reward of the answers it wrote", ylim=(0, 1.05))


def run_tenant_demo(config: TenantDemoConfig, console: Console | None = None) -> dict[str, Any]:
    return run_to_summary(TenantDemo(config, console or Console()), tenant_summary)

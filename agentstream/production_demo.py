"""`agentstream demo --production`: learning from production traffic, with canary releases, on one machine.

No controller and no tasks with graders: simulated users (`examples/production_users.py`, an ordinary
OpenAI-SDK program, shipped as `agentstream.examples`) open sessions through the gateway's plain `/v1`, ask arithmetic questions, end their
sessions and rate the answers later, by a preference the starting model does not have (answers in
digits). The streams worker turns each session into a trajectory and its feedback into a reward
(`--reward-policy`); the trainer learns from those sessions off-policy (`--rollout-is token`, REINFORCE++
over ungrouped samples); every new version goes out as a canary on the second of two vLLM servers for a
share of the sessions; the decision service (`python -m agentstream.releases`) promotes it when its users rate it
better, or rolls it back. The report shows, per version, the users' reward of the sessions it served,
what it was trained on, its swap pause and its canary's decision with its numbers, and plots them
(`reward.png`, `summary.json` in runs/demo-production-*).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

from agentstream.demo.loop import Loop, Stack
from agentstream.demo.preset import example_file
from agentstream.demo.progress import Progress, VersionRow, plot_by_version
from agentstream.demo.run import Demo, StackConfig, run_folder, run_to_summary
from agentstream.models.tiny_model import build_tiny_model
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.events import Event, ReleaseEvent, RewardEvent, TrajectoryEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack import StackError
from agentstream.stack.process import ServerState, free_port
from agentstream.stack.service import Service
from agentstream.stack.vllm import LocalVLLM
from agentstream.streams.settings import StreamsSettings
from agentstream.trainer.settings import TrainerSettings

QUESTIONS = "questions.jsonl"
"""the users' questions (`examples/arithmetic_tasks.jsonl`), copied into the run's folder"""
PAST = {"promote": "promoted", "rollback": "rolled back"}
DECISIONS = tuple(PAST)


class Users(BaseModel):
    """The flags of the simulated users (`examples/production_users.py`, an argparse program), typed."""

    tasks: Path
    concurrency: int
    rate: float
    max_tokens: int
    delay_s: float
    late_share: float
    late_delay_s: float
    seed: int


class ProductionLoop(Loop):
    """The loop without a controller: users send the traffic, straight to the gateway's `/v1`."""

    users: Users
    users_env: dict[str, str]
    """the OpenAI SDK's address and key, the model to ask"""

    def traffic(self) -> list[Service]:
        return [Service("users", "agentstream.examples.production_users", self.users, env=self.users_env)]


class ProductionConfig(StackConfig):
    versions: int = 3
    sessions_per_version: int = 64
    """rated sessions one weight version trains on"""
    concurrency: int = 4
    """users at once (at most)"""
    rate: float = 1.5
    """new users per second: slow enough that a canary is decided before the next version is trained"""
    max_tokens: int = 8
    canary_share: float = 0.5
    """sessions a new version serves first"""
    min_sessions: int = 12
    """rated sessions each arm needs before the decision service tests"""
    max_sessions: int = 24
    """sessions per arm after which a canary that is not better is rolled back"""
    feedback_window_s: float = 8.0
    """how long an ended session waits for feedback before its trajectory goes out without a reward"""
    late_share: float = 0.1
    """users who rate after the window (their rating is a reward event naming the trajectory)"""
    seed: int = 0
    timeout_s: float = 1200.0
    """the run ends, decided or not, after this long with the services up"""
    out: Path = Field(default_factory=lambda: run_folder("demo-production"))

    @property
    def batch(self) -> int:
        return self.sessions_per_version

    @property
    def canary_vllm_name(self) -> str:
        return f"{self.vllm_name}-canary"

    def build_model(self, out: Path, say: Callable[[str], None]) -> Path:
        if self.model != "tiny":
            raise StackError(f"the production demo runs the tiny model, not {self.model!r}")
        return build_tiny_model(out / "base-model")

    def prepare(self, out: Path) -> None:
        (out / QUESTIONS).write_text(example_file("arithmetic_tasks.jsonl"))

    def loop(self, stack: Stack) -> ProductionLoop:
        model, out = self.model, stack.out
        return ProductionLoop(
            gateway=stack.gateway(model, canary_share=self.canary_share, canary_servers=1,
                                  base_weights=[f"{model}={stack.model_dir.resolve()}"]),
            streams=stack.settings(StreamsSettings, settle_s=0.3, data_dir=out / "streams", web_port=free_port(),
                                   reward_policy="streams.policies:latest", feedback_window_s=self.feedback_window_s,
                                   session_idle_s=120),
            trainer=stack.settings(
                TrainerSettings, model=model, base_model=stack.model_dir, checkpoint_dir=out / "checkpoints",
                group_size=8, groups_per_batch=max(1, self.sessions_per_version // 8),
                ungrouped_adv_estimator="reinforce_plus_plus", rollout_is="token",
                # off-policy REINFORCE++ over a few dozen rated sessions a version: larger steps, two passes, than
                # the demo's on-policy groups (its tiny model's 3e-3) to move the users' reward in 3 versions
                lr=8e-3, epochs=2, max_staleness=self.versions, max_versions=self.versions, seed=self.seed),
            releases=stack.settings(
                ReleasesSettings, alpha=0.05, min_sessions=self.min_sessions, max_sessions=self.max_sessions,
                min_calls=self.min_sessions, max_error_rate_increase=0.2, interval_s=2,
                # two CPU servers on one loaded machine: their latencies differ by the load, not the version
                max_latency_ratio=50),
            users=Users(tasks=out / QUESTIONS, concurrency=self.concurrency, rate=self.rate, max_tokens=self.max_tokens,
                        delay_s=2, late_share=self.late_share, late_delay_s=self.feedback_window_s + 6, seed=self.seed),
            users_env={"OPENAI_BASE_URL": f"{stack.gateway_url}/v1", "OPENAI_API_KEY": stack.api_key,
                       "AGENTSTREAM_MODEL": model})


# --- what the run shows: the demo's fold, plus late rewards and the canary decisions ---------


@dataclass
class Decision:
    version: int
    action: str
    decided_by: str
    at_s: float
    stable_version: int
    p_value: float | None
    arms: list[dict[str, Any]]
    reason: str

    def text(self) -> str:
        arms = " vs ".join(f"v{arm['version']} {arm['mean_reward']:.2f} (n={arm['sessions']})"
                           for arm in self.arms if arm["mean_reward"] is not None)
        p = f", p={self.p_value:.2g}" if self.p_value is not None else ""
        return f"{PAST[self.action]} by {self.decided_by}{p}: {arms}"


@dataclass
class ProductionRow(VersionRow):
    late_rewards: int = 0
    canary_at_s: float | None = None
    decision: Decision | None = None


class ProductionProgress(Progress):
    """Per version: the users' rewards of the sessions it served (late ones too), what it trained on, its
    swap pause, and its canary's decision."""

    row_type = ProductionRow

    def __init__(self) -> None:
        super().__init__()
        self.unrewarded: dict[str, int] = {}
        """trajectory id → the version that served it, for sessions whose rating came after the window"""
        self.decisions: list[Decision] = []

    def row(self, version: int) -> ProductionRow:
        row = super().row(version)
        assert isinstance(row, ProductionRow)  # row_type
        return row

    def take(self, event: Event) -> None:
        if isinstance(event, TrajectoryEvent) and event.data.reward is None and event.data.session_id:
            versions = [turn.weight_version for turn in event.data.turns if turn.weight_version is not None]
            self.unrewarded[event.id] = min(versions) if versions else 0
        elif isinstance(event, RewardEvent) and event.data.trajectory_id in self.unrewarded:
            row = self.row(self.unrewarded.pop(event.data.trajectory_id))
            row.rewards.append(event.data.value)
            row.late_rewards += 1
        elif isinstance(event, ReleaseEvent):
            self.take_release(event)
        else:
            super().take(event)

    def take_release(self, event: ReleaseEvent) -> None:
        release, at_s = event.data, time.monotonic() - self.started
        row = self.row(release.version)
        if release.action == "canary":
            row.canary_at_s = at_s
        elif release.action in DECISIONS and row.decision is None:
            row.decision = Decision(
                version=release.version, action=release.action, decided_by=release.decided_by, at_s=round(at_s, 1),
                stable_version=release.stable_version, p_value=release.p_value, reason=release.reason,
                arms=[{"version": arm.version, "sessions": arm.sessions, "mean_reward": arm.mean_reward,
                       "reward_std": arm.reward_std, "calls": arm.calls, "errors": arm.errors,
                       "p95_latency_ms": arm.p95_latency_ms} for arm in release.arms])
            self.decisions.append(row.decision)

    def undecided(self, version: int) -> str:
        """A canary without a decision: running, or replaced by a newer version's canary before one came."""
        if self.row(version).canary_at_s is None:
            return ""
        newer = [v for v, row in self.rows.items() if v > version and isinstance(row, ProductionRow)
                 and row.canary_at_s is not None]
        return f"replaced by v{min(newer)}'s canary" if newer else "running"

    def table(self) -> Table:
        table = Table(title="agentstream demo --production: the users' reward of the sessions each version served")
        for column in ("version", "sessions", "reward mean", "trained on", "swap pause", "published at", "canary"):
            table.add_column(column, justify="left" if column == "canary" else "right")
        for version in sorted(self.rows):
            row = self.rows[version]
            assert isinstance(row, ProductionRow)
            canary = row.decision.text() if row.decision else self.undecided(version)
            table.add_row(
                str(version), f"{len(row.rewards)}" + (f" ({row.late_rewards} late)" if row.late_rewards else ""),
                f"{row.reward_mean:.3f}" if row.reward_mean is not None else "",
                "" if row.trained is None else f"{row.trained} sessions",
                "" if row.pause_ms is None else f"{row.pause_ms:.0f} ms",
                "" if row.published_at is None else f"{row.published_at:.0f} s", canary)
        return table


# --- the stack and the services -----------------------------------------------------------


class ProductionDemo(Demo):
    config: ProductionConfig
    starting = "Starting the local stack (Kafka, two vLLM-CPU servers)…"

    def __init__(self, config: ProductionConfig, console: Console):
        super().__init__(config, console)
        self.canary_vllm = LocalVLLM(config.canary_vllm_name)
        self.progress: ProductionProgress = ProductionProgress()
        self.deadline = float("inf")

    def inference(self, model_dir: Path) -> list[ServerState]:
        """Both servers at once (a canary needs a server of its own)."""
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda server: self.serve(model_dir, server), (self.vllm, self.canary_vllm)))

    def stop_all(self) -> None:
        super().stop_all()
        if not self.config.keep_stack:
            self.canary_vllm.stop()

    async def launch(self, stack: Stack) -> None:
        await super().launch(stack)
        self.deadline = time.monotonic() + self.config.timeout_s

    async def follow(self, kafka: KafkaSettings) -> None:
        """Until the last version's canary is decided, or the time is up."""
        topics = kafka.topics

        async def done(fetched: bool) -> bool:
            if time.monotonic() > self.deadline:
                self.say(f"Stopping after {self.config.timeout_s:.0f} s without the last version decided.")
                return True
            return self.finished()

        await self.watch(kafka, [topics.trajectories, topics.rewards, topics.weights, topics.pool, topics.releases],
                         done)

    def finished(self) -> bool:
        last = self.progress.rows.get(self.config.versions)
        return bool(last and isinstance(last, ProductionRow) and last.decision is not None)


# --- the summary ----------------------------------------------------------------------------


def production_summary(progress: ProductionProgress, config: ProductionConfig, console: Console,
                       elapsed_s: float) -> dict[str, Any]:
    rows = {v: row for v, row in sorted(progress.rows.items()) if isinstance(row, ProductionRow)}
    pauses = sorted(row.pause_ms for row in rows.values() if row.pause_ms is not None)
    result = {
        "model": config.model, "seed": config.seed, "versions": config.versions,
        "sessions_per_version": config.batch, "canary_share": config.canary_share,
        "wall_time_s": round(elapsed_s, 1), "load_average_1m_at_end": round(os.getloadavg()[0], 1),
        "sessions_trained_on": sum(row.trained or 0 for row in rows.values()),
        "reward_start": rows[0].reward_mean if 0 in rows else None,
        "promoted": [d.version for d in progress.decisions if d.action == "promote"],
        "rolled_back": [d.version for d in progress.decisions if d.action == "rollback"],
        "pause_ms_p50": pauses[len(pauses) // 2] if pauses else None, "pause_ms_max": pauses[-1] if pauses else None,
        "per_version": {v: {"sessions": len(row.rewards), "late_rewards": row.late_rewards,
                            "reward_mean": row.reward_mean, "trained_on": row.trained, "pause_ms": row.pause_ms,
                            "published_at_s": None if row.published_at is None else round(row.published_at, 1)}
                        for v, row in rows.items()},
        "decisions": [vars(decision) for decision in progress.decisions],
    }
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(progress, config.out / "reward.png")
    console.print(progress.table())
    console.print(f"{result['sessions_trained_on']} rated sessions trained on; promoted "
                  f"{result['promoted'] or 'none'}, rolled back {result['rolled_back'] or 'none'}. "
                  f"Wall time {elapsed_s:.0f} s. "
                  f"Plot: {config.out / 'reward.png'}")
    return result


def plot(progress: ProductionProgress, path: Path) -> None:
    """Reward by version, each decided canary marked at its version (▲ promoted, ▼ rolled back) with its p-value."""
    versions = [v for v in sorted(progress.rows) if progress.rows[v].reward_mean is not None]

    def annotate(axis: Any) -> None:
        for decision in progress.decisions:
            row = progress.rows[decision.version]
            if row.reward_mean is None:
                continue
            promoted = decision.action == "promote"
            axis.scatter([decision.version], [row.reward_mean], marker="^" if promoted else "v", s=160, zorder=3,
                         color="tab:green" if promoted else "tab:red",
                         label="promoted" if promoted else "rolled back")
            if decision.p_value is not None:
                axis.annotate(f"p={decision.p_value:.2g}", (decision.version, row.reward_mean),
                              textcoords="offset points", xytext=(-14, 12), fontsize=8)
        axis.set_xlim(min(versions) - 0.5, max(versions) + 0.5)
        handles, labels = axis.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        axis.legend(unique.values(), unique.keys())

    plot_by_version(path, "agentstream demo --production: users' reward by version, canary decisions", versions,
                    {"": [progress.rows[v].reward_mean for v in versions]},
                    ylabel="mean reward of the sessions it served", ylim=(0, 1.05), decorate=annotate)


def run_production_demo(config: ProductionConfig, console: Console | None = None) -> dict[str, Any]:
    return run_to_summary(ProductionDemo(config, console or Console()), production_summary)

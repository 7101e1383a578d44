"""`agentstream tasks swe demonstrate`'s summary: how many demonstrations passed the hidden tests, which is what the
warm start learns from (`--sft-min-reward 1`) and how many sequences its batch holds (recipes/swe/stages.py)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from agentstream.demo.loop import Stack
from agentstream.recipes.swe.demonstrate import Demonstrate, DemonstrateConfig
from agentstream.schemas.events import Eval, EvalEvent
from agentstream.schemas.kafka import KafkaSettings


def test_the_demonstrations_that_passed_are_counted_not_derived_from_pass_at_1(tmp_path: Path):
    """Two tasks, one with three attempts: pass@1 (the mean of the tasks' rates, 1/3 and 1/1: 0.67) × 4 attempts
    rounds to 3, but two passed (one failed, one has no reward: its attempt timed out)."""
    console = Console(record=True, width=400)
    demonstrate = Demonstrate(DemonstrateConfig(out=tmp_path / "run"), console)
    demonstrate.out.mkdir()
    per_task: dict[str, list[float | None]] = {"a": [1.0, 0.0, None], "b": [1.0]}
    demonstrate.result = {"seconds": 1.0, "trajectories": {}, "event": EvalEvent(source="test", data=Eval(
        weight_version=0, run_id="demonstrate", tasks=2, k=1, samples=4, pass_at_1=(1 / 3 + 1) / 2, pass_at_k=1.0,
        solved_tasks=2, unscored={"timed_out": 1}, per_task=per_task))}
    demonstrate.demonstrations = tmp_path / "demonstrations.jsonl"
    demonstrate.stack = Stack(kafka=KafkaSettings(), model_dir=tmp_path / "model", servers=[], gateway_port=0,
                              token_secret="", api_key="", out=tmp_path / "run")

    result = demonstrate.summary(console, elapsed_s=1.0)

    assert result["rewarded"] == 2
    assert "2 of 4 demonstrations passed the hidden tests" in console.export_text()

"""`agentstream tasks swe demonstrate`'s summary: how many demonstrations passed the hidden tests, which is what the
warm start learns from (`--sft-min-reward 1`) and how many sequences its batch holds (recipes/swe/stages.py)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from agentstream.demo.loop import Stack
from agentstream.recipes.swe.demonstrate import Demonstrate, DemonstrateConfig, by_kind, kind_of
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


def test_the_demonstrations_are_counted_by_kind_of_bug():
    """The stage's per-kind figure: train tasks, those attempted (a reward list, even an unscored one), those graded 1."""
    kinds = {"pypi__toolz-1.2.0.drop_branch__0a1b2c3d": "drop_branch", "pypi__toolz-1.2.0.drop_branch__4e5f6a7b": "drop_branch",
             "pypi__toolz-1.2.0.flip_operator__8c9d0e1f": "flip_operator"}
    data = Eval(weight_version=0, run_id="demonstrate", tasks=2, k=1, samples=2, pass_at_1=0.5, pass_at_k=0.5,
                solved_tasks=1, per_task={"pypi__toolz-1.2.0.drop_branch__0a1b2c3d": [1.0],
                                          "pypi__toolz-1.2.0.flip_operator__8c9d0e1f": [None]})
    assert by_kind(kinds, data) == {"drop_branch": {"train": 2, "demonstrated": 1, "rewarded": 1},
                                    "flip_operator": {"train": 1, "demonstrated": 1, "rewarded": 0}}
    assert [kind_of(task) for task in ("pypi__toolz-1.2.0.drop_branch__0a1b2c3d", "calc-1", "django__django-11099")] == \
        ["drop_branch", "other", "other"]

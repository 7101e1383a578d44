"""What the coding recipe reports per version, and what it defaults to per model.

- the 95 % interval of validation pass@1 (agentstream.eval): Wilson's interval against published values,
  the per-task rates' interval with one and with several samples per task, its coverage by simulation;
- the per-version figures (recipes.swe.recipe.Progress) from real events: groups with signal, end
  reasons, flagged gradings, the interval;
- the per-model defaults (recipes.swe.models): a coder model's, the test models' kept small, a given value
  (or None, meaning "not given") winning over or yielding to them.
"""

from __future__ import annotations

import random

import pytest

import agentstream.schemas as s
from agentstream.eval import pass_at_1_interval, wilson_interval
from agentstream.recipes.swe.models import DEFAULTS
from agentstream.recipes.swe.probe import ProbeConfig
from agentstream.recipes.swe.recipe import Progress, RecipeConfig
from samples.events import chat_prompt, ids, trajectory


@pytest.mark.parametrize(("passed", "n", "low", "high"), [
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (Wilson score, no continuity correction)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
    # Brown, Cai & DasGupta (2001): n = 10
    (0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0),
])
def test_wilson_interval_matches_published_values(passed, n, low, high):
    got = wilson_interval(passed, n)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_with_no_trials_is_everything():
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_one_sample_per_task_is_wilson_over_tasks_and_unscored_counts_as_failed():
    per_task: dict[str, list[float | None]] = {"a": [1.0], "b": [0.0], "c": [None], "d": [0.4], "e": [1.0]}
    assert pass_at_1_interval(per_task) == wilson_interval(2, 5)
    assert pass_at_1_interval(per_task, threshold=0.4) == wilson_interval(3, 5)


def test_several_samples_per_task_count_tasks_not_samples():
    """Two tasks, two samples each, one solved both times: the units are the 2 tasks (rate 0.5), not 4 samples."""
    per_task: dict[str, list[float | None]] = {"a": [1.0, 1.0], "b": [0.0, 0.0]}
    assert pass_at_1_interval(per_task) == wilson_interval(1, 2)
    assert pass_at_1_interval(per_task) != wilson_interval(2, 4)
    mixed: dict[str, list[float | None]] = {"a": [1.0, 0.0], "b": [1.0, 0.0, 0.0, 0.0]}
    assert pass_at_1_interval(mixed) == pytest.approx(wilson_interval(0.5 + 0.25, 2))


def test_the_interval_covers_pass_at_1_at_least_95_percent_of_the_time():
    """Simulated evals (12 tasks of varied difficulty, 1 and 4 samples each): the true mean pass rate is
    inside the interval in at least 94 % of 2,000 runs (the binomial noise of 2,000 runs is ±1 %)."""
    rng = random.Random(0)
    difficulty = [0.05, 0.1, 0.1, 0.2, 0.3, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    truth = sum(difficulty) / len(difficulty)
    for samples in (1, 4):
        covered = 0
        for _ in range(2000):
            per_task: dict[str, list[float | None]] = {
                str(i): [1.0 if rng.random() < p else 0.0 for _ in range(samples)] for i, p in enumerate(difficulty)}
            low, high = pass_at_1_interval(per_task)
            covered += low <= truth <= high
        assert covered / 2000 >= 0.94, (samples, covered)


def reward(rollout: str, value: float, flagged: bool) -> s.RewardEvent:
    return s.RewardEvent(source="grader", rollout_id=rollout, attempt_id="a1",
                         data=s.Reward(value=value, reward_fn="recipes.swe.grader", details={"flagged": flagged}))


def attempt(group: str, index: int, value: float | None, end: str, version: int = 0,
            split: str = "train") -> s.TrajectoryEvent:
    event = trajectory(chat_prompt(group), ids("fix"), value, group, index, version=version, split=split)
    event.data.end_reason, event.data.weight_version_launch = end, version
    return event


def test_progress_reports_groups_with_signal_end_reasons_flags_and_the_interval():
    progress = Progress(RecipeConfig(model="tiny"))
    events: list[s.Event] = [
        reward("r-g1-0", 1.0, False), attempt("g1", 0, 1.0, "submitted"),
        reward("r-g1-1", 0.0, True), attempt("g1", 1, 0.0, "step_limit"),
        reward("r-g2-0", 0.0, False), attempt("g2", 0, 0.0, "step_limit"),
        reward("r-g2-1", 0.0, False), attempt("g2", 1, 0.0, "format_errors"),
        attempt("g3", 0, None, "time_limit"),  # no grading: not counted as graded
        attempt("v", 0, 0.0, "submitted", split="validation"),
        reward("r-g4-0", 1.0, False), attempt("g4", 0, 1.0, "submitted", version=1),
        s.EvalEvent(source="eval", data=s.Eval(weight_version=0, run_id="e", tasks=2, k=1, samples=2, pass_at_1=0.5,
                                               pass_at_k=0.5, solved_tasks=1, per_task={"a": [1.0], "b": [0.0]})),
    ]
    for event in events:
        progress.take(event)
    rows = progress.recipe_rows()
    zero, one = rows[0], rows[1]
    assert len(zero.groups) == 3 and zero.signal_share == pytest.approx(1 / 3)  # g1 mixed; g2 all 0; g3 unscored
    assert zero.end_reasons == {"step_limit": 2, "submitted": 2, "format_errors": 1, "time_limit": 1}
    assert (zero.graded, zero.flagged, zero.flagged_share) == (4, 1, 0.25)
    assert zero.train_rewards == [1.0, 0.0, 0.0, 0.0] and zero.train_unscored == 1
    assert zero.pass_at_1_interval == wilson_interval(1, 2)
    assert (one.signal_share, one.flagged_share, one.pass_at_1_interval) == (0.0, 0.0, None)
    table = progress.table()
    assert "groups with signal" in [c.header for c in table.columns]


def test_coder_models_get_room_to_work_and_the_test_models_stay_quick():
    coder = RecipeConfig(model="qwen-coder-0.5b")
    assert (coder.step_limit, coder.max_tokens, coder.trainer().max_seq_len, coder.group_size) == (12, 384, 2048, 4)
    assert (coder.trainer().lora_rank, coder.trainer().lr) == (32, 1e-4), "as the README's GRPO from the warm start"
    assert "gradient_checkpointing" not in coder.trainer().model_fields_set, "the trainer's memory check picks it"
    large = RecipeConfig(model="qwen-coder-1.5b").trainer()
    assert large.lora_rank == 16 and large.lr == 1e-4, "the 1.5B does not fit full fine-tuning in 24 GiB"
    for quick in ("tiny", "smollm2"):
        config = RecipeConfig(model=quick)
        assert (config.step_limit, config.max_tokens, config.trainer().max_seq_len, config.group_size) == (4, 128, 2048, 2)
    assert set(DEFAULTS) == {"qwen-coder-0.5b", "qwen-coder-1.5b", "smollm2", "tiny"}


def test_a_given_setting_wins_and_none_means_the_models_default():
    given = RecipeConfig(model="qwen-coder-0.5b", step_limit=3, max_tokens=None, flags={"trainer": ["--lora-rank=8"]})
    assert (given.step_limit, given.max_tokens, given.trainer().lora_rank, given.trainer().lr) == (3, 384, 8, 1e-4)
    probe = ProbeConfig(model="qwen-coder-1.5b", k=3, attempt_timeout_s=None)
    assert (probe.k, probe.attempt_timeout_s, probe.trainer().max_seq_len) == (3, 3600.0, 8192)
    assert RecipeConfig().model == "smollm2" and RecipeConfig().step_limit == 4

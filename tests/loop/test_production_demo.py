"""What `agentstream demo --production` reports, folded from events alone (no stack): the users' rewards by the
version that served each session (late ratings too), and each canary's fate."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

import agentstream.schemas as s
from agentstream.production_demo import ProductionConfig, ProductionProgress, production_summary


def session(version: int, reward: float | None, name: str) -> s.TrajectoryEvent:
    turn = s.Turn(call_id=f"c-{name}", sequence=0, prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1],
                  weight_version=version)
    return s.TrajectoryEvent(source="streams", rollout_id=f"session-{name}", attempt_id="segment-0", data=s.Trajectory(
        status="finished", reward=reward, reward_missing=reward is None, turns=[turn], sequences=[], merged=True,
        finished_at=0, lineage=[], session_id=name))


def release(action: str, version: int, stable: int, p_value: float | None = None) -> s.ReleaseEvent:
    arms = [s.ArmNumbers(version=stable, sessions=12, mean_reward=0.1), s.ArmNumbers(version=version, sessions=14,
                                                                                     mean_reward=0.3)]
    return s.ReleaseEvent(source="releases", data=s.Release(
        model="tiny", action=action, version=version, uri=f"/v{version}", stable_version=stable, stable_uri="/v0",
        share_bp=5000, servers=["http://b"], started_at=1, decided_by="rule" if action != "canary" else "",
        arms=arms if action != "canary" else [], p_value=p_value))


def weights(version: int, trained: int) -> s.WeightsEvent:
    return s.WeightsEvent(source="trainer", data=s.Weights(model="tiny", version=version, uri=f"/v{version}",
                                                           step=version, lineage=[f"t{i}" for i in range(trained)]))


def test_late_ratings_count_for_the_version_that_served_and_each_canary_has_its_fate(tmp_path):
    progress = ProductionProgress()
    late = session(0, None, "late")
    for event in (session(0, 0.1, "a"), session(0, 0.3, "b"), late, weights(1, 3), release("canary", 1, 0),
                  session(1, 0.5, "c"), weights(2, 3), release("canary", 2, 0),
                  s.RewardEvent(source="streams", rollout_id=late.rollout_id, attempt_id="segment-0",
                                data=s.Reward(value=0.2, reward_fn="streams.policies:latest", trajectory_id=late.id)),
                  release("promote", 2, 0, p_value=0.01), release("rollback", 2, 0, p_value=0.9)):
        progress.add(event)
        progress.add(event)  # a repeated record changes nothing

    assert progress.rows[0].rewards == [0.1, 0.3, 0.2] and progress.rows[0].late_rewards == 1
    assert progress.rows[1].rewards == [0.5]
    assert progress.undecided(1) == "replaced by v2's canary"
    [decision] = progress.decisions  # the first decision of a canary stands
    assert (decision.version, decision.action, decision.p_value) == (2, "promote", 0.01)
    assert "promoted by rule, p=0.01: v0 0.10 (n=12) vs v2 0.30 (n=14)" in decision.text()

    config = ProductionConfig(versions=2, out=tmp_path / "run")
    result = production_summary(progress, config, Console(width=200, record=True), elapsed_s=12.0)
    assert result["promoted"] == [2] and result["rolled_back"] == []
    assert result["sessions_trained_on"] == 6
    assert result["per_version"][0] == {"sessions": 3, "late_rewards": 1, "reward_mean": pytest.approx(0.2),
                                        "trained_on": None, "pause_ms": None, "published_at_s": None}
    assert json.loads((config.out / "summary.json").read_text())["decisions"][0]["arms"][1]["mean_reward"] == 0.3
    assert (config.out / "reward.png").stat().st_size > 0

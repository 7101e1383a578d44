"""Re-grading history: the diffs are in the log, so a rebuild with a stricter grader (the real grader, a
fresh sandbox per diff, stricter hidden tests) changes the recorded rewards and nothing else: the same
turns, token ids, statuses and lineage apart from the reward events. A diff that games the lenient tests
loses its reward; an honest fix keeps it; an attempt with no diff stays unscored."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

import agentstream.schemas as s
from agentstream.cli import app
from tests.support.logs import read_topic, without_rewards
from tests.support.streams import Rollout, publish
from tests.support.swe import HONEST, calc_instance, make_repo

pytestmark = pytest.mark.timeout(400)
TIMING = ["--settle-s", "0.2", "--reward-grace-s", "2"]

GAMED = ("--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,4 @@\n def add(a, b):\n+    if (a, b) == (1, 2):\n"
         "+        return 3\n     return a - b\n")


def make_instances(tmp_path: Path) -> tuple[Path, Path]:
    """One task in two versions: lenient (add(1, 2) == 3) and strict (also add(2, 2) == 4)."""
    commit = make_repo(tmp_path / "repos", "owner/calc")
    files = []
    for name, checks in (("lenient", ["add(1, 2) == 3"]), ("strict", ["add(1, 2) == 3", "add(2, 2) == 4"])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(calc_instance(commit, *checks, repo="owner/calc").model_dump_json() + "\n")
        files.append(path)
    return files[0], files[1]


def attempt(rollout_id: str, diff: str | None, graded: float | None) -> list[s.Event]:
    """What the controller, gateway and grader service wrote for one coding attempt, in the past: a rebuild
    closes its range at the time it starts, and an attempt that ended less than its settle time (or, with
    no reward, its reward grace) before that is rightly left open (test_replay: ..._ended_too_recently_...)."""
    r = Rollout(rollout_id)
    events = [r.queued("calc-1"), r.call([1, 2, 3], [4, 5], "sed …"), r.call([1, 2, 3, 4, 5, 6], [7, 8], "submit")]
    if diff is not None:
        events.append(s.RolloutDiffEvent(source="gateway", rollout_id=r.rollout_id, attempt_id=r.attempt_id,
                                         time=r._at(), data=s.RolloutDiff(instance_id="calc-1", base_commit="c",
                                                                           diff=diff, size=len(diff),
                                                                           outcome="submitted")))
    if graded is not None:
        events.append(s.RewardEvent(source="grader", rollout_id=r.rollout_id, attempt_id=r.attempt_id, time=r._at(),
                                    data=s.Reward(value=graded, reward_fn="recipes.swe.grader")))
    return events + [r.finished()]


async def rebuild(kafka, monkeypatch, tmp_path: Path, topic: str, *args: str) -> dict[str, s.TrajectoryEvent]:
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    result = await asyncio.to_thread(CliRunner().invoke, app, ["replay", "rebuild", "--to-topic", topic, *TIMING,
                                                               "--state", str(tmp_path / f"{topic}.state.json"),
                                                               *args, "--prefix", kafka.topic_prefix])
    assert result.exit_code == 0, result.output
    return {e.rollout_id: e for _, e in await read_topic(kafka, topic)}


async def test_a_stricter_grader_over_recorded_diffs_changes_the_rewards_and_nothing_else(kafka, monkeypatch, tmp_path):
    _lenient, strict = make_instances(tmp_path)
    await publish(kafka, [*attempt("r-honest", HONEST, 1.0), *attempt("r-gamed", GAMED, 1.0),
                          *attempt("r-crashed", None, None)])
    history = await rebuild(kafka, monkeypatch, tmp_path, "history")
    assert {r: t.data.reward for r, t in history.items()} == {"r-honest": 1.0, "r-gamed": 1.0, "r-crashed": None}

    monkeypatch.setenv("AGENTSTREAM_SWE_REPOS", str(tmp_path / "repos"))
    monkeypatch.setenv("AGENTSTREAM_SWE_ENVS", str(tmp_path / "envs"))
    monkeypatch.setenv("AGENTSTREAM_SWE_INSTANCES", str(strict))
    regraded = await rebuild(kafka, monkeypatch, tmp_path, "regraded", "--reward-fn", "recipes.swe.regrade:grade_diff")

    assert {r: t.data.reward for r, t in regraded.items()} == {"r-honest": 1.0, "r-gamed": 0.0, "r-crashed": None}
    for rollout_id, new in regraded.items():
        old = history[rollout_id]
        ids = {r.event_id for r in old.data.rewards + new.data.rewards}
        assert without_rewards(new.data, ids) == without_rewards(old.data, ids), "only the rewards changed"
        assert (new.id, new.time, new.attempt_id) == (old.id, old.time, old.attempt_id)
    gamed = regraded["r-gamed"].data.rewards[-1]
    assert gamed.reward_fn == "recipes.swe.regrade:grade_diff" and gamed.value == 0.0
    assert regraded["r-crashed"].data.reward is None, "no diff: still no score, not a zero"

"""Re-grading history: a reward function that grades an attempt's recorded diff, for `replay rebuild`.

    AGENTSTREAM_SWE_INSTANCES=stricter.jsonl \
    agentstream replay rebuild --reward-fn recipes.swe.regrade:grade_diff --to-topic trajectories-regraded …

The diff is in the log (`rollout.diff`), so a new grader or stricter tests (an instances file whose
test patches and FAIL_TO_PASS/PASS_TO_PASS lists say more) score every past attempt again without
running an agent. The rebuild replaces the rewards the grader computed and nothing else: the same
events make the same turns, sequences and token ids.

An attempt without a diff (its harness crashed) gets no reward here either: a missing score stays
missing, it is not turned into a zero.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from agentstream.schemas.events import Reward
from agentstream.streams.rewards import RewardError, Sample

REWARD_FN = "recipes.swe.regrade:grade_diff"


def _folders() -> tuple[Path, Path]:
    """The repositories and test environments, as the environment names them now."""
    from agentstream.recipes.swe.repos import default_envs_dir, default_repos_dir

    return (Path(os.environ.get("AGENTSTREAM_SWE_REPOS") or default_repos_dir()),
            Path(os.environ.get("AGENTSTREAM_SWE_ENVS") or default_envs_dir()))


# cached by what they read, so a process that re-grades with other files or folders never grades
# against the ones of an earlier re-grade
@cache
def _instances(path: str, repos: Path) -> dict:
    from agentstream.recipes.swe.tasks import by_id, load

    return by_id(load(Path(path), repos, check_apply=False))


@cache
def _grader(repos: Path, envs: Path):
    from agentstream.recipes.swe.grader import Grader

    return Grader(repos_dir=repos, envs_dir=envs)


def grade_diff(sample: Sample) -> Reward:
    """Grade the attempt's recorded diff against the instance in AGENTSTREAM_SWE_INSTANCES."""
    path = os.environ.get("AGENTSTREAM_SWE_INSTANCES")
    if not path:
        raise RewardError("set AGENTSTREAM_SWE_INSTANCES to the instances file (with the hidden tests) to grade with")
    diff = sample.diff
    if diff is None:
        raise RewardError(f"task {sample.task.id!r}: the attempt has no rollout.diff event (its harness did not "
                          "post one): nothing to grade")
    repos, envs = _folders()
    instance = _instances(path, repos).get(diff.instance_id)
    if instance is None:
        raise RewardError(f"instance {diff.instance_id!r} is not in {path}")
    result = _grader(repos, envs).grade(instance, diff.diff)
    return Reward(value=result.reward, details={**result.details, "outcome": diff.outcome, "instances": path})

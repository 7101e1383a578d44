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

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from agentstream.recipes.swe.settings import SweSettings, from_environment
from agentstream.schemas.errors import ConfigurationError
from agentstream.schemas.events import Reward
from agentstream.streams.rewards import RewardError, Sample

if TYPE_CHECKING:
    from agentstream.recipes.swe.grader import Grader
    from agentstream.recipes.swe.instance import Instance

REWARD_FN = "recipes.swe.regrade:grade_diff"


# cached by what they read, so a process that re-grades with other files or folders never grades
# against the ones of an earlier re-grade
@cache
def _instances(path: Path, repos: Path) -> dict[str, Instance]:
    from agentstream.recipes.swe.tasks import by_id, load

    return by_id(load(path, repos, check_apply=False))


@cache
def _grader(repos: Path, envs: Path) -> Grader:
    from agentstream.recipes.swe.grader import Grader

    return Grader(repos_dir=repos, envs_dir=envs)


def grade_diff(sample: Sample) -> Reward:
    """Grade the attempt's recorded diff against the instance in AGENTSTREAM_SWE_INSTANCES."""
    try:
        settings = from_environment(SweSettings)  # a reward function named by `replay rebuild` has no other input
    except ConfigurationError as exc:
        raise RewardError(str(exc)) from exc
    path = settings.instances
    if path is None:
        raise RewardError("set AGENTSTREAM_SWE_INSTANCES to the instances file (with the hidden tests) to grade with")
    diff = sample.diff
    if diff is None:
        raise RewardError(f"task {sample.task.id!r}: the attempt has no rollout.diff event (its harness did not "
                          "post one): nothing to grade")
    instance = _instances(path, settings.repos).get(diff.instance_id)
    if instance is None:
        raise RewardError(f"instance {diff.instance_id!r} is not in {path}")
    result = _grader(settings.repos, settings.envs).grade(instance, diff.diff)
    return Reward(value=result.reward, details={**result.details, "outcome": diff.outcome, "instances": str(path)})

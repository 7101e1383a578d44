"""Grading a Harbor task's attempt: the agent's diff onto its environment, then its tests/test.sh, in a fresh sandbox.

As Harbor does, the tests are uploaded only after the agent has finished, and the reward is what test.sh
writes to /logs/verifier/reward.txt (a number) or reward.json (`{"reward": x, …}`, or one number). Here:

1. the environment's commit is checked out into a fresh scratch workspace (host git, on our own repository);
2. the agent's diff is applied there by git inside the sandbox (`git apply`: no hook, no filter, no path
   into .git); a diff that does not apply scores 0;
3. test.sh runs in a second command of the same sandbox, in /workspace (the task's WORKDIR), with the tests
   bound read-only at /tests, the grader's Python with pytest first on PATH, the Dockerfile's ENV and
   [verifier].env, no network, [verifier].timeout_sec as its wall clock. /logs is a read-only folder whose
   `verifier` is a link to a folder of a random name in the workspace, made empty just before test.sh runs:
   nothing the diff carries can be there beforehand (the agent cannot plant a result);
4. the reward file is read by a third command, in which nothing of the agent's runs (background processes
   end with the command that started them).

What remains possible, as in Harbor itself: the agent's code runs while test.sh runs, with the uid that
writes the reward; a test.sh that leaves the reward file unwritten when its tests fail (`set -e`, then
`echo 1 > reward.txt` only on success) lets code under test write one. A test.sh that writes 0 first and
overwrites it with the verdict last does not.
"""

from __future__ import annotations

import json
import math
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentstream.recipes.swe import repos, testrun
from agentstream.recipes.swe.harbor import HarborSpec
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.workspace import GIT, TaskInput, checkout
from agentstream.sandbox import hostfs
from agentstream.sandbox.contract import WORKSPACE_MOUNT, Limits, Network, Sandbox, SandboxSpec
from agentstream.schemas.errors import ServiceError

TESTS_MOUNT = Path("/tests")
LOGS_MOUNT = Path("/logs")
REWARD_FRAME = "@@agentstream-harbor-reward@@"
REWARD_BYTES = 65536
OUTPUT_TAIL = 2000


class HarborGradeError(ServiceError):
    """The task itself is broken (its environment's commit or its test.sh missing): not the agent's fault."""


class _Zero(Exception):
    """This diff scores 0, for the reason given."""


def grade_harbor(instance: Instance, spec: HarborSpec, diff: str, truncated: bool, repos_dir: Path, envs_dir: Path,
                 sandbox: Callable[[SandboxSpec], Sandbox]) -> tuple[float, dict[str, Any]]:
    """(the reward test.sh wrote, details); a diff's failure in any step is reward 0 with the reason."""
    started = time.monotonic()
    repo = repos.repo_path(repos_dir, instance.repo)
    if not repos.has_commit(repo, instance.base_commit):
        raise HarborGradeError(f"{instance.instance_id}: base_commit {instance.base_commit} is not in {repo}: load the "
                         f"Harbor task folder {spec.task_dir} again")
    if not (spec.tests / "test.sh").is_file():
        raise HarborGradeError(f"{instance.instance_id}: {spec.tests / 'test.sh'} is missing")
    env = testrun.ensure_env(envs_dir / repos.slug(instance.repo))
    details: dict[str, Any] = {"instance_id": instance.instance_id, "base_commit": instance.base_commit,
                               "diff_bytes": len(diff.encode(errors="replace")), "timings_s": {}, "refused": [],
                               "flags": [], "findings": [], "flagged": False, "harbor": {"task_dir": spec.task_dir}}
    scratch = Path(tempfile.mkdtemp(prefix="harbor-grade-"))
    try:
        if truncated:
            raise _Zero("the diff was truncated on its way to the log: it cannot be applied whole")
        graded = _grade(instance, spec, diff, repos_dir, env, scratch, details, sandbox)
    except _Zero as zero:
        details.update(resolved=False, error=str(zero))
        graded = 0.0
    except Exception as exc:  # whatever the diff did to the grader, it scores 0 and the service goes on
        details.update(resolved=False, error=f"the grader failed on this diff: {type(exc).__name__}: {exc}"[:800])
        graded = 0.0
    finally:
        if problems := hostfs.remove_tree(scratch):
            details["cleanup_problems"] = problems[:5]
    details.setdefault("applied", False)
    details["timings_s"]["total"] = round(time.monotonic() - started, 3)
    return graded, details


def _grade(instance: Instance, spec: HarborSpec, diff: str, repos_dir: Path, env: Path, scratch: Path,
           details: dict[str, Any], sandbox: Callable[[SandboxSpec], Sandbox]) -> float:
    workspace = scratch / "workspace"
    checkout(TaskInput(instance_id=instance.instance_id, problem_statement="", repo=instance.repo,
                       base_commit=instance.base_commit), workspace, repos_dir)
    patch = f".agentstream-{secrets.token_hex(8)}.diff"
    (workspace / patch).write_bytes(diff.encode(errors="replace"))
    verifier = WORKSPACE_MOUNT / f".agentstream-verifier-{secrets.token_hex(8)}"
    logs = scratch / "logs"
    logs.mkdir()
    (logs / "verifier").symlink_to(verifier)
    box = sandbox(_spec(spec, workspace, env, logs))
    try:
        applied = box.run(f"{GIT} apply --whitespace=nowarn {patch}; status=$?; rm -f {patch}; exit $status"
                          if diff.strip() else f"rm -f {patch}", timeout_s=60)
        if not applied.ok:
            raise _Zero(f"the agent's diff does not apply: {applied.output.strip()[-400:]}")
        details["applied"] = True
        tests = box.run(f"rm -rf {verifier} && mkdir -p {verifier} && exec bash {TESTS_MOUNT / 'test.sh'}",
                        timeout_s=spec.verifier_timeout_s)
        details["timings_s"]["tests"] = round(tests.duration_s, 3)
        details["harbor"].update(test_exit_code=tests.exit_code, limit=tests.limit)
        details["output_tail"] = testrun.scrub(tests.output[-OUTPUT_TAIL:])
        read = box.run(f"for f in reward.txt reward.json; do if [ -f {verifier}/$f ]; then echo {REWARD_FRAME} $f; "
                       f"exec head -c {REWARD_BYTES} {verifier}/$f; fi; done; echo {REWARD_FRAME} none",
                       timeout_s=60)
    finally:
        try:
            box.run(testrun.CLEANUP, timeout_s=60)
        finally:
            box.close()
    name, value = _reward(read.output)
    details["harbor"].update(reward_file=name, rewards=value)
    reward = value.get("reward", 0.0)
    details["resolved"] = reward >= 1.0
    return reward


def _spec(spec: HarborSpec, workspace: Path, env: Path, logs: Path) -> SandboxSpec:
    base = testrun.sandbox_spec(workspace, env, spec.verifier_timeout_s)
    limits = Limits(command_timeout_s=spec.verifier_timeout_s, attempt_timeout_s=spec.verifier_timeout_s + 300)
    path = f"{env.resolve() / 'bin'}:/usr/local/bin:/usr/bin:/bin"
    return SandboxSpec(workspace=workspace, limits=limits, network=Network.NONE,
                       binds=[*base.binds, (spec.tests.resolve(), TESTS_MOUNT), (logs, LOGS_MOUNT)],
                       env={**base.env, **spec.env, **spec.verifier_env, "PATH": path})


def _reward(output: str) -> tuple[str, dict[str, float]]:
    """(the reward file's name, its rewards): reward.txt holds one number; reward.json an object of numbers
    (`reward` is the one trained on; a single other key stands for it)."""
    head, _, text = output.partition("\n")
    if not head.startswith(REWARD_FRAME):
        raise _Zero(f"the reward could not be read: {output[-200:]!r}")
    name = head.removeprefix(REWARD_FRAME).strip()
    if name == "none":
        raise _Zero("test.sh wrote no reward (neither /logs/verifier/reward.txt nor reward.json)")
    try:
        raw: Any = float(text.strip()) if name == "reward.txt" else json.loads(text)
    except ValueError:
        raise _Zero(f"/logs/verifier/{name} is not {'a number' if name == 'reward.txt' else 'JSON'}: "
                    f"{text[:200]!r}") from None
    rewards = {"reward": raw} if not isinstance(raw, dict) else raw
    if "reward" not in rewards and len(rewards) == 1:
        rewards = {"reward": next(iter(rewards.values()))}
    numbers = {str(k): v for k, v in rewards.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "reward" not in numbers or not all(math.isfinite(v) for v in numbers.values()):
        raise _Zero(f"/logs/verifier/{name} has no finite `reward`: {text[:200]!r}")
    return name, {k: float(v) for k, v in numbers.items()}

"""The grader: an instance and the agent's diff in, a reward with its details out. Nothing else is trusted.

Each grading starts again, in a fresh sandbox, from the task's base commit:
  1. the agent's diff, with every change to tests, test configuration, start-up hooks, shadowing
     modules and symlinks stripped and reported (`recipes.swe.diffs`), is applied; a diff that does not
     apply scores 0;
  2. every file the test patch touches is put back as it was at the base commit (or removed, if the
     base had none), then the test patch is applied: the hidden tests arrive only now;
  3. FAIL_TO_PASS and PASS_TO_PASS run under pytest inside the sandbox (no network, a wall-clock limit);
  4. the reward is 1 when every one of them passed, else 0; the details say what ran, what passed,
     what was stripped and how long each step took.

Stripped changes are not punished by themselves (agents legitimately add tests of their own); they
cannot help either, as the tests run as the task wrote them. What a grader of this kind cannot stop:
library code that patches pytest when the tests import it (it runs inside the test process). Added
lines in the agent's source that name pytest or reach into `sys.modules`/`builtins` are flagged as
`suspicious` for review; they do not change the reward.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from schemas.errors import ServiceError
from recipes.swe import diffs, repos, testrun
from recipes.swe.instance import Instance
from sandbox.contract import Sandbox, SandboxSpec

REWARD_FN = "recipes.swe.grader"
DEFAULT_TIMEOUT_S = 120.0
_SUSPICIOUS = re.compile(r"\b(_?pytest|sys\.modules|builtins|__builtins__|sys\.settrace|atexit|os\._exit)\b")


class GradeError(ServiceError):
    """The task itself is broken (its test patch does not apply, its repository is missing): not the agent's fault."""


@dataclass
class GradeResult:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grader:
    repos_dir: Path = field(default_factory=repos.default_repos_dir)
    envs_dir: Path = field(default_factory=repos.default_envs_dir)
    timeout_s: float = DEFAULT_TIMEOUT_S
    sandbox: Callable[[SandboxSpec], Sandbox] = testrun.make_sandbox

    def grade(self, instance: Instance, diff: str, truncated: bool = False) -> GradeResult:
        started = time.monotonic()
        repo = repos.repo_path(self.repos_dir, instance.repo)
        if not repos.has_commit(repo, instance.base_commit):
            raise GradeError(f"{instance.instance_id}: base_commit {instance.base_commit} is not in {repo}")
        env = testrun.ensure_env(self.envs_dir / repos.slug(instance.repo))
        details: dict[str, Any] = {"instance_id": instance.instance_id, "base_commit": instance.base_commit,
                                   "diff_bytes": len(diff.encode()), "timings_s": {}}
        timings = details["timings_s"]
        if truncated:
            return self._zero(details, started, "the diff was truncated on its way to the log: it cannot be applied whole")
        try:
            kept, stripped = diffs.sift(diff)
        except ValueError as exc:
            return self._zero(details, started, f"not a diff: {exc}")
        details["stripped"] = [{"path": s.path, "reason": s.reason} for s in stripped]
        details["flagged"] = bool(stripped)
        details["suspicious"] = suspicious_lines(kept)
        with tempfile.TemporaryDirectory(prefix="swe-grade-") as scratch:
            workspace = Path(scratch) / "workspace"
            repos.checkout(repo, instance.base_commit, workspace)
            timings["checkout"] = round(time.monotonic() - started, 3)
            mark = time.monotonic()
            if kept.strip() and (error := apply(workspace, kept)):
                return self._zero(details, started, f"the agent's diff does not apply: {error}")
            restore(repo, instance.base_commit, workspace, diffs.touched(instance.test_patch))
            if error := apply(workspace, instance.test_patch):
                raise GradeError(f"{instance.instance_id}: the test patch does not apply: {error}")
            timings["apply"] = round(time.monotonic() - mark, 3)
            result = self.run_tests(workspace, env, [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS])
        timings["tests"] = round(result.duration_s, 3)
        statuses = testrun.parse_pytest_log(result.output)
        f2p, p2p = _count(statuses, instance.FAIL_TO_PASS), _count(statuses, instance.PASS_TO_PASS)
        resolved = f2p["passed"] == f2p["total"] and p2p["passed"] == p2p["total"]
        details.update(
            resolved=resolved, fail_to_pass=f2p, pass_to_pass=p2p, applied=True,
            ran={"command": testrun.pytest_command(env) + " <test ids>", "exit_code": result.exit_code, "limit": result.limit,
                 "tests": len(instance.FAIL_TO_PASS) + len(instance.PASS_TO_PASS)},
            output_tail=testrun.scrub(result.output[-2000:]) if not resolved else "",
        )
        timings["total"] = round(time.monotonic() - started, 3)
        return GradeResult(1.0 if resolved else 0.0, details)

    def run_tests(self, workspace: Path, env: Path, test_ids: list[str]):
        with self.sandbox(testrun.sandbox_spec(workspace, env, self.timeout_s)) as box:
            return box.run(testrun.pytest_command(env, test_ids), timeout_s=self.timeout_s)

    @staticmethod
    def _zero(details: dict[str, Any], started: float, error: str) -> GradeResult:
        details.update(resolved=False, applied=False, error=error)
        details["timings_s"]["total"] = round(time.monotonic() - started, 3)
        return GradeResult(0.0, details)


def _count(statuses: dict[str, str], ids: list[str]) -> dict[str, Any]:
    failed = [test for test in ids if statuses.get(test) not in testrun.PASSING]
    return {"total": len(ids), "passed": len(ids) - len(failed),
            "failed": {test: statuses.get(test, "NOT RUN") for test in failed[:50]}}


def apply(workspace: Path, patch: str) -> str | None:
    """Why `patch` does not apply in `workspace` (nothing is changed then), or None once applied."""
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(workspace.parent), "GIT_CONFIG_NOSYSTEM": "1"}
    done = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=workspace, input=patch.encode(),
                          capture_output=True, env=env)
    if done.returncode:
        return done.stderr.decode(errors="replace").strip()[:500] or "git apply failed"
    return None


def restore(repo: Path, commit: str, workspace: Path, paths: set[str]) -> None:
    """Put `paths` back as they are at `commit`; remove those it does not have."""
    for path in sorted(paths):
        target = workspace / path
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)
        shown = repos.git(repo, "show", f"{commit}:{path}", check=False)
        if shown.returncode == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(shown.stdout)


def suspicious_lines(patch: str) -> list[dict[str, str]]:
    found = []
    for part in diffs.split(patch) if patch.strip() else []:
        for line in part.text.splitlines():
            if line.startswith("+") and not line.startswith("+++") and _SUSPICIOUS.search(line):
                found.append({"path": part.path, "line": line[1:].strip()[:200]})
    return found[:20]

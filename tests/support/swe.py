"""What the SWE tests share: a one-file task with a bug (calc: add() subtracts), and a small toolz task
set, built once per test session (real sandbox); the controller and the grader service as processes.

The toolz sdist and the test venv live in the real AGENTSTREAM_HOME (cached like the Kafka jars); the
repositories the build writes go to a fresh folder of this session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from agentstream.recipes.swe import repos
from agentstream.recipes.swe.build import Built, build
from agentstream.recipes.swe.instance import Instance
from agentstream.stack.process import spawn
from tests.support.gateway import TOKEN_SECRET
from tests.support.streams import REPO
from tests.support.wait import wait_for_async

LIMIT = 2


@cache
def built() -> tuple[Built, Path]:
    repos_dir = Path(tempfile.mkdtemp(prefix="swe-repos-"))
    return build(limit=LIMIT, seed=0, repos_dir=repos_dir, workers=2), repos_dir


# --- calc: one file, one bug --------------------------------------------------------------------

BUGGY = "def add(a, b):\n    return a - b\n"
HONEST = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n+    return a + b\n"
"""the fix, as a diff"""


def make_repo(repos: Path, name: str = "demo/calc") -> str:
    """The buggy repository as a git checkout under the repos dir (`owner__repo`); its base commit."""
    repo = repos / name.replace("/", "__")
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text(BUGGY)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


SHORT_CONFIG = """\
agent:
  system_template: "One command per answer."
  instance_template: "{{task}}"
model:
  model_class: litellm_textbased
  observation_template: "{{output.returncode}} {{output.output[:300]}}"
  format_error_template: "One block."
"""
"""prompts short enough for the tiny model's context (2,048 characters) over the three answers"""


def hidden_tests(*checks: str) -> str:
    """A test file asserting `checks`, as the diff that adds it (an instance's test_patch)."""
    body = "from calc import add\n\n\ndef test_add():\n" + "".join(f"    assert {c}\n" for c in checks)
    lines = body.splitlines(keepends=True)
    return (f"--- /dev/null\n+++ b/tests/test_calc.py\n@@ -0,0 +1,{len(lines)} @@\n"
            + "".join("+" + line for line in lines))


def calc_instance(commit: str, *checks: str, repo: str = "demo/calc") -> Instance:
    """The task instance "calc-1" whose hidden tests assert `checks`."""
    return Instance(instance_id="calc-1", repo=repo, base_commit=commit, problem_statement="add() subtracts",
                    patch=HONEST, test_patch=hidden_tests(*checks), FAIL_TO_PASS=["tests/test_calc.py::test_add"],
                    PASS_TO_PASS=[])


# --- the controller and the grader service, as processes -----------------------------------------


def run_controller(kafka, gateway_url: str, tasks: Path, logs: Path, env: dict[str, str],
                   *extra: str, agent: str = f"{sys.executable} -m agentstream.recipes.swe.harness") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "agentstream.controller", "--bootstrap-servers", kafka.bootstrap_servers,
           "--topic-prefix", kafka.topic_prefix, "--tasks", str(tasks),
           "--agent", agent, "--gateway-url", gateway_url,
           "--token-secret", TOKEN_SECRET, "--model", "tiny", "--no-progress", "--max-attempts", "1",
           "--timeout-s", "420", "--logs-dir", str(logs), *extra]
    return spawn(cmd, logs / "controller.log", env={**os.environ, **env}, cwd=REPO)


def grader_process(kafka, instances: Path, repos: Path, envs: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "agentstream.recipes.swe.grade_service", "--bootstrap-servers", kafka.bootstrap_servers,
           "--topic-prefix", kafka.topic_prefix, "--tasks", str(instances), "--repos-dir", str(repos),
           "--envs-dir", str(envs)]
    return spawn(cmd, log, cwd=REPO)


async def await_exit(process: subprocess.Popen, timeout: float = 240) -> int:
    """Without blocking the loop: the gateway serving the harness runs in it."""
    await wait_for_async(lambda: process.poll() is not None, timeout=timeout, what="the controller to finish its run")
    return process.returncode


# --- an agent's diff taken by the host, its git directory outside the workspace -------------------
# (the harnesses take theirs inside the sandbox, workspace.final_diff; the grader's tests need a diff
# of what a command did without a harness; nothing the command writes, hooks, `core.fsmonitor`, a
# `.git` of its own, runs when the host takes it, and every git config but the repository's is ignored)

_SAFE = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-c", "safe.directory=*",
         "-c", "core.autocrlf=false", "-c", "diff.external=", "-c", "core.attributesFile=/dev/null")


def prepare_workspace(repo: Path, commit: str, workspace: Path, git_dir: Path) -> None:
    """Check `commit` out into `workspace` and record it in `git_dir` (outside the workspace)."""
    repos.checkout(repo, commit, workspace)
    _outside_git(workspace, git_dir, "init", "-q")
    _outside_git(workspace, git_dir, "add", "-A")
    _outside_git(workspace, git_dir, "commit", "-q", "--no-verify", "-m", f"base {commit}")


def workspace_diff(workspace: Path, git_dir: Path) -> str:
    """Everything changed, added or removed in `workspace`, as one git diff."""
    _outside_git(workspace, git_dir, "add", "-A")
    return _outside_git(workspace, git_dir, "diff", "--cached", "--no-color", "--no-ext-diff", "--binary",
                        "HEAD").stdout.decode()


def _outside_git(workspace: Path, git_dir: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(git_dir), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(workspace), **repos.FIXED}
    done = subprocess.run(["git", *_SAFE, *args], cwd=git_dir.parent, capture_output=True, env=env)
    if done.returncode:
        raise repos.RepoError(f"git {args[0]}: {done.stderr.decode(errors='replace').strip()}")
    return done

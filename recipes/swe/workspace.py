"""An agent's workspace for a task, and the diff of what the agent did in it.

The workspace is a plain checkout of the base commit (no history: the agent cannot see the gold or
the hidden tests in it). Its git directory lives *outside* the workspace, so nothing the agent writes
(hooks, `core.fsmonitor`, a `.git` of its own) runs when the host takes the diff; the diff covers new
files too (`git add -A` against the base tree), and every git config but the repository's own is ignored.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from recipes.swe import repos

_SAFE = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-c", "safe.directory=*",
         "-c", "core.autocrlf=false", "-c", "diff.external=", "-c", "core.attributesFile=/dev/null")


def prepare(repo: Path, commit: str, workspace: Path, git_dir: Path) -> None:
    """Check `commit` out into `workspace` and record it in `git_dir` (outside the workspace)."""
    repos.checkout(repo, commit, workspace)
    _git(workspace, git_dir, "init", "-q")
    _git(workspace, git_dir, "add", "-A")
    _git(workspace, git_dir, "commit", "-q", "--no-verify", "-m", f"base {commit}")


def diff(workspace: Path, git_dir: Path) -> str:
    """Everything the agent changed, added or removed in `workspace`, as one git diff."""
    _git(workspace, git_dir, "add", "-A")
    return _git(workspace, git_dir, "diff", "--cached", "--no-color", "--no-ext-diff", "--binary", "HEAD").stdout.decode()


def _git(workspace: Path, git_dir: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(git_dir), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(workspace), **repos.FIXED}
    done = subprocess.run(["git", *_SAFE, *args], cwd=git_dir.parent, capture_output=True, env=env)
    if done.returncode:
        raise repos.RepoError(f"git {args[0]}: {done.stderr.decode(errors='replace').strip()}")
    return done

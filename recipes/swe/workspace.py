"""An attempt's workspace: the task's repository at its base commit in, the agent's final diff out.

The task input the controller hands the agent (`TaskInput`) holds what an agent may know: the
instance id, the repository, the base commit, the problem statement. Repositories are local git
repositories (the task builder writes them; on a cluster they are baked into per-repo images), found
by name under `AGENTSTREAM_SWE_REPOS` (default `$AGENTSTREAM_HOME/swe/repos`), as `owner__name`.

The diff is taken inside the sandbox, not by the host's git: the agent owns `.git` (config, hooks,
attributes with filters) and a host git reading it would run what the agent planted. It is written
to a file of a random name the agent cannot know in advance and read with O_NOFOLLOW, so a planted
symlink cannot make the harness read a host file.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentstream.settings import agentstream_home
from recipes.swe.instance import Instance
from sandbox.contract import Sandbox

GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.quotepath=off"


class TaskInput(BaseModel):
    """`task.input` of a coding rollout: everything the agent is told, nothing it must not see."""

    model_config = ConfigDict(extra="forbid")
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str

    @classmethod
    def of(cls, instance: Instance) -> TaskInput:
        return cls(instance_id=instance.instance_id, repo=instance.repo, base_commit=instance.base_commit,
                   problem_statement=instance.problem_statement)


class WorkspaceError(RuntimeError):
    """The task's repository or commit cannot be checked out; the message names the fix."""


def repos_dir() -> Path:
    return Path(os.environ.get("AGENTSTREAM_SWE_REPOS") or agentstream_home() / "swe" / "repos")


def repo_source(repo: str) -> Path:
    """The local git repository of `repo` ('owner/name' or a path)."""
    if Path(repo).is_absolute():
        return Path(repo)
    return repos_dir() / repo.replace("/", "__")


def checkout(task: TaskInput, workspace: Path) -> None:
    """A fresh clone of the task's repository at its base commit (trusted: the agent has not run yet)."""
    source = repo_source(task.repo)
    if not (source / ".git").exists() and not (source / "HEAD").exists():
        raise WorkspaceError(f"no git repository for {task.repo!r} at {source}: build the tasks with "
                             "`agentstream tasks swe build`, or set AGENTSTREAM_SWE_REPOS to where the repositories are")
    _git(["clone", "--quiet", "--no-checkout", str(source), str(workspace)])
    _git(["-C", str(workspace), "checkout", "--quiet", "--detach", task.base_commit])
    _git(["-C", str(workspace), "remote", "remove", "origin"])  # the agent sees one commit's tree, no source path


def _git(args: list[str]) -> None:
    result = subprocess.run(["git", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args)} failed: {result.stderr.strip()}")


def final_diff(sandbox: Sandbox, base_commit: str) -> tuple[str, dict[str, Any]]:
    """The workspace against `base_commit`, new files included, binary files left out; and notes on it."""
    details: dict[str, Any] = {}
    staged = sandbox.run(f"{GIT} add -A . && {GIT} diff --cached --numstat {base_commit}", timeout_s=60)
    if not staged.ok:
        details["diff_error"] = f"git failed in the workspace: {staged.output[-500:]}"
        return "", details
    binary = [line.split("\t", 2)[2] for line in staged.output.splitlines() if line.startswith("-\t-\t")]
    excludes = " ".join(_quote(f":(exclude,literal){path}") for path in binary)
    name = f".agentstream-{secrets.token_hex(8)}.diff"
    result = sandbox.run(f"{GIT} diff --cached --no-color --no-ext-diff --no-textconv {base_commit} -- . {excludes}"
                         f" > {name}", timeout_s=60)
    try:
        if not result.ok:
            details["diff_error"] = f"git diff failed in the workspace: {result.output[-500:]}"
            return "", details
        if binary:
            details["binary_files_left_out"] = binary
        return _read_own_file(sandbox.spec.workspace, name), details
    finally:
        _remove_own_file(sandbox.spec.workspace, name)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _remove_own_file(workspace: Path, name: str) -> None:
    try:
        directory = _open_dir(workspace)
    except OSError:
        return
    try:
        os.unlink(name, dir_fd=directory)
    except OSError:
        pass
    finally:
        os.close(directory)


def _read_own_file(workspace: Path, name: str) -> str:
    directory = _open_dir(workspace)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
    finally:
        os.close(directory)
    with os.fdopen(fd, "rb") as diff:
        return diff.read().decode("utf-8", "replace")

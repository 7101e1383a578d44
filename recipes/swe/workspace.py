"""An attempt's workspace: the task's repository at its base commit in, the agent's final diff out.

The task input the controller hands the agent (`TaskInput`) holds what an agent may know: the
instance id and the problem statement (and, optionally, the repository and base commit; else they
are looked up by instance id in a public index, `AGENTSTREAM_SWE_INDEX`, which holds nothing else).
Repositories are local git repositories (the task builder writes them; on a cluster they are baked
into per-repo images), found by name under the repositories folder (`AGENTSTREAM_SWE_REPOS`, default
`$AGENTSTREAM_HOME/swe/repos`; `recipes.swe.settings`), as `owner__name`.

The workspace holds the base commit's tree and no history (the commits after it, or a bug-injecting
commit's parent, would give the answer away): a fresh repository with that tree as its one commit,
so the agent's `git diff` and `git status` work as usual.

The diff is taken inside the sandbox, not by the host's git: the agent owns `.git` (config, hooks,
attributes with filters) and a host git reading it would run what the agent planted. It is written
to a file of a random name the agent cannot know in advance and read with O_NOFOLLOW, so a planted
symlink cannot make the harness read a host file.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentstream.recipes.swe.instance import Instance
from agentstream.sandbox.contract import Sandbox
from agentstream.schemas.errors import ServiceError

GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.quotepath=off"


class TaskInput(BaseModel):
    """`task.input` of a coding rollout: everything the agent is told, nothing it must not see."""

    model_config = ConfigDict(extra="forbid")
    instance_id: str
    problem_statement: str
    repo: str | None = None
    base_commit: str | None = None

    @classmethod
    def of(cls, instance: Instance) -> TaskInput:
        return cls(instance_id=instance.instance_id, problem_statement=instance.problem_statement)

    def located(self, index: Path | None) -> TaskInput:
        """With repo and base commit, from the public `index` when the input does not carry them."""
        if self.repo and self.base_commit:
            return self
        if not index:
            raise WorkspaceError(f"task {self.instance_id!r} names no repository: set AGENTSTREAM_SWE_INDEX to the "
                                 "public index of the tasks (instance_id, repo, base_commit; see write_index)")
        for line in index.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("instance_id") == self.instance_id:
                return self.model_copy(update={"repo": row["repo"], "base_commit": row["base_commit"]})
        raise WorkspaceError(f"task {self.instance_id!r} is not in the index {index}")


def write_index(instances: list[Instance], path: Path) -> Path:
    """The public index of a task set: where each instance's code is, and nothing of its answer or tests."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"instance_id": i.instance_id, "repo": i.repo, "base_commit": i.base_commit})
                            + "\n" for i in instances))
    return path


class WorkspaceError(ServiceError):
    """The task's repository or commit cannot be checked out; the message names the fix."""


def repo_source(repo: str, repos_dir: Path) -> Path:
    """The local git repository of `repo` ('owner/name' or a path)."""
    if Path(repo).is_absolute():
        return Path(repo)
    return repos_dir / repo.replace("/", "__")


def checkout(task: TaskInput, workspace: Path, repos_dir: Path) -> str:
    """The base commit's tree as the one commit of a fresh repository in `workspace`; returns that commit.

    Trusted: the agent has not run yet, and the source repository (under `repos_dir`) is ours.
    """
    source = repo_source(task.repo or "", repos_dir)
    if not (source / ".git").exists() and not (source / "HEAD").exists():
        raise WorkspaceError(f"no git repository for {task.repo!r} at {source}: build the tasks with "
                             "`agentstream tasks swe build`, or set AGENTSTREAM_SWE_REPOS to where the repositories are")
    archive = _git(["-C", str(source), "archive", "--format=tar", f"{task.base_commit}^{{tree}}"])
    workspace.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(workspace, filter="data")
    _git(["-C", str(workspace), "init", "--quiet"])
    _git(["-C", str(workspace), "add", "-A"])
    _git(["-C", str(workspace), "commit", "--quiet", "--no-verify", "-m", f"{task.instance_id} at {task.base_commit}"])
    return _git(["-C", str(workspace), "rev-parse", "HEAD"]).decode().strip()


_GIT_ENV = {"GIT_AUTHOR_NAME": "agentstream", "GIT_AUTHOR_EMAIL": "tasks@agentstream.invalid",
            "GIT_COMMITTER_NAME": "agentstream", "GIT_COMMITTER_EMAIL": "tasks@agentstream.invalid",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null"}


def _git(args: list[str]) -> bytes:
    result = subprocess.run(["git", *args], capture_output=True, env={**os.environ, **_GIT_ENV})
    if result.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args)} failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def test_env_binds(task: TaskInput, envs_dir: Path) -> tuple[list[tuple[str, str]], str | None]:
    """The task's test environment (the grader's venv with pytest, under `envs_dir`), read-only, and its
    bin folder for PATH."""
    env = envs_dir / (task.repo or "").replace("/", "__")
    if not (env / ".agentstream-ready").exists():
        return [], None
    try:
        from agentstream.sandbox.local import python_binds

        binds = list(python_binds(env))
    except ImportError:
        binds = [(env.resolve(), env.resolve())]
    return [(str(host), str(inside)) for host, inside in binds], str(env.resolve() / "bin")


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


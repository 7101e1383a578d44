"""The harness's workspace and environment on real bubblewrap: the agent sees the base tree and no history,
its commands run in the sandbox as mini-swe-agent expects, and the final diff (new files in, binary files
out) is taken so that nothing the agent planted runs or is read on the host."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agentstream.recipes.swe.environment import SandboxEnvironment
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.workspace import TaskInput, WorkspaceError, checkout, final_diff, write_index

pytestmark = pytest.mark.timeout(120)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> tuple[Path, str]:
    """owner/calc with a fix in its history and the bug as its last commit: the agent must not see the fix."""
    repos = tmp_path / "repos"
    source = repos / "owner__calc"
    source.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(source)], check=True)
    (source / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    git(source, "add", ".")
    git(source, "commit", "-qm", "the right code")
    (source / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git(source, "commit", "-qam", "inject the bug")
    return source, git(source, "rev-parse", "HEAD")


def environment(workspace: Path) -> SandboxEnvironment:
    return SandboxEnvironment(workspace=str(workspace), timeout=20, attempt_timeout=120)


def test_the_agent_sees_the_base_tree_without_history_and_its_diff_has_new_files_not_binary(repo, tmp_path):
    _, commit = repo
    workspace = tmp_path / "ws"
    baseline = checkout(TaskInput(instance_id="calc-1", problem_statement="p", repo="owner/calc", base_commit=commit),
                        workspace, tmp_path / "repos")
    env = environment(workspace)
    try:
        log = env.execute({"command": "git log --oneline | wc -l && git log -p | grep -c 'a + b' || true"})
        assert log["returncode"] == 0 and log["output"].split() == ["1", "0"], log  # one commit, the fix nowhere
        assert env.execute({"command": "cat calc.py"})["output"] == "def add(a, b):\n    return a - b\n"
        edit = env.execute({"command": "sed -i 's/a - b/a + b/' calc.py && mkdir -p pkg && echo 'X = 1' > pkg/new.py"
                                       " && printf '\\x00\\x01\\x02' > blob.bin && git add calc.py && git commit -qm mine"})
        assert edit["returncode"] == 0, edit
        assert env.execute({"command": "pwd"})["output"].strip() == "/workspace"
        diff, details = final_diff(env.sandbox, baseline)
    finally:
        env.close()
    assert "-    return a - b\n+    return a + b" in diff, "a change the agent committed is still in the diff"
    assert "+++ b/pkg/new.py" in diff and "+X = 1" in diff, "new files are in the diff"
    assert "blob.bin" not in diff and details["binary_files_left_out"] == ["blob.bin"]
    assert not list(workspace.glob(".agentstream-*.diff")), "the diff file is removed"


def test_nothing_the_agent_plants_in_git_runs_or_is_read_on_the_host(repo, tmp_path):
    _, commit = repo
    workspace = tmp_path / "ws"
    canary = tmp_path / "host-canary"
    secret = tmp_path / "host-secret"
    secret.write_text("TOP SECRET")
    baseline = checkout(TaskInput(instance_id="calc-1", problem_statement="p", repo="owner/calc", base_commit=commit),
                        workspace, tmp_path / "repos")
    env = environment(workspace)
    try:
        # a filter and an fsmonitor that would run on a host git, hooks, and symlinks to host files
        planted = env.execute({"command": (
            f"git config core.fsmonitor 'touch {canary}' && git config filter.x.clean 'touch {canary}; cat' && "
            f"echo '* filter=x' > .gitattributes && mkdir -p .git/hooks && "
            f"printf '#!/bin/sh\\ntouch {canary}\\n' > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit && "
            f"ln -s {secret} leak.txt && for n in $(seq 0 50); do ln -sf {secret} .agentstream-$n.diff; done && "
            "echo 'y = 2' >> calc.py")})
        assert planted["returncode"] == 0, planted
        diff, _ = final_diff(env.sandbox, baseline)
    finally:
        env.close()
    assert not canary.exists(), "a command the agent planted ran on the host"
    assert "TOP SECRET" not in diff, "the harness read a host file through a symlink"
    assert "+y = 2" in diff and "+++ b/leak.txt" in diff  # the symlink itself is part of the diff, as a link


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_a_command_past_its_limit_is_reported_to_the_agent_not_raised(repo, tmp_path):
    _, commit = repo
    workspace = tmp_path / "ws"
    checkout(TaskInput(instance_id="calc-1", problem_statement="p", repo="owner/calc", base_commit=commit), workspace,
             tmp_path / "repos")
    env = SandboxEnvironment(workspace=str(workspace), timeout=2, attempt_timeout=120)
    try:
        slow = env.execute({"command": "sleep 30"})
        submitted = None
        try:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
        except Exception as exc:  # mini-swe-agent's Submitted ends the run
            submitted = type(exc).__name__
    finally:
        env.close()
    assert slow["returncode"] != 0 and "command timeout" in slow["exception_info"], slow
    assert env.limits_hit == {"command_timeout": 1} and submitted == "Submitted"


def test_the_public_index_locates_a_task_and_holds_no_answer(repo, tmp_path):
    _, commit = repo
    instance = Instance(instance_id="calc-1", repo="owner/calc", base_commit=commit, problem_statement="p",
                        patch="SECRET-PATCH", test_patch="SECRET-TESTS", FAIL_TO_PASS=["t"], PASS_TO_PASS=[])
    index = write_index([instance], tmp_path / "index.jsonl")
    assert "SECRET" not in index.read_text()
    located = TaskInput.of(instance).located(index)
    assert (located.repo, located.base_commit) == ("owner/calc", commit)
    assert TaskInput.of(instance).model_dump(exclude_none=True) == {"instance_id": "calc-1", "problem_statement": "p"}
    with pytest.raises(WorkspaceError, match="not in the index"):
        TaskInput(instance_id="other", problem_statement="p").located(index)
    with pytest.raises(WorkspaceError, match="AGENTSTREAM_SWE_INDEX"):
        TaskInput(instance_id="other", problem_statement="p").located(None)

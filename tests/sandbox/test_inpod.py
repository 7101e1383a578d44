"""The in-pod backend (`sandbox.inpod`): what it still enforces per command when the pod is the sandbox.

Run here as plain processes (as a pod's harness runs them): the harness's variables stay out, a
command's background processes end with it, the wall clocks and rlimits hold, /workspace paths map
onto the workspace. The pod's own isolation is tests/recipes/test_swe_kubernetes.py's.

And the attack the pod's isolation cannot stop: a command runs as the harness's uid and goes after the
attempt's token in the harness (its environ, its memory, ptrace) and in any process above it. Run for
real as an unprivileged uid (the pod runs as one; root reads everything), with the system Python (the
venv's interpreter lives under /root, which that uid cannot enter) and the venv's packages.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from agentstream.sandbox import hostfs
from agentstream.sandbox.contract import Limits, SandboxSpec
from agentstream.sandbox.inpod import InPodSandbox
from agentstream.sandbox.kubernetes import agent_command

REPO = Path(__file__).resolve().parents[2]
AGENTS = REPO / "tests" / "sandbox" / "agents"
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_commands_get_only_the_sandbox_env_and_end_with_their_limits(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "the-harness-token")
    (tmp_path / "src").mkdir()
    spec = SandboxSpec(workspace=tmp_path, env={"GIT_AUTHOR_NAME": "agent"},
                       limits=Limits(command_timeout_s=1.0, attempt_timeout_s=30, file_size_bytes=1 << 20))
    with InPodSandbox(spec) as box:
        seen = box.run("env; pwd")
        assert seen.ok and "the-harness-token" not in seen.output and "GIT_AUTHOR_NAME=agent" in seen.output
        assert box.run("pwd", cwd="/workspace/src").output.strip() == str(tmp_path / "src")

        marker = tmp_path / "late"
        began = time.monotonic()
        slow = box.run(f"(sleep 3; touch {marker}) & sleep 30")
        assert slow.limit == "command_timeout" and slow.exit_code == -9 and time.monotonic() - began < 10
        left = box.run(f"(sleep 1.5; touch {marker}) &")  # a background child: it ends with its command
        assert left.ok
        time.sleep(2.5)  # past the moment the killed children would have written the marker
        assert not marker.exists()

        big = box.run("head -c 2000000 /dev/zero > big")
        assert big.limit == "file_size" and os.path.getsize(tmp_path / "big") <= 1 << 20

    spent = InPodSandbox(SandboxSpec(workspace=tmp_path, limits=Limits(attempt_timeout_s=0.5)))
    time.sleep(0.6)
    assert spent.run("true").limit == "attempt_timeout"


@pytest.fixture
def pod_workspace():
    """An empty workspace owned by the unprivileged uid the harness will run as."""
    if os.geteuid() != 0:
        pytest.skip("running the harness as another, unprivileged uid needs root")
    version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True).stdout.strip() if Path(SYSTEM_PYTHON).exists() else None
    if version != str(sys.version_info[:2]):
        pytest.skip(f"{SYSTEM_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}: it cannot load "
                    "the venv's packages (Debian: apt-get install python3)")
    folder = Path(tempfile.mkdtemp(prefix="inpod-attack-"))
    os.chown(folder, NOBODY, NOBODY)
    yield folder
    hostfs.remove_tree(folder)  # what the attacks wrote: no link followed, no recursion


def as_pod_user(argv: list[str], workspace: Path, token: str) -> subprocess.CompletedProcess[str]:
    """`argv` exec'd as an unprivileged uid with a pod's environment: the attempt's token in it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workspace), "AGENTSTREAM_SANDBOX": "pod", "OPENAI_API_KEY": token,
           "PYTHONPATH": f"{REPO}:{sysconfig.get_paths()['purelib']}"}
    return subprocess.run(argv, user=NOBODY, group=NOBODY, extra_groups=[], env=env, cwd=workspace,
                          capture_output=True, text=True, timeout=60)


def harness(workspace: Path, command: str, *flags: str) -> list[str]:
    return [SYSTEM_PYTHON, str(AGENTS / "inpod_harness.py"), str(workspace), command, *flags]


def attacked(run: subprocess.CompletedProcess[str]) -> tuple[int, dict]:
    """(the harness's pid, the thief's report)"""
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["exit_code"] == 0, result["output"]
    return result["pid"], json.loads(result["output"])


def test_a_command_cannot_steal_the_token_from_its_harness(pod_workspace: Path):
    token = f"rollout-token-{secrets.token_hex(12)}"
    thief = f"{SYSTEM_PYTHON} {AGENTS / 'token_thief.py'}"

    # the control: a harness that does not harden itself gives the token away three ways
    pid, report = attacked(as_pod_user(harness(pod_workspace, thief, "--unhardened"), pod_workspace, token))
    assert [f"/proc/{pid}/environ", token] in report["found"] and [f"/proc/{pid}/mem", token] in report["found"]
    assert report["tried"][str(pid)]["ptrace"] == "attached"

    # the harness as the controller's Job starts it (`/bin/sh -c CMD`, exec'd): the same thief finds nothing
    job_command = agent_command(shlex.join(harness(pod_workspace, thief)))
    assert job_command[2].startswith("exec "), "a one-command agent must replace the pod's shell"
    run = as_pod_user(job_command, pod_workspace, token)
    pid, report = attacked(run)
    assert token not in run.stdout + run.stderr
    assert report["found"] == [] and report["self_environ"], report  # /proc itself worked for what is its own
    tried = report["tried"][str(pid)]
    assert tried == {"environ": f"denied: [Errno 13] Permission denied: '/proc/{pid}/environ'",
                     "mem": f"denied: [Errno 13] Permission denied: '/proc/{pid}/mem'",
                     "ptrace": "denied: [Errno 1] Operation not permitted"}
    leftovers = [path for path in pod_workspace.rglob("*") if path.is_file() and token in path.read_text(errors="ignore")]
    assert leftovers == []


def test_the_harness_refuses_to_run_commands_under_a_wrapper_that_holds_its_token(pod_workspace: Path):
    token = f"rollout-token-{secrets.token_hex(12)}"
    compound = f"cd {shlex.quote(str(pod_workspace))} && {shlex.join(harness(pod_workspace, 'true'))}"
    job_command = agent_command(compound)
    assert job_command == ["/bin/sh", "-c", compound], "a compound command cannot be exec'd: its shell stays"
    run = as_pod_user(job_command, pod_workspace, token)
    assert run.returncode == 3, run.stdout + run.stderr
    refused = json.loads(run.stdout)["refused"]
    assert "an ancestor of this harness" in refused and "exec" in refused and token not in refused

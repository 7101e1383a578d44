"""The in-pod backend (`sandbox.inpod`): what it still enforces per command when the pod is the sandbox.

Run here as plain processes (as a pod's harness runs them): the harness's variables stay out, a
command's background processes end with it, the wall clocks and rlimits hold, /workspace paths map
onto the workspace. The pod's own isolation is tests/test_swe_kubernetes.py's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sandbox.contract import Limits, SandboxSpec
from sandbox.inpod import InPodSandbox


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

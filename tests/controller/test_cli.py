"""`agentstream run` and `python -m agentstream.controller`: flags, errors, the live progress display."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from agentstream.controller.controller import Controller
from agentstream.controller.progress import live_progress
from tests.support.controller import SECRET, agent_command, controller_settings, read_rollouts, write_tasks


def agentstream(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentstream", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "AGENTSTREAM_TOKEN_SECRET": SECRET, **(env or {})})


def test_run_help_lists_the_flags():
    for result in (agentstream("run", "--help"),
                   subprocess.run([sys.executable, "-m", "agentstream.controller", "--help"], capture_output=True, text=True)):
        assert result.returncode == 0, result.stderr
        for flag in ("--tasks", "--agent", "--samples", "--concurrency", "--backend", "--max-staleness",
                     "--k8s-job-template", "--run-id"):
            assert flag in result.stdout


def test_run_reports_bad_input_with_the_fix(tmp_path: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "input": 1}\n{"id": "b"}\n')
    env = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9"}
    result = agentstream("run", "--tasks", str(bad), "--agent", "true", env=env)
    assert result.returncode == 2 and "bad.jsonl: line 2: task 'b' has no input" in result.stderr
    result = agentstream("run", "--tasks", str(bad), "--agent", "true", "--samples", "0", env=env)
    assert result.returncode == 2 and "samples" in result.stderr
    no_secret = agentstream("run", "--tasks", str(bad), "--agent", "true", env={**env, "AGENTSTREAM_TOKEN_SECRET": ""})
    assert no_secret.returncode == 2 and "AGENTSTREAM_TOKEN_SECRET" in no_secret.stderr


async def test_agentstream_run_runs_a_task_file(kafka, tmp_path: Path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": f"t{i}", "input": {"mode": "ok"}} for i in range(2)])
    result = agentstream("run", "--tasks", str(tasks), "--agent", agent_command(tmp_path), "--samples", "2",
                         "--concurrency", "2", "--backend", "local", "--topic-prefix", kafka.topic_prefix,
                         "--logs-dir", str(tmp_path / "logs"), env={"KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers})
    assert result.returncode == 0, result.stderr
    assert "4 of 4 rollouts finished, 0 given up" in result.stderr
    assert sum(e.type == "rollout.finished" for e in await read_rollouts(kafka)) == 4


async def test_progress_display_shows_the_counts(kafka, tmp_path: Path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "ok", "input": {"mode": "ok"}},
                                                   {"id": "bad", "input": {"mode": "fail"}}])
    controller = Controller(controller_settings(kafka, tasks, tmp_path, max_attempts=2))
    screen = io.StringIO()
    async with live_progress(controller, Console(file=screen, force_terminal=True, width=240)):
        await controller.run()
    last = [line for line in screen.getvalue().splitlines() if "queued" in line][-1]  # the final frame
    for part in ("2/2", "0 queued", "0 running", "1 done", "1 failed", "1 retried", "/min", "base weights"):
        assert part in last, (part, last)

"""The example agents in examples/, as ordinary programs: only the environment tells them where to go.

They run against the real vLLM server with the tiny model (which answers with near-random bytes),
straight at its /v1 (the gateway is another service). The reward endpoint here is a small
recording HTTP server standing in for the gateway's `POST /rollouts/{id}/reward`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agentstream.stack.process import free_port

EXAMPLES = Path(__file__).parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from calculator_agent import CalculatorError, calculate  # noqa: E402


class RewardSink(ThreadingHTTPServer):
    """Answers every POST with `status` and keeps (path, Authorization, JSON body)."""

    def __init__(self, status: int = 200):
        self.status = status
        self.posts: list[tuple[str, str, dict]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                sink.posts.append((self.path, self.headers.get("Authorization"), body))
                payload = b'{"ok": true}' if sink.status == 200 else b'{"error": {"message": "down", "type": "x", "code": null}}'
                self.send_response(sink.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def run_agent(script: str, task, tmp_path: Path, base_url: str, reward_url: str = "http://127.0.0.1:9/none",
              model: str | None = "tiny", **extra: str) -> subprocess.CompletedProcess:
    task_file = tmp_path / f"{script}.task.json"
    task_file.write_text(json.dumps(task))
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "ast1.example-token",
           "AGENTSTREAM_ROLLOUT_ID": "r1", "AGENTSTREAM_ATTEMPT_ID": "a1", "AGENTSTREAM_TASK": str(task_file),
           "AGENTSTREAM_REWARD_URL": reward_url, **extra}
    env.pop("AGENTSTREAM_MODEL", None)
    if model:
        env["AGENTSTREAM_MODEL"] = model
    return subprocess.run([sys.executable, str(EXAMPLES / script)], env=env, capture_output=True, text=True,
                          timeout=180)


def test_the_calculator_tool_does_arithmetic_and_nothing_else():
    assert calculate("12*7+3") == 87 and calculate("(1+2)*3/4") == 2.25 and calculate("-2**2") == -4
    for bad in ("__import__('os')", "x + 1", "1/0", "10**10**10", "(-8)**0.5", "1 +", "[1]"):
        with pytest.raises(CalculatorError):
            calculate(bad)


def test_the_example_task_files_load():
    from agentstream.controller.tasks import load_tasks

    calculator = load_tasks(EXAMPLES / "calculator_tasks.jsonl")
    assert all(calculate(t.task.input["expression"]) for t in calculator)
    arithmetic = load_tasks(EXAMPLES / "arithmetic_tasks.jsonl")
    assert {t.split for t in arithmetic} == {"train", "validation"}
    assert all(t.task.reward_fn and "answer" in t.task.metadata for t in arithmetic)


def test_an_agent_whose_model_server_is_down_fails_its_attempt(tmp_path: Path):
    down = f"http://127.0.0.1:{free_port()}/v1"
    result = run_agent("single_turn.py", "hello", tmp_path, down, AGENT_MAX_RETRIES="0")
    assert result.returncode == 1 and "the model call failed" in result.stderr


@pytest.mark.vllm
def test_single_turn_agent_answers_from_the_tiny_model(vllm_server, tmp_path: Path):
    base = f"{vllm_server.url}/v1"
    for task in ("Say hi.", {"prompt": "What is 2+2?", "system": "Be brief."},
                 {"messages": [{"role": "user", "content": "Count to three."}]}):
        result = run_agent("single_turn.py", task, tmp_path, base, AGENT_MAX_TOKENS="16")
        assert result.returncode == 0, result.stderr
        printed = json.loads(result.stdout)
        assert isinstance(printed["answer"], str) and printed["finish_reason"] in ("stop", "length")
    listed = run_agent("single_turn.py", "no model named", tmp_path, base, model=None, AGENT_MAX_TOKENS="8")
    assert listed.returncode == 0, listed.stderr


@pytest.mark.vllm
def test_calculator_agent_loops_over_garbage_and_posts_its_own_reward(vllm_server, tmp_path: Path):
    sink = RewardSink()
    try:
        result = run_agent("calculator_agent.py", {"expression": "12*7+3"}, tmp_path, f"{vllm_server.url}/v1",
                           reward_url=f"{sink.url}/rollouts/r1/reward", AGENT_MAX_TURNS="3", AGENT_MAX_TOKENS="24")
    finally:
        sink.shutdown()
        sink.server_close()
    assert result.returncode == 0, result.stderr
    ((path, auth, body),) = sink.posts
    assert path == "/rollouts/r1/reward" and auth == "Bearer ast1.example-token"
    assert body["value"] in (0.0, 1.0) and body["details"]["expected"] == 87.0
    assert 1 <= body["details"]["turns"] <= 3
    assert json.loads(result.stdout)["reward"] == body["value"]


@pytest.mark.vllm
def test_calculator_agent_fails_its_attempt_when_the_reward_is_refused(vllm_server, tmp_path: Path):
    sink = RewardSink(status=503)
    try:
        result = run_agent("calculator_agent.py", {"expression": "1+1"}, tmp_path, f"{vllm_server.url}/v1",
                           reward_url=f"{sink.url}/rollouts/r1/reward", AGENT_MAX_TURNS="1", AGENT_MAX_TOKENS="8")
    finally:
        sink.shutdown()
        sink.server_close()
    assert result.returncode == 1 and "could not post the reward" in result.stderr
    assert len(sink.posts) == 1

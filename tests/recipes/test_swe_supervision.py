"""The recipe's services dying mid-stage, on the real stack (Kafka, the tiny model on vLLM, the gateway, the streams
worker, the grader, mini-swe-agent in sandboxes): the grader, killed with SIGKILL, is started again within seconds and
grades every attempt; the gateway, killed, ends the stage within seconds saying so, not at the attempt timeout (the
wait before: every trajectory waited the streams worker's reward grace, the attempt timeout, and came unscored); a
SIGTERM to `agentstream recipe swe` leaves none of its processes running, and the same command resumes the run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
from rich.console import Console

from agentstream.demo.run import RESTARTS, SUPERVISE_EVERY_S, run_to_summary
from agentstream.recipes.swe.probe import Probe, ProbeConfig
from agentstream.stack import StackError
from agentstream.stack.process import ServerState, pid_alive
from agentstream.stack.vllm import LocalVLLM, running_servers

pytestmark = [pytest.mark.slow]

ATTEMPT_TIMEOUT_S = 600.0
"""the streams worker waits this long for an attempt's reward (the recipe's `reward_grace_s`): what a dead grader cost"""


def probe_of(vllm_server: Any, tmp_path: Path) -> Probe:
    name = next(n for n, state in running_servers().items() if state.url == vllm_server.url)
    config = ProbeConfig(model="tiny", base_model=vllm_server.model_dir, vllm_name=name, keep_stack=True, k=2,
                         train_tasks=1, validation_tasks=1, step_limit=2, max_tokens=16, concurrency=2,
                         attempt_timeout_s=ATTEMPT_TIMEOUT_S, out=tmp_path / unique("supervised"),
                         probed_out=tmp_path / "probed.jsonl")
    return Probe(config, Console(record=True, width=200))


def unique(name: str) -> str:
    """A run folder's name, its topics' prefix: no other test's on the session's broker."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def run_probe(probe: Probe) -> dict[str, Any]:
    return run_to_summary(probe, lambda _progress, _config, console, elapsed_s: probe.summary(console, elapsed_s))


async def until(condition: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        await asyncio.sleep(0.1)


def started(probe: Probe, name: str) -> bool:
    return any(s.name == name for s in probe.running)


async def kill_when_attempting(probe: Probe, name: str) -> float:
    """SIGKILL the service `name` once the probe's attempts are under way; when that was."""
    await until(lambda: started(probe, name) and (probe.out / "probe").is_dir(), f"{name} and attempts")
    os.kill(probe.service(name).process.pid, signal.SIGKILL)
    return time.monotonic()


@pytest.mark.vllm
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", ["grader", "streams"])
async def test_a_consumer_killed_mid_probe_is_started_again_within_seconds_and_every_attempt_is_graded(
        vllm_server, kafka_bootstrap, tmp_path, monkeypatch, name):
    """The grader and the streams worker resume from their committed offsets: a restart loses no attempt."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    probe = probe_of(vllm_server, tmp_path)
    running = asyncio.create_task(asyncio.to_thread(run_probe, probe))
    killed = await kill_when_attempting(probe, name)
    await until(lambda: probe.service(name).restarts == 1, "restart", timeout=60)
    noticed = time.monotonic() - killed
    result = await running
    ended = time.monotonic() - killed

    assert noticed < 5 * SUPERVISE_EVERY_S + 5, f"the {name}'s death noticed after {noticed:.1f} s"
    seen = probe.console.export_text()
    log = probe.service(name).log
    assert f"the {name} was killed by SIGKILL" in seen and f"starting it again (1 of {RESTARTS})" in seen
    assert str(log) in seen.replace("\n", "")
    assert result["attempts"] == 2 * result["tasks"] and not result["unscored"], result
    assert ended < ATTEMPT_TIMEOUT_S / 2, f"every attempt graded {ended:.0f} s after the kill"
    assert "the run starts it again" in log.read_text()


@pytest.mark.vllm
@pytest.mark.timeout(1200)
async def test_the_gateway_killed_mid_probe_ends_it_within_seconds_saying_so_and_stops_the_rest(
        vllm_server, kafka_bootstrap, tmp_path, monkeypatch):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    probe = probe_of(vllm_server, tmp_path)
    running = asyncio.create_task(asyncio.to_thread(run_probe, probe))
    killed = await kill_when_attempting(probe, "gateway")
    with pytest.raises(StackError) as failed:
        await running
    ended = time.monotonic() - killed

    log = probe.service("gateway").log
    assert str(failed.value).startswith("the gateway was killed by SIGKILL")
    assert f"Its log ({log})" in str(failed.value)
    # noticed within a second or so; the rest is stopping the others (each given its grace) and the evaluator
    assert ended < 120, f"the stage ended {ended:.0f} s after the gateway's death"
    assert not [s.name for s in probe.running if pid_alive(s.process.pid)], "a service outlived the stage"
    assert LocalVLLM(probe.config.vllm_name).state() is not None, "the kept vLLM server (keep_stack) was stopped"


@pytest.mark.heavy  # a vLLM server of the recipe's own beside the session's, ~3 min: in `make heavy`
@pytest.mark.timeout(1200)
def test_sigterm_to_the_recipe_stops_every_process_it_started_and_the_same_command_resumes(
        kafka_bootstrap, tiny_model_dirs, tmp_path):
    """The tiny model on a vLLM server of the recipe's own, the baseline stage's services and attempts: all gone
    after one SIGTERM, the recipe's exit the shell's for it, the run folder resumable."""
    name = f"recipeops-sigterm-{os.getpid()}"
    out = tmp_path / unique("sigterm")
    command = [sys.executable, "-m", "agentstream", "recipe", "swe", "--model", "tiny", "--stages", "tasks,baseline",
               "--limit", "4", "--seed", "0", "--step-limit", "2", "--max-tokens", "16", "--attempt-timeout-s",
               str(ATTEMPT_TIMEOUT_S), "--base-model", str(tiny_model_dirs[0]), "--out", str(out),
               "--vllm-name", name]  # never the default, recipe-swe: another run's server may hold that name
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "COLUMNS": "200"}
    server = LocalVLLM(name)
    recipe = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.monotonic() + 900
        while not list(out.glob("baseline/*/logs/grader.log")) or not (out / "baseline").is_dir() \
                or not _attempting(out):
            assert recipe.poll() is None, f"the recipe ended early: {recipe.communicate()[0][-3000:]}"
            assert time.monotonic() < deadline, "the baseline's attempts never started"
            time.sleep(0.5)
        family = [p.pid for p in psutil.Process(recipe.pid).children(recursive=True)]
        state = ServerState.load(server.state_file)
        assert state is not None and state.pid in family, "the recipe started its own vLLM server"
        recipe.send_signal(signal.SIGTERM)
        said, _ = recipe.communicate(timeout=300)
    finally:
        if recipe.poll() is None:
            recipe.kill()
            recipe.communicate()
        server.stop(grace=5)

    assert recipe.returncode == 128 + signal.SIGTERM, said[-3000:]
    assert "Stopping the baseline stage and everything it started" in said, said[-3000:]
    left = [pid for pid in family if pid_alive(pid)]
    assert not left, f"left running: {[' '.join(psutil.Process(pid).cmdline()[:4]) for pid in left]}"
    assert (out / "tasks.json").exists() and not (out / "baseline.json").exists()

    again = subprocess.run([*command, "--stages", "tasks"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "tasks: done earlier" in again.stdout, again.stdout[-3000:]
    assert json.loads((out / "summary.json").read_text())["stages"]["tasks"] is True


def _attempting(out: Path) -> bool:
    """Whether the baseline's evaluator has launched attempts (their logs folder holds one)."""
    return any(path.is_file() for path in out.glob("baseline/*/probe/attempts/**/*"))


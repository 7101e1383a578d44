"""The compose stack, brought up and used: `make compose-check`.

Brings compose.yaml up with the cpu and run profiles (Kafka, vLLM-CPU and the tiny model, the
gateway, streams, trainer, dashboard and the in-network controller) from the images `make images`
built, under a project name of its own and on free ports of 127.0.0.1. Then a controller on this
machine, outside the containers, runs the example agent over the arithmetic tasks: the agents reach
the gateway only through its published port. It waits, with deadlines, until a trajectory is in the
log, a new weight version is served by vLLM (the gateway's pool reports it) and the dashboard lists
rollouts; then takes the stack down and checks nothing of it is left running. Prints progress and
the times; exits non-zero, naming what did not happen, on failure.

  ENGINE=podman|docker   which engine (the Makefile's choice); podman runs podman-compose (pinned)
  AGENTSTREAM_CHECK_KEEP=1   leave the stack up (for a look at it); `down` it yourself
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "agentstream-check"
PODMAN_COMPOSE = "podman-compose==1.6.0"
TOKEN_SECRET = secrets.token_hex(32)
API_KEY = secrets.token_hex(32)
"""fresh for each check: compose.yaml has no default for either (the gateway refuses placeholders beyond loopback)"""
UP_DEADLINE_S = 20 * 60
"""from `up` to the gateway answering with a healthy vLLM server: first start loads vLLM and the model"""
TRAIN_DEADLINE_S = 20 * 60
"""from the agents' start to a new weight version served"""
STARTED = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f}s] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine() -> str:
    return os.environ.get("ENGINE") or ("docker" if shutil.which("docker") and subprocess.run(
        ["docker", "info"], capture_output=True).returncode == 0 else "podman")


def compose_command() -> list[str]:
    if engine() == "docker":
        return ["docker", "compose"]
    uv = shutil.which("uv")
    return [*([uv] if uv else [sys.executable, "-m", "uv"]), "tool", "run", "--from", PODMAN_COMPOSE, "podman-compose"]


class Stack:
    def __init__(self, ports: dict[str, int]):
        self.ports = ports
        self.env = {**os.environ,
                    "AGENTSTREAM_GATEWAY_PORT": str(ports["gateway"]),
                    "AGENTSTREAM_DASHBOARD_PORT": str(ports["dashboard"]),
                    "AGENTSTREAM_KAFKA_PORT": str(ports["kafka"]),
                    "AGENTSTREAM_TOKEN_SECRET": TOKEN_SECRET,
                    "AGENTSTREAM_API_KEYS": API_KEY,
                    "AGENTSTREAM_PARTITIONS": "2"}

    def compose(self, *args: str, check: bool = True, quiet: bool = True) -> subprocess.CompletedProcess:
        command = [*compose_command(), "-f", str(ROOT / "compose.yaml"), "-p", PROJECT,
                   "--profile", "cpu", "--profile", "run", *args]
        result = subprocess.run(command, cwd=ROOT, env=self.env, text=True,
                                capture_output=quiet, timeout=UP_DEADLINE_S)
        if check and result.returncode != 0:
            raise SystemExit(f"`{' '.join(args)}` failed (exit {result.returncode}):\n"
                             f"{(result.stdout or '')[-2000:]}{(result.stderr or '')[-3000:]}")
        return result

    def running(self) -> list[str]:
        """This project's containers (any state) and networks, as the engine lists them."""
        containers = subprocess.run([engine(), "ps", "-a", "--filter", f"label=com.docker.compose.project={PROJECT}",
                                     "--format", "{{.Names}}"], capture_output=True, text=True).stdout.split()
        networks = subprocess.run([engine(), "network", "ls", "--format", "{{.Name}}"],
                                  capture_output=True, text=True).stdout.split()
        return containers + [name for name in networks if name.startswith(f"{PROJECT}_")]

    def logs(self, service: str, lines: int = 40) -> str:
        result = self.compose("logs", "--tail", str(lines), service, check=False)
        return (result.stdout or "") + (result.stderr or "")


def get_json(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def wait_for(what: str, condition: Callable[[], Any], deadline_s: float, stack: Stack, services: list[str]) -> Any:
    """Poll `condition` until it returns something true; on timeout, fail with the services' logs."""
    started = time.monotonic()
    last_note = started
    while time.monotonic() - started < deadline_s:
        value = condition()
        if value:
            say(f"{what}: after {time.monotonic() - started:.1f}s")
            return value
        if time.monotonic() - last_note > 30:
            say(f"  still waiting: {what}")
            last_note = time.monotonic()
        time.sleep(1)
    logs = "\n".join(f"--- {service} ---\n{stack.logs(service)}" for service in services)
    raise SystemExit(f"timed out after {deadline_s:.0f}s waiting for: {what}\n{logs}")


def start_in_order(stack: Stack) -> None:
    """What compose.yaml's depends_on conditions say, done here for podman: podman 4.3 cannot start a
    container whose exited dependency has dependencies of its own (topics after kafka, vllm-cpu after
    tiny-model: "not found in input list"), and podman-compose skips health conditions before podman
    4.6. So services start with --no-deps, each group once what it needs is there."""
    stack.compose("up", "-d", "--no-deps", "kafka", "tiny-model")
    wait_for("Kafka accepting clients", lambda: port_open(stack.ports["kafka"]), UP_DEADLINE_S, stack, ["kafka"])
    stack.compose("up", "-d", "--no-deps", "topics")
    wait_for("topics created", lambda: exited_ok(stack, "topics"), UP_DEADLINE_S, stack, ["kafka", "topics"])
    wait_for("tiny model written", lambda: exited_ok(stack, "tiny-model"), UP_DEADLINE_S, stack, ["tiny-model"])
    stack.compose("up", "-d", "--no-deps", "vllm-cpu", "gateway", "streams", "dashboard", "trainer")


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def exited_ok(stack: Stack, service: str) -> bool:
    """The service's container ran to completion with exit 0 (a failure is left to its restart policy)."""
    result = subprocess.run([engine(), "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                             f"{PROJECT}_{service}_1"], capture_output=True, text=True)
    return result.stdout.split() == ["exited", "0"]


def gateway_health(stack: Stack, path: str = "/healthz") -> dict | None:
    """The gateway's report: /healthz answers while the process does, /readyz only once Kafka and an upstream do."""
    status, body = get_json(f"http://127.0.0.1:{stack.ports['gateway']}{path}")
    return body if status == 200 and body else None


def served_version(stack: Stack) -> int | None:
    body = gateway_health(stack)
    versions = [upstream.get("weight_version") or 0 for upstream in (body or {}).get("upstreams", [])]
    return max(versions) if versions and max(versions) >= 1 else None


async def first_trajectory(stack: Stack, deadline_s: float) -> dict:
    """The first trajectory event in the log, read through Kafka's published port."""
    from agentstream.schemas.codec import decode
    from agentstream.schemas.kafka import KafkaSettings, make_consumer
    from agentstream.schemas.topics import Topics

    settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{stack.ports['kafka']}")
    consumer = make_consumer(settings, Topics().trajectories, group_id=None)
    await consumer.start()
    try:
        async with asyncio.timeout(deadline_s):
            async for record in consumer:
                return decode(record.value).model_dump(mode="json")
    finally:
        await consumer.stop()
    raise AssertionError("unreachable")


def outside_controller(stack: Stack, logs: Path) -> subprocess.Popen:
    """The example agent over the arithmetic tasks, run from this machine through the published ports."""
    env = {**os.environ,
           "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{stack.ports['kafka']}",
           "AGENTSTREAM_GATEWAY_URL": f"http://127.0.0.1:{stack.ports['gateway']}",
           "AGENTSTREAM_TOKEN_SECRET": TOKEN_SECRET,
           "AGENTSTREAM_TASKS": str(ROOT / "examples" / "arithmetic_tasks.jsonl"),
           "AGENTSTREAM_AGENT": f"{sys.executable} {ROOT / 'examples' / 'single_turn.py'}",
           "AGENTSTREAM_MODEL": "tiny",
           "AGENTSTREAM_PARTITIONS": stack.env["AGENTSTREAM_PARTITIONS"],
           "AGENTSTREAM_SAMPLES": "8",
           "AGENTSTREAM_EPOCHS": "20",
           "AGENTSTREAM_CONCURRENCY": "4",
           "AGENTSTREAM_RUN_ID": f"outside-{int(time.time())}",
           "AGENTSTREAM_PROGRESS": "false",
           "AGENTSTREAM_LOGS_DIR": str(logs)}
    return subprocess.Popen([sys.executable, "-m", "agentstream.controller"], cwd=ROOT, env=env,
                            stdout=open(logs / "controller.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def check(stack: Stack, logs: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    say(f"up: {PROJECT} with {' '.join(compose_command()[-1:])} (gateway 127.0.0.1:{stack.ports['gateway']}, "
        f"dashboard :{stack.ports['dashboard']}, Kafka :{stack.ports['kafka']})")
    up_at = time.monotonic()
    if engine() == "podman":
        start_in_order(stack)
    else:
        stack.compose("up", "-d")
    times["up_command_s"] = time.monotonic() - up_at
    say(f"services started after {times['up_command_s']:.1f}s; waiting for the gateway and a healthy vLLM server")
    wait_for("gateway ready (/readyz), vLLM-CPU serving", lambda: gateway_health(stack, "/readyz") is not None,
             UP_DEADLINE_S, stack, ["kafka", "topics", "vllm-cpu", "gateway"])
    if engine() == "podman":
        stack.compose("up", "-d", "--no-deps", "controller")
    times["up_to_gateway_s"] = time.monotonic() - up_at

    say("agents outside the containers start (the controller on this machine, through 127.0.0.1)")
    controller = outside_controller(stack, logs)
    try:
        trajectory = asyncio.run(first_trajectory(stack, TRAIN_DEADLINE_S))
        times["up_to_first_trajectory_s"] = time.monotonic() - up_at
        say(f"first trajectory: task {trajectory['data'].get('task_id')}, {trajectory['data'].get('status')}, "
            f"reward {trajectory['data'].get('reward')}, "
            f"{times['up_to_first_trajectory_s']:.1f}s after `up`")
        version = wait_for("a new weight version served by vLLM", lambda: served_version(stack),
                           TRAIN_DEADLINE_S, stack, ["trainer", "gateway", "streams", "vllm-cpu"])
        times["up_to_new_version_s"] = time.monotonic() - up_at
        say(f"weight version {version} swapped in, {times['up_to_new_version_s']:.1f}s after `up`")
    finally:
        controller.send_signal(signal.SIGTERM)
        try:
            controller.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(controller.pid, signal.SIGKILL)

    listing = wait_for("the dashboard lists rollouts", lambda: dashboard_rollouts(stack), 120, stack, ["dashboard"])
    say(f"dashboard: {listing} rollouts listed")
    return times


def dashboard_rollouts(stack: Stack) -> int | None:
    status, body = get_json(f"http://127.0.0.1:{stack.ports['dashboard']}/api/rollouts",
                            {"Authorization": f"Bearer {API_KEY}"})
    rows = body.get("rows") if isinstance(body, dict) else None
    return len(rows) if status == 200 and rows else None


def main() -> int:
    stack = Stack({"gateway": free_port(), "dashboard": free_port(), "kafka": free_port()})
    if stack.running():
        say(f"an earlier check left {', '.join(stack.running())}: taking them down first")
        stack.compose("down", "-v", check=False)
    keep = os.environ.get("AGENTSTREAM_CHECK_KEEP") == "1"
    with tempfile.TemporaryDirectory(prefix="compose-check-") as logs:
        try:
            times = check(stack, Path(logs))
        finally:
            if not keep:
                down_at = time.monotonic()
                stack.compose("down", "-v", "-t", "20", check=False)
                left = stack.running()
                say(f"down in {time.monotonic() - down_at:.1f}s; containers or networks left: {left or 'none'}")
                if left:
                    raise SystemExit(f"`down` left these behind: {left}")
    say(f"compose check passed in {time.monotonic() - STARTED:.1f}s: " + json.dumps({k: round(v, 1) for k, v in times.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

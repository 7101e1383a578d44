"""The run's supervisor on real processes: a consumer that resumes by itself is started again when it dies, a service
that does not ends the run within a second with how it ended and its log, so does an inference server; and a
SIGTERM stops what a run started instead of leaving it running (`agentstream demo`'s too)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from pydantic import BaseModel
from rich.console import Console

from agentstream.demo import run as demo_run
from agentstream.demo.run import RESTARTS, Demo, StackConfig
from agentstream.stack import StackError
from agentstream.stack.kafka import LocalKafka, kafka_libs
from agentstream.stack.process import ServerState, free_port, pid_alive, spawn, stop_pid
from agentstream.stack.service import Service


class NoSettings(BaseModel):
    pass


def listener(name: str, restartable: bool) -> Service:
    """A service that runs until it is killed: Python's http.server on a port of its own."""
    return Service(name, "http.server", NoSettings(), command=("0", "--bind", "127.0.0.1"), restartable=restartable)


@pytest.fixture
def demo(tmp_path):
    console = Console(record=True, width=200)
    demo = Demo(StackConfig(out=tmp_path / "run"), console)
    yield demo
    for service in demo.running:
        stop_pid(service.process.pid, grace=5)
        service.process.wait(timeout=30)


def kill(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_a_restartable_service_that_dies_is_started_again_until_its_restarts_are_spent(demo):
    grader = demo.start(listener("grader", restartable=True))
    demo.check_alive()  # alive: nothing to do
    for restart in range(1, RESTARTS + 1):
        first = grader.process
        kill(first)
        demo.check_alive()
        assert grader.process is not first and grader.process.poll() is None, "started again"
        assert grader.restarts == restart
    seen = demo.console.export_text()
    assert "the grader was killed by SIGKILL" in seen and f"starting it again (1 of {RESTARTS})" in seen
    assert str(grader.log) in seen, "the log's path is said"
    assert grader.log.read_text().count("the run starts it again") == RESTARTS  # the log marks each life

    kill(grader.process)
    with pytest.raises(StackError) as failed:
        demo.check_alive()
    message = str(failed.value)
    assert message.startswith("the grader was killed by SIGKILL") and f"(after {RESTARTS} restarts)" in message
    assert f"Its log ({grader.log})" in message


async def test_a_service_that_cannot_be_restarted_ends_the_wait_within_seconds(demo):
    """A wait for what a dead gateway would have let through (here: forever) ends at its death, not its timeout."""
    gateway = demo.start(listener("gateway", restartable=False))
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    async def killed_soon() -> None:
        await asyncio.sleep(0.5)
        await asyncio.to_thread(kill, gateway.process)

    killer = asyncio.create_task(killed_soon())
    started = time.monotonic()
    with pytest.raises(StackError, match=r"^the gateway was killed by SIGKILL.*Its log \("):
        await demo.supervised(forever())
    took = time.monotonic() - started
    await killer
    assert cancelled.is_set(), "the wait was cancelled, not left running"
    assert took < 0.5 + 5 * demo_run.SUPERVISE_EVERY_S, took


def test_an_inference_server_that_died_or_stopped_answering_ends_the_run(demo, tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    port = free_port()
    server = spawn([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], log)
    demo.servers = [ServerState.of_process(server.pid, f"http://127.0.0.1:{port}", str(log), {"oom_kills": None})]
    try:
        monkeypatch.setattr(demo_run, "HEALTH_EVERY_S", 0.0)
        demo.check_alive()  # no /health route: a 404 is not healthy, but not yet for UNHEALTHY_S
        url = demo.servers[0].url
        assert url in demo.unhealthy_since
        demo.unhealthy_since[url] -= demo_run.UNHEALTHY_S + 1  # as if it had not answered for that long
        with pytest.raises(StackError, match=rf"has not answered /health for {demo_run.UNHEALTHY_S:.0f} s"):
            demo.check_alive()
        monkeypatch.setattr(demo_run, "HEALTH_EVERY_S", 3600.0)
        kill(server)
        with pytest.raises(StackError) as failed:
            demo.check_alive()
        assert str(failed.value).startswith(f"the vLLM server at http://127.0.0.1:{port} was killed")
        assert f"Its log ({log})" in str(failed.value)
    finally:
        stop_pid(server.pid, grace=5)
        server.wait(timeout=30)


STOPPABLE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from agentstream.stack.process import spawn, stop_pid, stopping_on_signals

    with stopping_on_signals():
        child = spawn([sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]))
        try:
            print(child.pid, flush=True)
            time.sleep(600)
        finally:
            stop_pid(child.pid, grace=5)
            print("stopped", flush=True)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_what_the_run_started_in_a_session_of_its_own(tmp_path, signum):
    """Python's default SIGTERM ends a process without its `finally`: the child, in its own session, would stay."""
    run = subprocess.Popen([sys.executable, "-c", STOPPABLE, str(tmp_path / "child.log")], stdout=subprocess.PIPE,
                           text=True)
    assert run.stdout is not None
    child = int(run.stdout.readline())
    assert psutil.Process(child).ppid() == run.pid and os.getsid(child) != os.getsid(run.pid)
    run.send_signal(signum)
    out, _ = run.communicate(timeout=60)
    assert "stopped" in out and run.returncode != 0
    assert not pid_alive(child), "the child outlived the run"


@pytest.mark.slow  # a broker of the demo's own started (~10-30 s): the demo's first service
@pytest.mark.timeout(600)
def test_a_sigterm_to_the_demo_stops_the_services_it_started(tmp_path):
    """Each service of `agentstream demo` runs in a session of its own: before, a SIGTERM ended the demo's Python
    at once and its broker (and every later service) ran on. Here the demo's own broker, under a home of the
    test's own, is up when the demo is told to stop. One mode: --production and --tenants take the same way out
    (cli/loop.py), each another 30 s here."""
    home = tmp_path / "home"
    libs = kafka_libs()  # the shared jars: a fresh home would fetch them
    (home / "kafka").mkdir(parents=True)
    (home / "kafka" / libs.name).symlink_to(libs)
    # a broker that ran before on free ports, which its next start keeps: not Kafka's usual 9092, maybe another's
    broker = LocalKafka(home / "kafka" / "data")
    ServerState(pid=os.getpid(), url=f"127.0.0.1:{free_port()}", log="", details={"controller_port": free_port()},
                started=0.0).save(broker.state_file)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AGENTSTREAM_", "KAFKA_"))}
    log = tmp_path / "demo.log"
    with open(log, "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "agentstream", "demo", "--out", str(tmp_path / "run")],
                               stdout=out, stderr=subprocess.STDOUT, env={**env, "AGENTSTREAM_HOME": str(home)})
    started: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while (state := broker.state()) is None:
            assert run.poll() is None, f"the demo ended before its broker was up:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the demo's broker was not up after 300 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        started = [state.pid, *(p.pid for p in psutil.Process(run.pid).children(recursive=True))]
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=120)
        assert run.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
        assert "Stopped by SIGTERM" in log.read_text()
        left = [pid for pid in started if pid_alive(pid)]
        assert not left, f"left running: {[' '.join(psutil.Process(pid).cmdline()[:4]) for pid in left]}"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        for pid in started:
            stop_pid(pid, grace=5)

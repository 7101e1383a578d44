"""A local server's state file outlives the server: a pid in it that now names something else is never
taken for the server, so `status` does not list it and `stop` does not signal it."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import ServerState


def test_a_server_state_is_alive_only_for_the_process_it_was_written_for():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = ServerState.of_process(child.pid, "http://127.0.0.1:1", "", {})
        assert state.alive
        # the same pid, now another process (it started at another time): not the server
        assert not ServerState(child.pid, state.url, "", {}, started=state.started - 5).alive
    finally:
        child.kill()
        child.wait()
    assert not state.alive


def test_a_stale_pid_that_is_now_a_thread_of_another_process_is_not_signalled(tmp_path: Path):
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert thread.native_id is not None
        # a state file from before start times were recorded, whose pid is now one of this process's threads
        kafka = LocalKafka(tmp_path / "kafka")
        ServerState(thread.native_id, "127.0.0.1:1", "", {}).save(kafka.state_file)
        assert kafka.state() is None
        assert kafka.stop(grace=1) is False  # and this test process is still here to say so
        assert thread.is_alive()
    finally:
        release.set()
        thread.join()


def test_a_vllm_server_that_no_longer_answers_is_replaced_not_reused(tmp_path: Path):
    """vLLM's API process outlives an engine killed for memory: alive, not listening. `start` must not hand
    it out as the running server (every call through it would fail to connect); it stops it first."""
    from agentstream.stack.process import free_port
    from agentstream.stack.vllm import LocalVLLM

    husk = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = LocalVLLM("husk", home=tmp_path)
        server.dir.mkdir(parents=True)
        ServerState.of_process(husk.pid, f"http://127.0.0.1:{free_port()}", str(server.log), {}).save(server.state_file)
        said: list[str] = []
        assert server.serving(say=said.append) is None  # what `start` asks before it starts anew
        assert husk.wait(timeout=30) is not None and server.state() is None
        assert "no longer answers" in said[0]
    finally:
        husk.kill()
        husk.wait()

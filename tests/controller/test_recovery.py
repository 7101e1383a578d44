"""A controller killed with SIGKILL mid-run, as a real process, and started again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentstream.controller.history import INTERRUPTED
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack.process import free_port, pid_alive
from tests.support.controller import SECRET, agent_command, attempts_of, read_rollouts, runs_log, types, write_tasks
from tests.support.wait import wait_for, wait_for_async

_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path: Path):
    """Whatever a failing test leaves running (controllers, their agents) is stopped."""
    yield
    while _started:
        process = _started.pop()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # twice: stop its agents now, then exit
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
    for line in runs_log(tmp_path):
        for pid in map(int, line[2:]):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def start_controller(kafka, tasks: Path, state: Path, *flags: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "agentstream.controller", "--tasks", str(tasks), "--agent", agent_command(state),
            "--concurrency", "3", "--no-shuffle", "--no-progress", "--logs-dir", str(state / "logs"),
            "--topic-prefix", kafka.topic_prefix, "--heartbeat-s", "0.5", "--kill-grace-s", "1", *flags]
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "AGENTSTREAM_TOKEN_SECRET": SECRET}
    with open(state / f"controller-{len(list(state.glob('controller-*.log')))}.log", "wb") as log:  # the child keeps its copy
        _started.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).parents[2]))
    return _started[-1]


async def test_controller_killed_mid_run_resumes_without_rerunning_finished_attempts(kafka, tmp_path: Path):
    # no shuffle, 3 slots: q1 and q2 finish, b1..b3 block every slot, q3 waits for one
    names = ["q1", "q2", "b1", "b2", "b3", "q3"]
    tasks = write_tasks(tmp_path / "tasks.jsonl",
                        [{"id": n, "input": {"mode": "ok" if n[0] == "q" else "block"}} for n in names])
    first = start_controller(kafka, tasks, tmp_path)
    try:
        async def mid_run():
            events = await read_rollouts(kafka)
            finished = [e for e in events if e.type == "rollout.finished"]
            started = [e for e in events if e.type == "rollout.started"]
            return len(finished) == 2 and len(started) == 5 and len(runs_log(tmp_path)) == 5
        await wait_for_async(mid_run, timeout=60, what="two rollouts finished and three blocked")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)

    before = await read_rollouts(kafka)
    finished_before = {e.attempt_id for e in before if e.type == "rollout.finished"}
    blocked = {line[0]: int(line[2]) for line in runs_log(tmp_path)
               if line[1] not in finished_before}
    assert len(blocked) == 3
    assert all(pid_alive(pid) for pid in blocked.values()), "SIGKILL of the controller should leave its agents"

    second = start_controller(kafka, tasks, tmp_path)
    assert second.wait(90) == 0, (tmp_path / "controller-1.log").read_text()

    # the orphaned agents of the interrupted attempts were stopped before their reruns
    for pid in blocked.values():
        wait_for(lambda pid=pid: not pid_alive(pid), timeout=10, what=f"orphaned agent {pid} to be gone")

    events = await read_rollouts(kafka)
    assert len({e.id for e in events}) == len(events)
    by_task = {tries[0][0].data.task.id: tries for tries in attempts_of(events).values()}
    assert set(by_task) == set(names)
    for name in ("q1", "q2"):  # finished before the kill: never run again
        (attempt,) = by_task[name]
        assert types(attempt) == ["queued", "started", "finished"]
        assert attempt[-1].attempt_id in finished_before
    for name in ("b1", "b2", "b3"):  # interrupted: closed by the new controller, rerun as attempt 2
        interrupted, rerun = by_task[name]
        assert types(interrupted)[:2] == ["queued", "started"] and types(interrupted)[-1] == "failed"
        assert set(types(interrupted)[2:-1]) <= {"heartbeat"}
        assert interrupted[-1].data.error.startswith(INTERRUPTED) and interrupted[-1].data.will_retry
        assert interrupted[-1].source == "controller"
        assert types(rerun)[0] == "queued" and types(rerun)[-1] == "finished"
        assert rerun[0].data.attempt_number == 2 and rerun[0].rollout_id == interrupted[0].rollout_id
    (q3,) = by_task["q3"]  # never started before the kill: its first attempt now
    assert q3[0].data.attempt_number == 1 and types(q3)[-1] == "finished"

    ran = [line[0] for line in runs_log(tmp_path)]
    assert len(ran) == 9  # 2 quick + 3 blocked + 3 reruns + q3, nothing else
    assert {r: ran.count(r) for r in set(ran)} == {tries[0][0].rollout_id: len(tries) for tries in by_task.values()}

    # a third start of the same command finds the run complete and launches nothing
    third = start_controller(kafka, tasks, tmp_path)
    assert third.wait(60) == 0
    assert len(runs_log(tmp_path)) == 9 and len(await read_rollouts(kafka)) == len(events)


async def test_sigterm_hands_running_attempts_back_for_the_next_controller(kafka, tmp_path: Path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": f"b{i}", "input": {"mode": "block"}} for i in range(3)]
                        + [{"id": "later", "input": {"mode": "ok"}}])
    controller = start_controller(kafka, tasks, tmp_path, "--shutdown-grace-s", "0.5")
    try:
        await wait_for_async(lambda: len(runs_log(tmp_path)) == 3, timeout=60, what="three agents to start")
        # the same run started twice on one machine: the second refuses, touching nothing
        twin = start_controller(kafka, tasks, tmp_path)
        assert twin.wait(30) == 3, "refused: an error, not a run"
        assert "already being run by another controller" in (tmp_path / "controller-1.log").read_text()
    finally:
        controller.send_signal(signal.SIGTERM)
    assert controller.wait(30) == 2, "stopped early: exit code 2 (run again to resume)"

    tries = attempts_of(await read_rollouts(kafka))
    assert len(tries) == 3, "a rollout was launched after SIGTERM"
    for (attempt,) in tries.values():
        assert types(attempt)[:2] == ["queued", "started"] and types(attempt)[-1] == "failed"
        assert types(attempt).count("failed") == 1, "the attempt was closed twice"
        assert attempt[-1].data.error.startswith(INTERRUPTED) and attempt[-1].data.will_retry
    for _, _, pid in runs_log(tmp_path):
        wait_for(lambda pid=pid: not pid_alive(int(pid)), timeout=10, what="handed-back agents to be stopped")

    # the next controller reruns the handed-back attempts (now they finish) and the one never started
    assert start_controller(kafka, tasks, tmp_path).wait(60) == 0, (tmp_path / "controller-2.log").read_text()
    tries = attempts_of(await read_rollouts(kafka))
    assert sorted(len(t) for t in tries.values()) == [1, 2, 2, 2]
    assert all(types(t[-1])[-1] == "finished" for t in tries.values())


async def test_when_kafka_goes_away_the_run_stops_with_its_agents_and_resumes_later(own_broker, tmp_path: Path):
    broker = own_broker
    port = free_port()
    own = KafkaSettings(bootstrap_servers=broker.start(port=port).url, topic_prefix="gone.")
    try:
        tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": f"b{i}", "input": {"mode": "block"}} for i in range(2)])
        controller = start_controller(own, tasks, tmp_path, "--publish-timeout-s", "3")
        await wait_for_async(lambda: len(runs_log(tmp_path)) == 2, timeout=60, what="two agents to start")
        broker.stop()
        assert controller.wait(60) == 3, "an error, not 'some given up'"
        assert "Kafka did not acknowledge" in (tmp_path / "controller-0.log").read_text()
        for _, _, pid in runs_log(tmp_path):  # nothing could be recorded, but no agent was left running
            wait_for(lambda pid=pid: not pid_alive(int(pid)), timeout=10, what="the agents to be stopped")

        broker.start(port=port)
        assert start_controller(own, tasks, tmp_path).wait(90) == 0, (tmp_path / "controller-1.log").read_text()
        for interrupted, rerun in attempts_of(await read_rollouts(own)).values():
            assert types(interrupted)[-1] == "failed" and interrupted[-1].data.error.startswith(INTERRUPTED)
            assert types(rerun)[-1] == "finished" and rerun[0].data.attempt_number == 2
    finally:
        broker.stop()

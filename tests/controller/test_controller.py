"""The controller with the local launcher, against the real broker: lifecycle events, retries,
timeouts that kill whole process groups, and pacing on the weights topic."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import agentstream.schemas as s
from agentstream.controller.controller import Controller
from agentstream.schemas.kafka import Publisher, make_producer
from agentstream.schemas.tokens import verify_rollout_token
from agentstream.stack.process import pid_alive
from tests.support.controller import (
    GATEWAY,
    SECRET,
    attempts_of,
    controller_settings,
    read_rollouts,
    runs_log,
    types,
    write_tasks,
)
from tests.support.wait import wait_for, wait_for_async


async def test_task_file_runs_to_completion_with_every_event_in_order_once(kafka, tmp_path: Path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [
        {"id": "ok", "input": {"mode": "ok", "question": "2+2"}, "metadata": {"answer": "4"}, "reward_fn": "m:f"},
        {"id": "flaky", "input": {"mode": "flaky"}},
        {"id": "slow", "input": {"mode": "slow", "seconds": 1.0}},
        {"id": "held-out", "input": {"mode": "ok"}, "split": "validation"},
    ])
    settings = controller_settings(kafka, tasks, tmp_path, samples=2, heartbeat_s=0.3, model="tiny")
    controller = Controller(settings)
    summary = await controller.run()
    assert (summary.done, summary.failed, summary.exit_code) == (7, 0, 0)

    events = await read_rollouts(kafka)
    assert len({e.id for e in events}) == len(events), "an event was written twice"
    attempts = attempts_of(events)
    assert set(attempts) == {r.rollout_id for r in controller.plan}

    for rollout in controller.plan:
        tries = attempts[rollout.rollout_id]
        expected_tries = 2 if rollout.task.id == "flaky" else 1
        assert len(tries) == expected_tries, (rollout.task.id, [types(t) for t in tries])
        assert [t[0].data.attempt_number for t in tries] == list(range(1, expected_tries + 1))
        assert len({t[0].attempt_id for t in tries}) == expected_tries
        for attempt in tries[:-1]:  # the flaky task's first attempt
            # a heartbeat may come between: under load the agent can outlive a 0.3 s beat
            assert [k for k in types(attempt) if k != "heartbeat"] == ["queued", "started", "failed"]
            failed = attempt[-1].data
            assert failed.exit_code == 3 and failed.will_retry and "failing on purpose" in failed.stderr_tail
        last = tries[-1]
        kinds = types(last)
        assert kinds[:2] == ["queued", "started"] and kinds[-1] == "finished"
        assert set(kinds[2:-1]) <= {"heartbeat"}, kinds
        if rollout.task.id == "slow":
            assert "heartbeat" in kinds, "a 1 s attempt with 0.3 s heartbeats sent none"
        queued, started, finished = last[0].data, last[1].data, last[-1].data
        assert queued.task == rollout.task and queued.group_id == rollout.group_id and queued.managed
        assert (queued.split, queued.sample_index, queued.model) == (rollout.split, rollout.sample_index, "tiny")
        assert started.launcher == "local" and started.worker.startswith("pid ")
        assert finished.by == "controller" and finished.exit_code == 0 and finished.duration_ms >= 0

        # what the agent saw: the rollout-scoped gateway URL, a token for exactly this attempt, the task
        seen = json.loads(finished.stdout_tail)
        env, attempt_id = seen["env"], last[0].attempt_id
        assert env["OPENAI_BASE_URL"] == f"{GATEWAY}/rollouts/{rollout.rollout_id}/attempts/{attempt_id}/v1"
        assert env["AGENTSTREAM_REWARD_URL"] == f"{GATEWAY}/rollouts/{rollout.rollout_id}/reward"
        assert (env["AGENTSTREAM_ROLLOUT_ID"], env["AGENTSTREAM_ATTEMPT_ID"]) == (rollout.rollout_id, attempt_id)
        claims = verify_rollout_token(SECRET, env["OPENAI_API_KEY"])
        assert (claims.rollout_id, claims.attempt_id) == (rollout.rollout_id, attempt_id)
        assert seen["task"] == rollout.task.input and env["AGENTSTREAM_MODEL"] == "tiny"

    groups = {}
    for rollout in controller.plan:
        groups.setdefault(rollout.task.id, set()).add(rollout.group_id)
    assert all(len(ids) == 1 for ids in groups.values()), "samples of one task must share a group"
    assert len({next(iter(ids)) for ids in groups.values()}) == 4
    assert {r.split for r in controller.plan if r.task.id == "held-out"} == {"validation"}


async def test_an_agent_that_always_fails_is_given_up_after_max_attempts(kafka, tmp_path: Path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "bad", "input": {"mode": "fail"}}])
    summary = await Controller(controller_settings(kafka, tasks, tmp_path, max_attempts=3)).run()
    assert (summary.done, summary.failed, summary.exit_code) == (0, 1, 1)
    (tries,) = attempts_of(await read_rollouts(kafka)).values()
    assert [types(t) for t in tries] == [["queued", "started", "failed"]] * 3
    assert [t[-1].data.will_retry for t in tries] == [True, True, False]


async def test_a_hanging_agent_and_its_children_are_killed_at_the_timeout_and_retried(kafka, tmp_path: Path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": "stuck", "input": {"mode": "hang"}}])
    settings = controller_settings(kafka, tasks, tmp_path, timeout_s=3.0, kill_grace_s=0.5, heartbeat_s=0.5)
    summary = await Controller(settings).run()
    assert (summary.done, summary.exit_code) == (1, 0)

    (tries,) = attempts_of(await read_rollouts(kafka)).values()
    first, second = tries
    assert types(first)[:2] == ["queued", "started"] and types(first)[-1] == "timed_out"
    beats = [e.data.elapsed_ms for e in first if e.type == "rollout.heartbeat"]
    assert len(beats) >= 2 and beats == sorted(beats) and beats[-1] <= 3000, beats
    timed_out = first[-1].data
    assert timed_out.will_retry and timed_out.timeout_s == 3.0 and timed_out.duration_ms >= 3000
    assert types(second)[0] == "queued" and types(second)[-1] == "finished"
    assert second[0].data.attempt_number == 2 and second[0].attempt_id != first[0].attempt_id
    assert second[0].rollout_id == first[0].rollout_id

    # the first attempt's agent ignored SIGTERM and so did its child: both were killed anyway
    hung = [line for line in runs_log(tmp_path) if line[1] == first[0].attempt_id]
    (_, _, agent_pid, child_pid), = hung
    wait_for(lambda: not pid_alive(int(agent_pid)) and not pid_alive(int(child_pid)), timeout=10,
             what="the timed-out agent and its child to be gone")


async def test_pacing_holds_launches_until_the_trainer_publishes_a_new_version(kafka, tmp_path: Path):
    producer = make_producer(kafka)
    await producer.start()
    publisher = Publisher(producer, kafka.topics)

    def weights(version: int) -> s.WeightsEvent:
        return s.WeightsEvent(source="trainer", data=s.Weights(model="tiny", version=version, uri="/ckpt", step=version))

    try:
        await publisher.publish(weights(5))
        tasks = write_tasks(tmp_path / "tasks.jsonl", [{"id": f"t{i}", "input": {"mode": "ok"}} for i in range(4)]
                            + [{"id": "v", "input": {"mode": "ok"}, "split": "validation"}])
        settings = controller_settings(kafka, tasks, tmp_path, model="tiny", max_staleness=0, train_batch_size=2,
                                       concurrency=4, shuffle=False)
        controller = Controller(settings)
        run = asyncio.create_task(controller.run())
        # one batch at version 5, then every worker waits for the trainer
        await wait_for_async(lambda: controller.counts.done == 3 and controller.pacer.waiting == 2, timeout=60,
                             what="a batch and the validation rollout done, the rest held")
        assert controller.pacer.admitted == 2 and not run.done()
        await publisher.publish(weights(6))
        summary = await asyncio.wait_for(run, 60)
    finally:
        await producer.stop()
    assert summary.done == 5

    queued = {e.data.task.id: e.data.weight_version for e in await read_rollouts(kafka)
              if isinstance(e, s.RolloutQueuedEvent)}
    assert queued == {"t0": 5, "t1": 5, "t2": 6, "t3": 6, "v": 5}


async def test_a_local_agent_gets_none_of_the_operators_secrets(tmp_path: Path, monkeypatch):
    """The controller's environment is the agent's, except the secrets an agent could act as the operator with."""
    from agentstream.controller.attempt import Attempt, Gateway
    from agentstream.controller.local import LocalLauncher
    from agentstream.controller.tasks import PlannedRollout

    monkeypatch.setenv("AGENTSTREAM_TOKEN_SECRET", "the-signing-secret")
    monkeypatch.setenv("AGENTSTREAM_API_KEYS", "operator-key-1")
    monkeypatch.setenv("HARMLESS_SETTING", "kept")
    rollout = PlannedRollout("0190d0c0-0000-5000-8000-0000000000b1", s.Task(id="t", input={}), "g", "train", 0, 0)
    attempt = Attempt(rollout, "0190d0c0-0000-7000-8000-0000000000b1", 1, None, tmp_path / "attempt")
    launcher = LocalLauncher("env", timeout_s=30, grace_s=1, tail_chars=100_000)
    run = await launcher.launch(attempt, Gateway("http://127.0.0.1:9", "the-signing-secret"))
    assert (await run.wait()).exit_code == 0
    seen, _ = await run.close()
    assert "HARMLESS_SETTING=kept" in seen and "OPENAI_API_KEY=" in seen
    assert "the-signing-secret" not in seen and "operator-key-1" not in seen

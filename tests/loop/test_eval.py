"""`agentstream.eval` against the broker, the streams worker and the controller as real processes: a
rollout the controller gives up is a sample without a reward, counted, and the evaluation still ends."""

from __future__ import annotations

from pathlib import Path

from agentstream.eval import EvalSettings, Evaluator
from tests.support.controller import GATEWAY, SECRET, agent_command, write_tasks
from tests.support.streams import StreamsWorker


async def test_a_rollout_given_up_is_an_unscored_sample_and_the_evaluation_ends(kafka, tmp_path: Path):
    # "fail" exits 1 on every attempt: with one attempt per rollout the controller gives it up and exits 1
    tasks = write_tasks(tmp_path / "validation.jsonl", [{"id": "bad", "input": {"mode": "fail"}},
                                                        {"id": "good", "input": {"mode": "ok"}}])
    settings = EvalSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix, tasks=tasks,
                            agent=agent_command(tmp_path), model="tiny", gateway_url=GATEWAY, token_secret=SECRET,
                            max_attempts=1, out=tmp_path / "eval", settle_timeout_s=60)
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log").start()
    try:
        event = await Evaluator(kafka, settings, say=lambda _: None).evaluate(version=0)
    finally:
        worker.stop()
    assert (event.data.tasks, event.data.samples, event.data.pass_at_1) == (2, 2, 0.0)
    # the good agent finished without a reward (no grader here): unscored too, for its own reason
    assert event.data.unscored == {"failed": 1, "no_reward": 1}
    assert event.data.per_task == {"bad": [None], "good": [None]}

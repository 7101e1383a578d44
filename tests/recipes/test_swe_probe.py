"""Probing: the starting model's attempts on each train task through the recipe's machinery, recorded in
the log, and the task file written with each task's probe; the recipe's choice of tasks from it."""

from __future__ import annotations

import pytest
from rich.console import Console

from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.task_files import select_train


def task(n: int, split: str = "train", solved: int | None = None, k: int = 4) -> Instance:
    extra = {} if solved is None else {"probe": {"k": k, "solved": solved, "model": "m", "version": 0}}
    return Instance(instance_id=f"t{n}", repo="o/r", base_commit="0" * 40, problem_statement="p", patch="",
                    test_patch="", FAIL_TO_PASS=["x"], PASS_TO_PASS=[], split=split, **extra)


def test_the_recipe_trains_on_mixed_results_and_a_share_of_never_solved():
    tasks = ([task(n, solved=n % 3 + 1) for n in range(6)]       # 1..3 of 4: mixed
             + [task(10 + n, solved=0) for n in range(5)]         # never
             + [task(20, solved=4), task(21), task(22, "validation", solved=2)])  # always, unprobed, validation
    selected = select_train(tasks, unsolved_share=0.25)
    ids = [t.instance_id for t in selected.tasks]
    assert ids == [f"t{n}" for n in range(6)] + ["t10", "t11"], ids  # 2 of 8 never-solved: 25 %
    assert (selected.mixed, selected.never, selected.always, selected.unprobed) == (6, 5, 1, 1)
    assert [t.instance_id for t in select_train(tasks, 0.0).tasks] == [f"t{n}" for n in range(6)]
    assert select_train([task(1, solved=0)], 0.5).tasks == [], "never-solved tasks alone give GRPO no signal"
    with pytest.raises(ValueError):
        select_train(tasks, 1.0)


def test_recipe_task_files_from_a_probed_set_hold_the_selection_and_the_validation_tasks(tmp_path):
    import json

    from agentstream.recipes.swe.task_files import probed_task_files
    from agentstream.stack import StackError

    tasks = [task(1, solved=1, k=2), task(2, solved=0, k=2), task(3, solved=2, k=2), task(4, "validation")]
    probed = tmp_path / "probed.jsonl"
    probed.write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    train, validation, instances = probed_task_files(probed, tmp_path / "tasks", 4, 2, 0.5, say=lambda _: None)
    assert [json.loads(line)["id"] for line in train.read_text().splitlines()] == ["t1", "t2"]
    assert [json.loads(line)["id"] for line in validation.read_text().splitlines()] == ["t4"]
    assert all("patch" not in json.loads(line)["input"] for line in train.read_text().splitlines())
    assert len(instances.read_text().splitlines()) == 3

    never = tmp_path / "never.jsonl"
    never.write_text("".join(t.model_dump_json() + "\n" for t in [task(1, solved=0), task(4, "validation")]))
    with pytest.raises(StackError, match="no train task to learn from"):
        probed_task_files(never, tmp_path / "t2", 4, 2, 0.25, say=lambda _: None)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(1200)
async def test_a_probe_of_the_tiny_model_writes_each_train_tasks_pass_rate_and_logs_its_attempts(
        vllm_server, kafka_bootstrap, tmp_path, monkeypatch):
    import asyncio

    from agentstream.recipes.swe.probe import ProbeConfig, run_probe
    from agentstream.schemas.codec import decode
    from agentstream.schemas.events import EvalEvent, TrajectoryEvent
    from agentstream.schemas.kafka import KafkaSettings
    from agentstream.schemas.scan import scan
    from agentstream.stack.vllm import running_servers

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    name = next(n for n, state in running_servers().items() if state.url == vllm_server.url)
    out = tmp_path / "probe-ci"
    config = ProbeConfig(model="tiny", base_model=vllm_server.model_dir, vllm_name=name, keep_stack=True, k=2,
                         train_tasks=1, validation_tasks=1, step_limit=2, max_tokens=16, concurrency=2,
                         attempt_timeout_s=180, out=out, probed_out=tmp_path / "probed.jsonl")
    result = await asyncio.to_thread(run_probe, config, Console(width=160))

    rows = [Instance.model_validate_json(line) for line in config.probed_out.read_text().splitlines()]
    train = [r for r in rows if r.split == "train"]
    assert train and all(r.model_extra["probe"]["k"] == 2 and r.model_extra["probe"]["model"] == "tiny" for r in train)
    assert all("probe" not in (r.model_extra or {}) for r in rows if r.split == "validation"), "validation was probed"
    # the tiny model never fixes a bug: every probed task is never-solved, so nothing is selected
    assert result["attempts"] == 2 * len(train) and result["solved_at_least_once"] == 0
    assert result["never"] == len(train) and select_train(rows).tasks == []

    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"{out.name}.")
    events = []
    for topic in (kafka.topics.metrics, kafka.topics.trajectories):
        async for batch in scan(kafka, topic):
            events += [decode(record.value) for record in batch]
    probes = [e for e in events if isinstance(e, EvalEvent)]
    assert len(probes) == 1 and probes[0].data.run_id.startswith("probe-tiny-v0")
    trajectories = [e for e in events if isinstance(e, TrajectoryEvent)]
    assert len(trajectories) == 2 * len(train) and {t.data.split for t in trajectories} == {"train"}

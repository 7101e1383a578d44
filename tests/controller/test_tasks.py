"""Task files and the run's plan: formats, errors, groups, epochs, seeded shuffling, splits."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from agentstream.controller.tasks import TaskFileError, derive_run_id, load_task_set, load_tasks, plan_rollouts
from tests.support.controller import write_tasks

ROWS = [
    {"id": "a", "input": {"q": "1+1", "tools": ["calc"]}, "metadata": {"answer": "2"}, "reward_fn": "m:exact"},
    {"id": 7, "input": "plain text"},
    {"id": "c", "input": {"other": True}, "split": "validation"},
]


def test_jsonl_keeps_every_input_exactly_as_written(tmp_path: Path):
    tasks = load_tasks(write_tasks(tmp_path / "t.jsonl", ROWS))
    assert [(t.task.id, t.task.input, t.split) for t in tasks] == [
        ("a", {"q": "1+1", "tools": ["calc"]}, "train"), ("7", "plain text", "train"),
        ("c", {"other": True}, "validation")]
    assert tasks[0].task.metadata == {"answer": "2"} and tasks[0].task.reward_fn == "m:exact"
    assert tasks[1].task.metadata == {} and tasks[1].task.reward_fn is None


def test_parquet_is_read_with_polars(tmp_path: Path):
    path = tmp_path / "t.parquet"
    pl.DataFrame({
        "id": ["p1", "p2"],
        "input": [{"q": "2*3", "n": 1}, {"q": "4-1", "n": 2}],
        "metadata": [json.dumps({"answer": "6"}), json.dumps({"answer": "3"})],
        "reward_fn": ["m:f", None],
        "split": ["train", "validation"],
    }).write_parquet(path)
    tasks = load_tasks(path)
    assert [(t.task.id, t.task.input, t.task.metadata, t.task.reward_fn, t.split) for t in tasks] == [
        ("p1", {"q": "2*3", "n": 1}, {"answer": "6"}, "m:f", "train"),
        ("p2", {"q": "4-1", "n": 2}, {"answer": "3"}, None, "validation")]


@pytest.mark.parametrize("content, message", [
    ('{"id": "a", "input": 1}\n{not json}\n', "t.jsonl:2: not JSON"),
    ('{"id": "a", "input": 1}\n[1, 2]\n', "t.jsonl:2: a task is a JSON object"),
    ('{"input": 1}\n', "line 1: every task needs an id"),
    ('{"id": "a"}\n', "task 'a' has no input"),
    ('{"id": "a", "input": 1, "answer": 2}\n', "unknown field(s) ['answer']"),
    ('{"id": "a", "input": 1, "split": "test"}\n', "split is 'test'"),
    ('{"id": "a", "input": 1, "reward_fn": "exact"}\n', "not of the form 'module:function'"),
    ('{"id": "a", "input": 1, "metadata": [1]}\n', "metadata"),
    ('{"id": "a", "input": 1}\n{"id": "a", "input": 2}\n', "task id 'a' appears more than once"),
    ("\n", "no tasks in the file"),
])
def test_bad_task_files_get_errors_that_name_the_problem(tmp_path: Path, content: str, message: str):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(TaskFileError, match=None) as error:
        load_tasks(path)
    assert message in str(error.value)


def test_unknown_file_type_and_missing_file(tmp_path: Path):
    (tmp_path / "t.csv").write_text("id,input\n")
    with pytest.raises(TaskFileError, match=r"use \.jsonl or \.parquet"):
        load_tasks(tmp_path / "t.csv")
    with pytest.raises(TaskFileError, match="no such task file"):
        load_tasks(tmp_path / "missing.jsonl")


def test_validation_file_stays_apart_from_training(tmp_path: Path):
    train = write_tasks(tmp_path / "train.jsonl", [{"id": "a", "input": 1}, {"id": "b", "input": 2}])
    held = write_tasks(tmp_path / "val.jsonl", [{"id": "v", "input": 3}])
    items = load_task_set(train, held)
    assert [(t.task.id, t.split) for t in items] == [("a", "train"), ("b", "train"), ("v", "validation")]
    clash = write_tasks(tmp_path / "clash.jsonl", [{"id": "b", "input": 9}])
    with pytest.raises(TaskFileError, match=r"task ids in both .* \['b'\]"):
        load_task_set(train, clash)


def test_plan_groups_samples_shuffles_with_a_seed_and_keeps_splits(tmp_path: Path):
    rows = [{"id": f"t{i}", "input": i} for i in range(6)] + [{"id": "v", "input": 0, "split": "validation"}]
    tasks = load_tasks(write_tasks(tmp_path / "t.jsonl", rows))
    plan = plan_rollouts("run-x", tasks, samples=3, validation_samples=1, epochs=2, shuffle=True, seed=1)
    assert len(plan) == 2 * (6 * 3 + 1)
    assert len({r.rollout_id for r in plan}) == len(plan)
    for epoch in (0, 1):
        rollouts = [r for r in plan if r.epoch == epoch]
        train = [r for r in rollouts if r.split == "train"]
        assert [r.split for r in rollouts][-1] == "validation"  # validation runs after the epoch's training
        for i in range(0, len(train), 3):  # a group's samples are launched together and share a group id
            group = train[i:i + 3]
            assert {r.task.id for r in group} == {group[0].task.id} and [r.sample_index for r in group] == [0, 1, 2]
            assert len({r.group_id for r in group}) == 1

    def order(epoch: int) -> list[str]:
        return [r.task.id for r in plan if r.epoch == epoch and r.sample_index == 0 and r.split == "train"]

    assert sorted(order(0)) == [f"t{i}" for i in range(6)]
    assert order(0) != order(1), "each epoch should be shuffled differently"
    groups = {(r.task.id, r.epoch): r.group_id for r in plan}
    assert groups[("t0", 0)] != groups[("t0", 1)], "a group is one task in one epoch"

    again = plan_rollouts("run-x", tasks, samples=3, validation_samples=1, epochs=2, shuffle=True, seed=1)
    assert again == plan, "the same run plans the same rollout ids in the same order"
    other_seed = plan_rollouts("run-x", tasks, samples=3, validation_samples=1, epochs=2, shuffle=True, seed=2)
    assert [r.task.id for r in other_seed] != [r.task.id for r in plan]
    assert {r.rollout_id for r in other_seed} == {r.rollout_id for r in plan}, "ids depend on the run, not the order"
    unshuffled = plan_rollouts("run-x", tasks, samples=1, validation_samples=1, epochs=1, shuffle=False, seed=0)
    assert [r.task.id for r in unshuffled] == [f"t{i}" for i in range(6)] + ["v"]


def test_run_id_follows_the_tasks_and_the_plan_settings(tmp_path: Path):
    path = write_tasks(tmp_path / "t.jsonl", [{"id": "a", "input": 1}])
    base = derive_run_id([path, None], samples=2, epochs=1)
    assert derive_run_id([path, None], samples=2, epochs=1) == base
    assert derive_run_id([path, None], samples=3, epochs=1) != base
    write_tasks(path, [{"id": "a", "input": 2}])
    assert derive_run_id([path, None], samples=2, epochs=1) != base

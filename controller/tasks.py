"""Task files in, the run's rollouts out.

A task file is JSONL or Parquet with the columns `id`, `input`, and optionally `reward_fn`,
`metadata` and `split` ("train" or "validation"). Parquet is read with polars. JSONL is parsed
line by line with orjson rather than polars' NDJSON reader, because that reader unifies nested
values across rows (an object missing a key gets the key as null; mixed types become strings),
which would change what the agent is asked; line-wise parsing keeps every input exactly as
written and lets errors name the line.

The plan is deterministic: the run id comes from the files' content and the planning settings,
and each rollout id from (run, split, task, epoch, sample), so a restarted controller maps every
task to the same rollout and can tell from the log what is already done.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import polars as pl
from pydantic import ValidationError

from agentstream.schemas.errors import ConfigurationError
from agentstream.schemas.events import Task
from agentstream.schemas.ids import derived_id

Split = Literal["train", "validation"]
SPLITS: tuple[Split, ...] = ("train", "validation")
COLUMNS = ("id", "input", "reward_fn", "metadata", "split")


class TaskFileError(ConfigurationError):
    """The task file cannot be used; the message names the file, the row and the fix."""


@dataclass(frozen=True)
class SplitTask:
    task: Task
    split: Split


@dataclass(frozen=True)
class PlannedRollout:
    rollout_id: str
    task: Task
    group_id: str
    split: Split
    epoch: int
    sample_index: int


def load_tasks(path: Path, split: Split | None = None) -> list[SplitTask]:
    """Every task in `path`; `split` forces the split of all of them (a validation file)."""
    if not path.is_file():
        raise TaskFileError(f"{path}: no such task file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows = _jsonl_rows(path)
    elif suffix in (".parquet", ".pq"):
        rows = _parquet_rows(path)
    else:
        raise TaskFileError(f"{path}: unknown task file type {suffix!r}; use .jsonl or .parquet")
    tasks = [_task(path, where, row, split) for where, row in rows]
    if not tasks:
        raise TaskFileError(f"{path}: no tasks in the file")
    _check_unique(tasks, path)
    return tasks


def _jsonl_rows(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise TaskFileError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise TaskFileError(f"{path}:{number}: a task is a JSON object, got {type(row).__name__}")
            yield f"line {number}", row


def _parquet_rows(path: Path) -> Iterable[tuple[str, dict[str, Any]]]:
    try:
        frame = pl.read_parquet(path)
    except Exception as exc:  # polars raises several types for unreadable files
        raise TaskFileError(f"{path}: not a readable Parquet file ({exc})") from None
    frame = frame.select([name for name in frame.columns if name in COLUMNS])
    for number, row in enumerate(frame.iter_rows(named=True)):
        if isinstance(row.get("metadata"), str):  # metadata stored as JSON text
            try:
                row["metadata"] = orjson.loads(row["metadata"])
            except orjson.JSONDecodeError:
                raise TaskFileError(f"{path}: row {number}: metadata is a string but not JSON") from None
        yield f"row {number}", {key: value for key, value in row.items() if value is not None}


def _task(path: Path, where: str, row: dict[str, Any], split: Split | None) -> SplitTask:
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise TaskFileError(f"{path}: {where}: unknown field(s) {sorted(unknown)}; a task has {list(COLUMNS)} "
                            "(put anything else under metadata)")
    if "id" not in row or row["id"] in ("", None):
        raise TaskFileError(f"{path}: {where}: every task needs an id")
    if "input" not in row:
        raise TaskFileError(f"{path}: {where}: task {row['id']!r} has no input")
    row_split = row.pop("split", None) or "train"
    if row_split not in SPLITS:
        raise TaskFileError(f"{path}: {where}: split is {row_split!r}; use 'train' or 'validation'")
    reward_fn = row.get("reward_fn")
    if reward_fn is not None and (not isinstance(reward_fn, str) or ":" not in reward_fn):
        raise TaskFileError(f"{path}: {where}: reward_fn {reward_fn!r} is not of the form 'module:function'")
    if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)):
        raise TaskFileError(f"{path}: {where}: id must be a string or an integer, got {row['id']!r}")
    try:
        task = Task(**{**row, "id": str(row["id"])})
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(part) for part in first["loc"])
        raise TaskFileError(f"{path}: {where}: {field}: {first['msg']}") from None
    return SplitTask(task, split or row_split)


def _check_unique(tasks: list[SplitTask], path: Path) -> None:
    seen: set[str] = set()
    for item in tasks:
        if item.task.id in seen:
            raise TaskFileError(f"{path}: task id {item.task.id!r} appears more than once; ids must be unique")
        seen.add(item.task.id)


def load_task_set(tasks: Path, validation_tasks: Path | None = None) -> list[SplitTask]:
    """Both files; a task id may not appear in both (validation stays apart from training)."""
    items = load_tasks(tasks)
    if validation_tasks is not None:
        extra = load_tasks(validation_tasks, split="validation")
        shared = {t.task.id for t in items} & {t.task.id for t in extra}
        if shared:
            raise TaskFileError(f"task ids in both {tasks} and {validation_tasks}: {sorted(shared)[:5]}; "
                                "train and validation tasks must be distinct")
        items += extra
    return items


def derive_run_id(files: Iterable[Path | None], **planning: Any) -> str:
    """A name for the run that changes when the tasks or the plan change, and only then."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes() if path is not None else b"-")
        digest.update(b"\x00")
    digest.update(orjson.dumps(planning, option=orjson.OPT_SORT_KEYS))
    return f"run-{digest.hexdigest()[:16]}"


def plan_rollouts(
    run_id: str, tasks: list[SplitTask], samples: int, validation_samples: int, epochs: int, shuffle: bool, seed: int,
) -> list[PlannedRollout]:
    """Every rollout of the run in launch order.

    Per epoch: the train tasks (shuffled with a seed derived from `seed` and the epoch), each
    task's samples next to each other so a group completes together; then the validation tasks,
    in file order.
    """
    train = [t.task for t in tasks if t.split == "train"]
    validation = [t.task for t in tasks if t.split == "validation"]
    plan: list[PlannedRollout] = []
    for epoch in range(epochs):
        order = list(train)
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        plan += _group_rollouts(run_id, order, "train", samples, epoch)
        plan += _group_rollouts(run_id, validation, "validation", validation_samples, epoch)
    return plan


def _group_rollouts(run_id: str, tasks: list[Task], split: Split, samples: int, epoch: int) -> list[PlannedRollout]:
    out = []
    for task in tasks:
        group_id = derived_id(run_id, "group", split, task.id, str(epoch))
        for sample in range(samples):
            rollout_id = derived_id(run_id, "rollout", split, task.id, str(epoch), str(sample))
            out.append(PlannedRollout(rollout_id, task, group_id, split, epoch, sample))
    return out

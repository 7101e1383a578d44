"""The coding recipe's task files: built (bugs injected into a pinned package, once per AGENTSTREAM_HOME), or
chosen from a probed set (`recipes.swe.probe`): the controller's train and validation files, whose input is only
the instance id and the problem statement, the grader's instances file and the harness's index."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentstream.recipes.swe.instance import Instance
from agentstream.stack import StackError

Say = Callable[[str], None]


def build_recipe_tasks(out: Path, train: int, validation: int, say: Say = print) -> tuple[Path, Path, Path]:
    """Build (once per AGENTSTREAM_HOME) bugs in the pinned package; write the controller's task files,
    whose input is only the instance id and the problem statement, and the grader's instances file."""
    from agentstream.recipes.swe import build
    from agentstream.recipes.swe.split import split_by_site
    from agentstream.settings import agentstream_home

    cache = agentstream_home() / "swe" / f"recipe-tasks-{train + validation}-by-site.jsonl"
    if cache.exists():
        instances = read_instances(cache)
    else:
        say(f"building {train + validation} tasks (bugs injected into toolz, each checked by the real grader; once)")
        instances = build.build(limit=train + validation).instances
        if split_by_site(instances, "file").problem:
            # a handful of bugs may all sit in one file: then no file, but still no function, is shared
            split = split_by_site(instances, "function")
            say(f"the {len(instances)} tasks' bugs sit in one file: split by function instead ({split.summary()})")
            for instance in instances:
                instance.split = split.splits[instance.instance_id]
        build.write(instances, cache)
    chosen = ([i for i in instances if i.split == "train"][:train] +
              [i for i in instances if i.split == "validation"][:validation])
    if not any(i.split == "validation" for i in chosen) or not any(i.split == "train" for i in chosen):
        raise StackError(f"the task set {cache} has no train or no validation task (its bugs all sit in one "
                         "function); remove it and ask for more tasks")
    return write_task_files(chosen, out)


def read_instances(path: Path) -> list[Instance]:
    return [Instance.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


def write_task_files(chosen: list[Instance], out: Path) -> tuple[Path, Path, Path]:
    """The controller's train and validation task files, the grader's instances file and the harness's
    index, for the chosen instances. A task row is `Instance.rollout_task`: input only the instance id and
    the problem statement; metadata the repository and base commit, which name a per-repo image
    (`--k8s-image reg/swe-{repo_slug}:1`)."""
    from agentstream.recipes.swe import build
    from agentstream.recipes.swe.workspace import write_index

    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in ("train", "validation"):
        rows = [{**i.rollout_task().model_dump(mode="json", exclude_none=True), "split": split}
                for i in chosen if i.split == split]
        files[split] = out / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    instances_file = out / "instances.jsonl"
    build.write(chosen, instances_file)
    write_index(chosen, out / "index.jsonl")
    return files["train"], files["validation"], instances_file


# --- choosing train tasks from a probe (`recipes.swe.probe`) -----------------------------------


def probe_of(instance: Instance) -> dict[str, Any] | None:
    probe: dict[str, Any] | None = (instance.model_extra or {}).get("probe")
    return probe


@dataclass
class Selection:
    tasks: list[Instance]
    mixed: int
    never: int
    always: int
    unprobed: int

    def summary(self) -> str:
        return (f"{self.mixed} train tasks with mixed results, {self.never} never solved, {self.always} always "
                f"solved, {self.unprobed} not probed; selected {len(self.tasks)}")


def select_train(instances: list[Instance], unsolved_share: float = 0.25) -> Selection:
    """The train tasks worth a GRPO group: every one the probe solved sometimes, plus never-solved ones up
    to `unsolved_share` of the selection (in file order); always-solved and unprobed ones are left out."""
    if not 0 <= unsolved_share < 1:
        raise ValueError(f"unsolved_share must be in [0, 1), got {unsolved_share}")
    mixed, never, always, unprobed = [], [], [], 0
    for instance in (i for i in instances if i.split == "train"):
        probe = probe_of(instance)
        if not probe:
            unprobed += 1
        elif probe["solved"] == 0:
            never.append(instance)
        elif probe["solved"] >= probe["k"]:
            always.append(instance)
        else:
            mixed.append(instance)
    extra = math.floor(unsolved_share * len(mixed) / (1 - unsolved_share) + 1e-9)
    return Selection(mixed + never[:extra], len(mixed), len(never), len(always), unprobed)


def probed_task_files(probed: Path, out: Path, train: int, validation: int, unsolved_share: float,
                      say: Say = print) -> tuple[Path, Path, Path]:
    """Task files from a probed task set (`agentstream tasks swe probe`): the train tasks the starting
    model solved sometimes (GRPO's signal) plus a share of never-solved ones, and validation tasks."""
    instances = read_instances(probed)
    selected = select_train(instances, unsolved_share)
    chosen = selected.tasks[:train] + [i for i in instances if i.split == "validation"][:validation]
    say(f"probed tasks in {probed}: {selected.summary()}; training on {min(train, len(selected.tasks))}")
    if not any(i.split == "train" for i in chosen) or not any(i.split == "validation" for i in chosen):
        raise StackError(f"{probed} gives no train task to learn from or no validation task ({selected.summary()}): "
                         "probe with a larger -k, raise --unsolved-share, or warm-start with `--loss sft`")
    return write_task_files(chosen, out)

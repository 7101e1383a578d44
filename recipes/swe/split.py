"""The train/validation split by bug site: no validation bug sits where a training bug does.

A split by task id hash lets a model be validated on a bug in the very function it was trained to fix
(two mutations of one function are two tasks): its validation pass rate then measures memory of that
function, not repair. Here tasks are grouped by where their bug sits, and whole groups go to one side:

- `file` (the default): the files the gold patch changes (every SWE-bench instance has them), so no
  file holding a validation bug holds a training bug, and so no function either;
- `function`: the function the bug was injected into (`mutation.path` + `mutation.function`, which the
  local builder records), so no function holding a validation bug holds a training bug; an instance
  without that record falls back to its files.

Tasks whose sites overlap are one group (a patch touching two files joins their groups). Groups are
taken in the order of a stable hash of their sites into validation while they fit under
`validation_share` of the tasks, then the smallest remaining ones until at least `minimum` are (a task
set whose bugs all sit in one group cannot be split: everything stays train, and `SiteSplit.problem`
says so). Same instances → same split, whatever their order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from agentstream.recipes.swe.diffs import touched
from agentstream.recipes.swe.instance import VALIDATION_SHARE, Instance

Level = Literal["file", "function"]
SplitName = Literal["train", "validation"]


def bug_sites(instance: Instance, level: Level = "file") -> set[str]:
    """Where the instance's bug sits: its gold patch's files, or the injected function."""
    mutation = (instance.model_extra or {}).get("mutation") or {}
    if level == "function" and mutation.get("path") and mutation.get("function"):
        return {f"{mutation['path']}::{mutation['function']}"}
    files = touched(instance.patch)
    if mutation.get("path"):
        files.add(mutation["path"])
    return files or {f"instance:{instance.instance_id}"}  # no site known: a group of its own


@dataclass
class SiteSplit:
    splits: dict[str, SplitName]
    groups: list[list[str]] = field(default_factory=list)
    """instance ids per group of overlapping sites, in the order they were considered"""
    sites: dict[SplitName, set[str]] = field(default_factory=dict)

    def count(self, split: SplitName) -> int:
        return sum(s == split for s in self.splits.values())

    @property
    def problem(self) -> str | None:
        if self.splits and not self.count("validation"):
            return (f"the {len(self.splits)} tasks' bugs sit in {len(self.groups)} group(s) of sites: no validation "
                    "task can be held out without sharing a site with a training task")
        return None

    def summary(self) -> str:
        return (f"{self.count('train')} train tasks ({len(self.sites.get('train', ()))} sites), "
                f"{self.count('validation')} validation ({len(self.sites.get('validation', ()))} sites)")


def split_by_site(instances: Iterable[Instance], level: Level = "file", validation_share: float = VALIDATION_SHARE,
                  minimum: float = 0.2) -> SiteSplit:
    instances = list(instances)
    sites = {i.instance_id: bug_sites(i, level) for i in instances}
    groups = _overlapping(sites)
    groups.sort(key=lambda ids: hashlib.sha256("\n".join(sorted(set().union(*(sites[i] for i in ids)))).encode())
                .hexdigest())
    n = len(instances)
    target, floor = math.floor(validation_share * n), math.ceil(minimum * n)
    chosen: list[int] = []
    size = 0
    for index, ids in enumerate(groups):
        if size + len(ids) <= target and len(chosen) < len(groups) - 1:  # leave at least one group to train on
            chosen.append(index)
            size += len(ids)
    for index in sorted((i for i in range(len(groups)) if i not in chosen), key=lambda i: len(groups[i])):
        if size >= floor or len(chosen) >= len(groups) - 1:
            break
        chosen.append(index)
        size += len(groups[index])
    splits: dict[str, SplitName] = {}
    for index, ids in enumerate(groups):
        for instance_id in ids:
            splits[instance_id] = "validation" if index in chosen else "train"
    by_split: dict[SplitName, set[str]] = {"train": set(), "validation": set()}
    for instance_id, split in splits.items():
        by_split[split] |= sites[instance_id]
    return SiteSplit(splits, [sorted(ids) for ids in groups], by_split)


def _overlapping(sites: dict[str, set[str]]) -> list[list[str]]:
    """Instance ids grouped so that two instances sharing a site are in one group (union-find)."""
    parent = {i: i for i in sites}

    def root(i: str) -> str:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, str] = {}
    for instance_id in sorted(sites):
        for site in sorted(sites[instance_id]):
            if site in owner:
                parent[root(instance_id)] = root(owner[site])
            else:
                owner[site] = instance_id
    groups: dict[str, list[str]] = {}
    for instance_id in sorted(sites):
        groups.setdefault(root(instance_id), []).append(instance_id)
    return list(groups.values())


def leaks(instances: Iterable[Instance], level: Level = "file") -> set[str]:
    """The sites that hold both a validation and a training bug (empty for a split that means something)."""
    found: dict[SplitName, set[str]] = {"train": set(), "validation": set()}
    for instance in instances:
        found[instance.split] |= bug_sites(instance, level)
    return found["train"] & found["validation"]

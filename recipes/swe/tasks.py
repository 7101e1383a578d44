"""Task files: SWE-bench instances, one JSON object a line, checked whole before anything runs.

A SWE-smith, SWE-Gym or SWE-bench file loads unchanged (their extra fields are kept; FAIL_TO_PASS
and PASS_TO_PASS may be JSON text, as SWE-bench publishes them). A file with any bad line is refused
with every bad line's number and reason: not JSON, a missing or mistyped field, a repeated
instance_id, a repository not in the repos directory, a base commit that repository lacks, a patch or
test patch that does not apply onto the base commit, no FAIL_TO_PASS test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.task_errors import InstanceFileError, Problem

__all__ = ["InstanceFileError", "Problem", "by_id", "load"]
from agentstream.recipes.swe.repos import check_patches, has_commit, repo_path, slug


def load(path: Path, repos_dir: Path, check_apply: bool = True) -> list[Instance]:
    """Every instance of the file, or InstanceFileError naming every bad line. A Harbor task folder (or a
    folder of them) loads too (`recipes.swe.harbor`): its environment is committed under `repos_dir`."""
    from agentstream.recipes.swe.harbor import is_harbor_dir, load_harbor

    if path.is_dir():
        if not is_harbor_dir(path):
            raise InstanceFileError(path, [Problem(0, "a folder, but no task.toml in it nor in a folder inside it: "
                                                      "neither an SWE-bench file nor a Harbor task folder")])
        return load_harbor(path, repos_dir)
    instances: list[Instance] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, instance_or_problem in _parse(path):
        if isinstance(instance_or_problem, str):
            problems.append(Problem(number, instance_or_problem))
            continue
        instance = instance_or_problem
        reason = _check(instance, repos_dir, check_apply) if instance.instance_id not in seen else (
            f"instance_id {instance.instance_id!r} repeats line {seen[instance.instance_id]}")
        seen.setdefault(instance.instance_id, number)
        if reason:
            problems.append(Problem(number, reason))
        else:
            instances.append(instance)
    if problems:
        raise InstanceFileError(path, problems)
    if not instances:
        raise InstanceFileError(path, [Problem(0, "no tasks in the file")])
    return instances


def _parse(path: Path) -> Iterator[tuple[int, Instance | str]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, f"not JSON ({exc.msg} at column {exc.colno})"
                continue
            if not isinstance(obj, dict):
                yield number, f"a task is a JSON object, got {type(obj).__name__}"
                continue
            try:
                yield number, Instance.model_validate(obj)
            except ValidationError as exc:
                yield number, "; ".join(_field_error(e) for e in exc.errors(include_url=False)[:3])


def _field_error(error: ErrorDetails) -> str:
    field = ".".join(str(part) for part in error["loc"]) or "task"
    return f"{field}: missing" if error["type"] == "missing" else f"{field}: {error['msg']}"


def _check(instance: Instance, repos_dir: Path, check_apply: bool) -> str | None:
    from agentstream.recipes.swe.harbor import harbor_spec

    if (harbor := harbor_spec(instance)) is not None:  # a Harbor task loaded earlier (an instances file)
        if not (harbor.tests / "test.sh").is_file():
            return f"harbor.task_dir: {harbor.tests / 'test.sh'} is missing (the task folder moved?)"
        if not has_commit(repo_path(repos_dir, instance.repo), instance.base_commit):
            return (f"base_commit {instance.base_commit} is not in {repo_path(repos_dir, instance.repo)}: load the "
                    f"Harbor task folder {harbor.task_dir} again")
        return None
    if not instance.FAIL_TO_PASS:
        return "FAIL_TO_PASS is empty: a task needs at least one test the fix makes pass"
    repo = repo_path(repos_dir, instance.repo)
    if not (repo / "HEAD").exists() and not (repo / ".git").exists():
        return (f"unknown repo {instance.repo!r}: no git repository at {repo} "
                f"(clone it there as {slug(instance.repo)}, or build local tasks with `agentstream tasks swe build`)")
    if not has_commit(repo, instance.base_commit):
        return f"base_commit {instance.base_commit} is not in {repo}"
    if check_apply:
        if reason := check_patches(repo, instance.base_commit, instance.patch):
            return f"patch: {reason.removeprefix('patch 1 ')}"
        if reason := check_patches(repo, instance.base_commit, instance.test_patch):
            return f"test_patch: {reason.removeprefix('patch 1 ')}"
    return None


def by_id(instances: list[Instance]) -> dict[str, Instance]:
    return {instance.instance_id: instance for instance in instances}

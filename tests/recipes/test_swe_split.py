"""The split by bug site: no file (or function) holds both a validation and a training bug, whatever the
order of the tasks; overlapping patches join their groups; an unsplittable set says so; the CLI re-splits
a task file and reports each split's size."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from agentstream.cli import app
from agentstream.recipes.swe.instance import Instance, assign_splits
from agentstream.recipes.swe.split import bug_sites, leaks, split_by_site

# files with functions, and how many bugs each function holds: lopsided, as in a real package
LAYOUT = {"toolz/itertoolz.py": {"groupby": 4, "take": 3, "nth": 2, "unique": 2, "pluck": 1, "join": 3},
          "toolz/functoolz.py": {"curry": 3, "compose": 2, "memoize": 1},
          "toolz/dicttoolz.py": {"merge": 2, "assoc": 1},
          "toolz/recipes.py": {"countby": 1},
          "toolz/sandbox/core.py": {"unzip": 1}}


def patch_of(*paths: str) -> str:
    return "".join(f"diff --git a/{p} b/{p}\n--- a/{p}\n+++ b/{p}\n@@ -1 +1 @@\n-x\n+y\n" for p in paths)


def instance(n: int, path: str, function: str, *more_paths: str) -> Instance:
    return Instance(instance_id=f"pypi__toolz-1.2.0.flip_operator__{n:08x}", repo="pypi/toolz", base_commit="0" * 40,
                    problem_statement="p", patch=patch_of(path, *more_paths), test_patch="", FAIL_TO_PASS=["t"],
                    PASS_TO_PASS=[], mutation={"kind": "flip_operator", "path": path, "line": 1, "function": function})


def task_set() -> list[Instance]:
    found, n = [], 0
    for path, functions in LAYOUT.items():
        for function, bugs in functions.items():
            for _ in range(bugs):
                found.append(instance(n, path, function))
                n += 1
    return found


def with_splits(instances: list[Instance], splits: dict[str, str]) -> list[Instance]:
    return [i.model_copy(update={"split": splits[i.instance_id]}) for i in instances]


def test_no_file_holds_both_a_validation_and_a_training_bug():
    instances = task_set()
    # the id hash split puts bugs of one function on both sides
    hashed = with_splits(instances, assign_splits([i.instance_id for i in instances]))
    assert leaks(hashed, "function"), "the old split leaked no function: this set would not show the difference"

    result = split_by_site(instances, "file")
    split = with_splits(instances, result.splits)
    assert not leaks(split, "file") and not leaks(split, "function")
    validation = result.count("validation")
    assert 0.2 * len(instances) <= validation <= 0.5 * len(instances), result.summary()
    assert result.count("train") + validation == len(instances)
    assert result.sites["validation"] and not result.sites["validation"] & result.sites["train"]
    assert split_by_site(list(reversed(instances)), "file").splits == result.splits, "the order of the tasks changed it"


def test_by_function_no_function_is_shared_and_files_may_be():
    instances = task_set()
    result = split_by_site(instances, "function")
    split = with_splits(instances, result.splits)
    assert not leaks(split, "function")
    assert 0.2 * len(instances) <= result.count("validation") <= 0.25 * len(instances) + 1
    assert bug_sites(instances[0], "function") == {"toolz/itertoolz.py::groupby"}
    assert bug_sites(instances[0], "file") == {"toolz/itertoolz.py"}


def test_a_patch_across_two_files_joins_their_groups():
    instances = [instance(0, "a.py", "f"), instance(1, "b.py", "g"), instance(2, "a.py", "h", "b.py"),
                 instance(3, "c.py", "k"), instance(4, "d.py", "m")]
    result = split_by_site(instances, "file")
    joined = [group for group in result.groups if len(group) == 3]
    assert joined and {result.splits[i] for i in joined[0]} in ({"train"}, {"validation"})
    assert not leaks(with_splits(instances, result.splits), "file")


def test_a_set_whose_bugs_share_one_file_cannot_be_split_by_file():
    instances = [instance(n, "toolz/itertoolz.py", f"f{n}") for n in range(5)]
    result = split_by_site(instances, "file")
    assert result.count("validation") == 0 and "no validation task" in (result.problem or "")
    by_function = split_by_site(instances, "function")
    assert by_function.count("validation") >= 1 and by_function.problem is None


def test_the_cli_splits_a_task_file_and_counts_each_split(tmp_path):
    source, out = tmp_path / "tasks.jsonl", tmp_path / "split.jsonl"
    instances = task_set()
    source.write_text("".join(i.model_dump_json() + "\n" for i in instances))
    result = CliRunner().invoke(app, ["tasks", "swe", "split", str(source), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    validation = sum(r["split"] == "validation" for r in rows)
    said = " ".join(result.output.split())  # the console wraps a long path wherever the terminal width says
    assert f"{len(rows) - validation} train tasks" in said and f"{validation} validation" in said
    assert not leaks([Instance.model_validate(r) for r in rows], "file")

    same_file = tmp_path / "one.jsonl"
    same_file.write_text("".join(instance(n, "x.py", f"f{n}").model_dump_json() + "\n" for n in range(3)))
    result = CliRunner().invoke(app, ["tasks", "swe", "split", str(same_file), "--out", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "no validation task" in result.output

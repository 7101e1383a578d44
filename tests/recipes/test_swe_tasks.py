"""Task files are checked whole (line and reason for each bad line); the builder on the pinned toolz."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from agentstream.recipes.swe import repos
from agentstream.recipes.swe.build import (
    TOOLZ,
    SuiteRun,
    _junit_key,
    build,
    hide_tests,
    library_frames,
    problem_statement,
    write,
)
from agentstream.recipes.swe.grader import Grader
from agentstream.recipes.swe.instance import assign_splits, split_of
from agentstream.recipes.swe.mutate import mutations
from agentstream.recipes.swe.tasks import InstanceFileError, load
from tests.support.swe import LIMIT, built


@pytest.fixture(scope="module")
def task_set():
    return built()


SHORT_TRACEBACK = """toolz/tests/test_itertoolz.py:533: in test_topk
    assert topk(2, [4, 1, 5, 2], key=lambda x: -x) == (1, 2)
toolz/itertoolz.py:987: in topk
    return tuple(heapq.nlargest(k, seq, key=key))
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
/usr/lib/python3.11/heapq.py:565: in nlargest
    result = [(key(elem), i, elem) for i, elem in zip(range(0, -n, -1), it)]
toolz/conftest.py:3: in key
    return 1
E   TypeError: 'int' object is not subscriptable"""


def test_a_problem_statement_shows_where_the_library_raised_never_a_test_or_the_standard_library():
    frames = library_frames(SHORT_TRACEBACK, {"toolz/tests/test_itertoolz.py"})
    assert frames == ["toolz/itertoolz.py, line 987, in topk", "  return tuple(heapq.nlargest(k, seq, key=key))"]
    assert library_frames(SHORT_TRACEBACK.replace("toolz/itertoolz.py", "toolz/tests/test_helpers.py"),
                          {"toolz/tests/test_itertoolz.py"}) == []


def test_a_report_shared_by_tests_of_one_name_is_shown_once(tmp_path):
    """A test inherited by one class per mapping type fails alike in each: one report, with its count."""
    repo = tmp_path / "repo"
    (repo / "toolz" / "tests").mkdir(parents=True)
    (repo / "toolz" / "tests" / "test_m.py").write_text(
        "class TestA:\n    def test_f(self):\n        assert f() == 1\n\nclass TestB(TestA):\n    pass\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "tests"], check=True)
    pristine = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    failing = [f"toolz/tests/test_m.py::{name}" for name in ("TestA::test_f", "TestB::test_f", "test_g")]
    messages = {_junit_key(test): "NameError: name 'kye' is not defined" for test in failing[:2]}
    run = SuiteRun({}, {**messages, _junit_key(failing[2]): "ValueError: bad"}, {}, "")
    text = problem_statement(TOOLZ, failing, run, repo, pristine)
    assert text.count("NameError") == 1 and "test_f (2 checks):\n" in text and "test_g:\n    ValueError" in text
    assert "3 check(s)" in text and "not shown" not in text


def _write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _corrupt(patch: str) -> str:
    """The patch with the first line it expects to find (context or removed) changed: it no longer applies."""
    lines = patch.splitlines(keepends=True)
    hunk = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    at = next(i for i in range(hunk + 1, len(lines)) if lines[i].startswith((" ", "-")) and lines[i].strip(" -\n"))
    lines[at] = lines[at].rstrip("\n") + "  # not in the file\n"
    return "".join(lines)


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_a_bad_file_is_refused_whole_with_each_line_and_reason(task_set, tmp_path):
    result, repos_dir = task_set
    good = result.instances[0].model_dump(mode="json")
    missing = {k: v for k, v in good.items() if k != "test_patch"}
    unknown = {**good, "instance_id": "x-2", "repo": "nobody/nothing"}
    no_commit = {**good, "instance_id": "x-3", "base_commit": "0" * 40}
    bad_patch = {**good, "instance_id": "x-4", "patch": _corrupt(good["patch"])}
    bad_tests = {**good, "instance_id": "x-5", "test_patch": _corrupt(good["test_patch"])}
    rows = [good, missing, "{not json", unknown, no_commit, bad_patch, bad_tests, [1, 2], good]
    path = _write_lines(tmp_path / "tasks.jsonl", rows)
    with pytest.raises(InstanceFileError) as caught:
        load(path, repos_dir)
    reasons = {p.line: p.reason for p in caught.value.problems}
    assert set(reasons) == {2, 3, 4, 5, 6, 7, 8, 9}, reasons
    assert reasons[2] == "test_patch: missing"
    assert reasons[3].startswith("not JSON")
    assert "unknown repo 'nobody/nothing'" in reasons[4] and "nobody__nothing" in reasons[4]
    assert "base_commit 0000" in reasons[5]
    assert reasons[6].startswith("patch: does not apply")
    assert reasons[7].startswith("test_patch: does not apply")
    assert "JSON object" in reasons[8]
    assert "repeats line 1" in reasons[9]
    assert "line 4: unknown repo" in str(caught.value)


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_a_swe_bench_row_loads_unchanged(task_set, tmp_path):
    result, repos_dir = task_set
    row = result.instances[0].model_dump(mode="json")
    # SWE-bench publishes the test lists as JSON text and carries fields of its own; no split
    row.update(FAIL_TO_PASS=json.dumps(row["FAIL_TO_PASS"]), PASS_TO_PASS=json.dumps(row["PASS_TO_PASS"]),
               version="1.2", created_at="2024-01-01T00:00:00Z", hints_text="")
    row.pop("split")
    (instance,) = load(_write_lines(tmp_path / "swebench.jsonl", [row]), repos_dir)
    assert instance.FAIL_TO_PASS == result.instances[0].FAIL_TO_PASS
    assert instance.split == "train" and instance.model_extra["version"] == "1.2"
    assert set(instance.agent_task()) == {"instance_id", "problem_statement"}


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_the_builder_makes_tasks_whose_gold_passes_and_whose_bug_fails(task_set):
    result, repos_dir = task_set
    assert len(result.instances) == LIMIT
    grader = Grader(repos_dir=repos_dir)
    for instance in result.instances:
        repo = repos.repo_path(repos_dir, instance.repo)
        # the agent's workspace (the base commit) does not hold the hidden tests
        for test in instance.FAIL_TO_PASS:
            path, name = test.split("::")[0], test.split("::")[-1].split("[")[0]
            assert f"def {name}(" not in repos.read(repo, instance.base_commit, path)
            assert f"def {name}(" in instance.test_patch
        assert not any(line.startswith(("+def test", "-def test")) for line in instance.patch.splitlines())
        # the problem statement is the tests' output, never a line of their code
        test_code = {line[1:].strip() for line in instance.test_patch.splitlines()
                     if line.startswith("+") and len(line.strip()) > 8}
        assert not any(line.strip() in test_code for line in instance.problem_statement.splitlines())
        gold = grader.grade(instance, instance.patch)
        assert gold.reward == 1.0, gold.details
        broken = grader.grade(instance, "")
        assert broken.reward == 0.0
        assert broken.details["fail_to_pass"]["passed"] == 0, broken.details
        assert broken.details["pass_to_pass"]["passed"] == broken.details["pass_to_pass"]["total"]


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_a_second_build_gives_the_same_tasks_ids_commits_and_split(task_set, tmp_path):
    result, _ = task_set
    again = build(limit=LIMIT, seed=0, repos_dir=tmp_path / "repos", workers=1)
    first = [(i.instance_id, i.base_commit, i.split, i.patch, i.FAIL_TO_PASS) for i in result.instances]
    second = [(i.instance_id, i.base_commit, i.split, i.patch, i.FAIL_TO_PASS) for i in again.instances]
    assert first == second
    out = tmp_path / "tasks.jsonl"
    write(again.instances, out)
    assert [i.instance_id for i in load(out, tmp_path / "repos")] == [i.instance_id for i in again.instances]


def test_the_split_is_a_stable_hash_with_at_least_a_fifth_for_validation():
    ids = [f"pypi__toolz-1.2.0.off_by_one__{n:08x}" for n in range(200)]
    splits = assign_splits(ids)
    assert splits == assign_splits(list(reversed(ids)))
    assert sum(s == "validation" for s in splits.values()) >= 40
    assert all(splits[i] == "validation" for i in ids if split_of(i) == "validation")
    few = assign_splits(ids[:5])
    assert sum(s == "validation" for s in few.values()) >= 1


def test_mutations_are_single_edits_that_compile():
    source = "def f(a, b):\n    if a < b and b:\n        return a - b\n    return a + 1\n"
    found = mutations("m.py", source)
    kinds = {m.kind for m in found}
    assert {"flip_operator", "off_by_one", "change_operator", "drop_branch", "swap_operands"} <= kinds
    edited = {m.apply(source) for m in found}
    assert "def f(a, b):\n    if a >= b and b:\n        return a - b\n    return a + 1\n" in edited
    assert "def f(a, b):\n    if a < b and b:\n        return b - a\n    return a + 1\n" in edited
    assert all(m.apply(source).count("\n") <= source.count("\n") for m in found)


def test_a_misspelled_name_is_a_read_of_a_local_that_nothing_defines():
    source = ("import os\n\ndef f(seq, key=None):\n    out = [k for k in seq]\n    return f'{key}', os.sep, out, len(seq)\n")
    found = [m for m in mutations("m.py", source) if m.kind == "misspell_name"]
    assert {(m.original, m.replacement) for m in found} == {("seq", "sqe"), ("out", "otu"), ("k", "kk"), ("key", "kye")}
    assert "    out = [k for k in sqe]\n" in {m.apply(source).splitlines(keepends=True)[3] for m in found}
    for mutation in found:
        with pytest.raises(NameError, match=mutation.replacement):
            namespace: dict[str, object] = {}
            exec(mutation.apply(source), namespace)
            namespace["f"]([1])  # type: ignore[operator]


def test_hiding_tests_removes_functions_with_their_decorators():
    source = ("import pytest\n\n@pytest.mark.parametrize('x', [1])\ndef test_a(x):\n    assert x\n\n"
              "def test_b():\n    pass\n\nclass TestC:\n    def test_c(self):\n        assert 1\n")
    hidden = hide_tests(source, {"test_a", "TestC::test_c"})
    assert "test_a" not in hidden and "parametrize" not in hidden and "def test_b" in hidden
    assert "class TestC:\n    pass\n" in hidden
    compile(hidden, "x", "exec")

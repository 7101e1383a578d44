"""The expert's answers (recipes/swe/expert.py): read where the report points, change one line with sed, submit;
or, for a fix of several lines, hunks or files, replace each exact block with a Python heredoc, file by file.

The commands are run for real (bash, python3) on the buggy source: the sed must turn the bug's line into the fix's
and touch nothing else, whatever characters the line holds; the heredocs must give exactly the fixed files.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from agentstream.recipes.swe.expert import SUBMIT, Budget, changed_part, one_line_fix, python_literal, reading_start
from agentstream.recipes.swe.expert import answers as expert_answers
from agentstream.recipes.swe.hunks import Change, NotDemonstrable, file_changes
from agentstream.recipes.swe.instance import Instance

PATCH = """diff --git a/pkg/mod.py b/pkg/mod.py
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -3,4 +3,4 @@ def f(key, items):
     total = 0
     for item in items:
-        total += kye(item)
+        total += key(item)
     return total
"""


def test_a_one_line_patch_gives_its_file_line_and_both_texts():
    fix = one_line_fix(PATCH)
    assert (fix.path, fix.line, fix.old, fix.new) == ("pkg/mod.py", 5, "        total += kye(item)",
                                                      "        total += key(item)")


def test_a_patch_of_several_lines_is_not_demonstrated():
    with pytest.raises(NotDemonstrable, match="not one line"):
        one_line_fix(PATCH.replace("+        total += key(item)\n", "+        total += key(item)\n+        pass\n"))


@pytest.mark.parametrize(("old", "new"), [
    ("        total += kye(item)", "        total += key(item)"),
    ("    rightkey = getter(rightkye)", "    rightkey = getter(rightkey)"),
    ("    return a[i] * b", "    return a[i] // b"),
    ("    if x.y <= 3 and s == '&/\\\\':", "    if x.y < 3 and s == '&/\\\\':"),
    ("    d = dd + d", "    d = d + d"),
    ("    return n + 1", "    return n - 1"),
])
def test_the_sed_edit_turns_the_line_into_the_fix_and_nothing_else(tmp_path: Path, monkeypatch, old: str, new: str):
    source = f"def f():\n    pass\n{old}\n{old}\n"
    (tmp_path / "pkg").mkdir()
    target = tmp_path / "pkg" / "mod.py"
    target.write_text(source)
    patch = f"--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -3,1 +3,1 @@\n-{old}\n+{new}\n"
    instance = Instance(instance_id="t", repo="r/r", base_commit="c", problem_statement="p", patch=patch,
                        test_patch="", FAIL_TO_PASS=["t"], PASS_TO_PASS=[])
    found = changed_part(old, new)
    assert old.replace(found[0], found[1], 1) == new
    # the file at the base commit, without a repository
    monkeypatch.setattr("agentstream.recipes.swe.expert.read", lambda repo, commit, path: source)
    edit = expert_answers(instance, tmp_path)[1]
    command = re.search(r"```mswea_bash_command\n(.*)\n```", edit, re.DOTALL)
    assert command
    subprocess.run(["bash", "-c", command.group(1)], cwd=tmp_path, check=True, capture_output=True)
    assert target.read_text() == f"def f():\n    pass\n{new}\n{old}\n", "line 3 fixed, its twin on line 4 not"


def test_reading_starts_at_the_enclosing_def_when_it_is_close():
    source = "import x\n\n\ndef f(a):\n    b = 1\n    return a\n"
    assert reading_start(source, 6) == 4
    far = "def g():\n" + "    x = 1\n" * 40 + "    return x\n"
    assert reading_start(far, 42) == 42 - 30


def test_a_validation_task_is_never_demonstrated(tmp_path: Path):
    instance = Instance(instance_id="v", repo="r/r", base_commit="c", problem_statement="p", patch=PATCH,
                        test_patch="", FAIL_TO_PASS=["t"], PASS_TO_PASS=[], split="validation")
    with pytest.raises(NotDemonstrable, match="validation"):
        expert_answers(instance, tmp_path)


# --- fixes of several lines, hunks and files: blocks replaced by a Python heredoc (recipes/swe/hunks.py) -------

CLAMP = """\
def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def total(items):
    result = 0
    for item in items:
        result += item
    return result


def mean(items):
    if not items:
        return 0.0
    return total(items) / len(items)
"""
MULTI_LINE_BUGS = {
    # drop_branch: an `if` and its body gone, a `pass` where they were (`pass` alone occurs nowhere else here)
    "dropped branch": {"calc.py": CLAMP.replace("    if x > high:\n        return high\n", "    pass\n")},
    # two bugs far apart in one file: two blocks, one script
    "two hunks": {"calc.py": CLAMP.replace("result += item", "result -= item").replace("return 0.0", "return 1.0")},
    # lines only removed, lines only added, a condition over two lines
    "lines added and removed": {"calc.py": CLAMP.replace("    if not items:\n        return 0.0\n", "").replace(
        "    if x < low:\n", "    if (x\n            < low):\n        x = x\n")},
    # two files, and a block that needs lines around it to occur once (`return x` also closes clamp)
    "two files": {"calc.py": CLAMP.replace("    return x\n", "    return x + 0\n    return x\n"),
                  "util.py": "def double(x):\n    return x\n\n\ndef half(x):\n    return x\n"},
}
FIXED_UTIL = "def double(x):\n    return 2 * x\n\n\ndef half(x):\n    return x / 2\n"


def commit_both(repos: Path, buggy: dict[str, str], fixed: dict[str, str], name: str = "demo__multi") -> tuple[Path, str, str]:
    """A repository under `repos` whose base commit holds the buggy files; its checkout, base commit, and the
    gold patch (base → fixed) as `git diff` writes it."""
    repo = repos / name
    repo.mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)

    def commit(files: dict[str, str]) -> str:
        for path, text in files.items():
            (repo / path).write_text(text)
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", "c"], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()

    base = commit(buggy)
    commit(fixed)
    patch = subprocess.run([*git, "diff", base, "HEAD"], check=True, capture_output=True, text=True).stdout
    subprocess.run([*git, "checkout", "-q", base], check=True)
    return repo, base, patch


def fixed_files(buggy: dict[str, str]) -> dict[str, str]:
    return {path: CLAMP if path == "calc.py" else FIXED_UTIL for path in buggy}


def commands(texts: list[str]) -> list[str]:
    found = [re.search(r"```mswea_bash_command\n(.*)\n```", text, re.DOTALL) for text in texts]
    assert all(found), texts
    return [match.group(1) for match in found if match]


@pytest.mark.parametrize("bug", list(MULTI_LINE_BUGS))
def test_the_block_edits_turn_each_file_into_the_fixed_one(tmp_path: Path, bug: str):
    buggy = MULTI_LINE_BUGS[bug]
    repo, base, patch = commit_both(tmp_path, buggy, fixed_files(buggy))
    instance = Instance(instance_id=f"demo.{bug}", repo="demo/multi", base_commit=base, problem_statement="p",
                        patch=patch, test_patch="", FAIL_TO_PASS=["t"], PASS_TO_PASS=[])

    texts = expert_answers(instance, tmp_path)

    steps = commands(texts)
    assert len(steps) == 2 * len(buggy) + 1 and steps[-1] == SUBMIT
    for step in steps[:-1]:
        done = subprocess.run(["bash", "-c", step], cwd=repo, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert {path: (repo / path).read_text() for path in buggy} == fixed_files(buggy)
    edits = [step for step in steps if step.startswith("python3 - <<'EOF' && nl -ba ")]
    assert len(edits) == len(buggy) and all("assert source.count(old) == 1" in edit for edit in edits)


def test_a_block_that_does_not_occur_once_any_more_stops_the_script(tmp_path: Path):
    """The script checks before it writes: run on a file where the block is gone, it fails and leaves it as it was."""
    buggy = MULTI_LINE_BUGS["dropped branch"]
    repo, base, patch = commit_both(tmp_path, buggy, fixed_files(buggy))
    instance = Instance(instance_id="demo.x", repo="demo/multi", base_commit=base, problem_statement="p",
                        patch=patch, test_patch="", FAIL_TO_PASS=["t"], PASS_TO_PASS=[])
    edit = commands(expert_answers(instance, tmp_path))[1]
    (repo / "calc.py").write_text(CLAMP)
    done = subprocess.run(["bash", "-c", edit], cwd=repo, capture_output=True, text=True)
    assert done.returncode != 0 and "AssertionError" in done.stderr and (repo / "calc.py").read_text() == CLAMP


@pytest.mark.parametrize("text", ["x = '\\\\d+'\n", "s = '''a'''\n", 'doc = """b"""\n', "end = 'q'\n"])
def test_a_literal_holds_the_code_as_it_is(text: str):
    namespace: dict[str, str] = {}
    exec(f"value = {python_literal(text)}", namespace)
    assert namespace["value"] == text


@pytest.mark.parametrize(("patch", "reason"), [
    ("diff --git a/a.bin b/a.bin\nBinary files a/a.bin and b/a.bin differ\n", "binary"),
    ("diff --git a/a.py b/b.py\nsimilarity index 90%\nrename from a.py\nrename to b.py\n", "rename"),
    ("diff --git a/n.py b/n.py\nnew file mode 100644\n--- /dev/null\n+++ b/n.py\n@@ -0,0 +1 @@\n+x = 1\n",
     "new-or-deleted-file"),
    ("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n\\ No newline at end of file\n+x = 2\n", "no-final-newline"),
])
def test_what_a_shell_edit_cannot_show_is_refused_with_its_reason(tmp_path: Path, patch: str, reason: str):
    instance = Instance(instance_id="r", repo="r/r", base_commit="c", problem_statement="p", patch=patch.replace(
        "-x = 1\n", "-x = 1\n-y = 1\n"), test_patch="", FAIL_TO_PASS=["t"], PASS_TO_PASS=[])
    with pytest.raises(NotDemonstrable) as refused:
        expert_answers(instance, tmp_path)
    assert refused.value.reason == reason


def test_answers_over_the_models_budget_are_refused(tmp_path: Path):
    buggy = MULTI_LINE_BUGS["two files"]
    _, base, patch = commit_both(tmp_path, buggy, fixed_files(buggy))
    instance = Instance(instance_id="demo.x", repo="demo/multi", base_commit=base, problem_statement="p",
                        patch=patch, test_patch="", FAIL_TO_PASS=["t"], PASS_TO_PASS=[])
    assert len(expert_answers(instance, tmp_path, Budget(10_000, len, max_answers=5))) == 5
    with pytest.raises(NotDemonstrable) as refused:
        expert_answers(instance, tmp_path, Budget(200, len))
    assert refused.value.reason == "over-max-tokens"
    with pytest.raises(NotDemonstrable) as refused:
        expert_answers(instance, tmp_path, Budget(10_000, len, max_answers=4))
    assert refused.value.reason == "over-step-limit"


def test_the_changes_are_read_as_runs_of_lines_at_their_place():
    patch = ("--- a/m.py\n+++ b/m.py\n@@ -2,4 +2,5 @@ def f():\n a\n-b\n+B\n c\n+d\n e\n"
             "@@ -0,0 +10,1 @@\n+top\n")
    assert file_changes(patch) == {"m.py": [Change(2, ("b\n",), ("B\n",)), Change(4, (), ("d\n",)),
                                            Change(0, (), ("top\n",))]}


@pytest.mark.slow  # two sandboxes and a grading (a test venv made on first use)
def test_a_demonstration_of_two_files_and_several_hunks_passes_the_hidden_tests(tmp_path: Path):
    """The expert's commands run in the real sandbox on the base commit, as the harness runs them; the diff they
    leave is graded 1 by the real grader (hidden tests of both files), and a half-done fix is graded 0."""
    from agentstream.recipes.swe.grader import Grader
    from agentstream.sandbox.contract import SandboxSpec
    from agentstream.sandbox.local import LocalSandbox
    from tests.support.swe import prepare_workspace, workspace_diff

    buggy = {"calc.py": MULTI_LINE_BUGS["dropped branch"]["calc.py"],
             "util.py": "def double(x):\n    return x\n\n\n" + "def noop(x):\n    return x\n" * 3 + "\n\ndef half(x):\n    return x\n"}
    fixed = {"calc.py": CLAMP, "util.py": buggy["util.py"].replace("def double(x):\n    return x\n", "def double(x):\n    return 2 * x\n")
             .replace("def half(x):\n    return x\n", "def half(x):\n    return x / 2\n")}
    repo, base, patch = commit_both(tmp_path / "repos", buggy, fixed)
    assert patch.count("\n@@ ") + patch.startswith("@@ ") >= 3, "two files, one of them in two hunks"
    checks = "from calc import clamp\nfrom util import double, half\n\n\ndef test_fixed():\n" \
             "    assert clamp(5, 0, 3) == 3 and double(2) == 4 and half(4) == 2\n"
    test_patch = "--- /dev/null\n+++ b/tests/test_fixed.py\n@@ -0,0 +1,6 @@\n" + "".join(f"+{line}\n" for line in checks.splitlines())
    instance = Instance(instance_id="demo.multi", repo="demo/multi", base_commit=base, problem_statement="p",
                        patch=patch, test_patch=test_patch, FAIL_TO_PASS=["tests/test_fixed.py::test_fixed"],
                        PASS_TO_PASS=[])
    steps = commands(expert_answers(instance, tmp_path / "repos"))
    grader = Grader(repos_dir=tmp_path / "repos", envs_dir=tmp_path / "envs")

    def graded(commands_run: list[str], name: str) -> float:
        workspace, git_dir = tmp_path / name / "workspace", tmp_path / name / "agent.git"
        prepare_workspace(repo, base, workspace, git_dir)
        with LocalSandbox(SandboxSpec(workspace=workspace)) as box:
            for command in commands_run:
                assert box.run(command).ok, command
        return grader.grade(instance, workspace_diff(workspace, git_dir)).reward

    assert graded(steps[:-1], "whole") == 1.0
    assert graded(steps[:2], "calc-only") == 0.0

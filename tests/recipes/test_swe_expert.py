"""The expert's answers (recipes/swe/expert.py): read where the report points, change one line with sed, submit.

The sed command is run for real on the buggy source: it must turn the bug's line into the fix's, and touch
nothing else, whatever characters the line holds.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from agentstream.recipes.swe.expert import NotDemonstrable, changed_part, one_line_fix, reading_start
from agentstream.recipes.swe.expert import answers as expert_answers
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

"""Adversaries against the grader: each a diff, graded by the real Grader (bubblewrap, git, pytest in the
task's venv) on a one-file task whose bug is `add` subtracting. Each attack leaves the bug in place
and tries to be paid anyway, or to reach the host; each must score 0 (or have its change refused by a
named rule) and be flagged, the host's canary files and the grader's uid leases untouched. An honest fix
graded after them still scores 1."""

from __future__ import annotations

import asyncio
import json
import os
import py_compile
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest

from agentstream.recipes.swe.build import write
from agentstream.recipes.swe.grade_service import GradeService, GradeSettings
from agentstream.recipes.swe.grader import Grader
from agentstream.recipes.swe.instance import Instance
from agentstream.sandbox.local import STATE_DIR
from agentstream.schemas.codec import decode
from agentstream.schemas.events import DeadletterEvent, RewardEvent, RolloutDiff, RolloutDiffEvent
from agentstream.schemas.kafka import Publisher, make_consumer, make_producer
from tests.support.swe import HONEST, make_repo
from tests.support.wait import wait_for_async

pytestmark = pytest.mark.slow  # each attack is graded by the real grader: git, and pytest in bubblewrap
F2P = "tests/test_calc.py::test_add"
P2P = "tests/test_calc.py::test_add_zero"
TESTS = ("from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n    assert add(2, 2) == 4\n\n\n"
         "def test_add_zero():\n    assert add(5, 0) == 5\n")


def new_file(path: str, text: str, mode: str = "100644") -> str:
    lines = text.splitlines(keepends=True)
    body = "".join("+" + line for line in lines)
    if not text.endswith("\n"):
        body += "\n\\ No newline at end of file\n"
    return (f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


def replace_calc(text: str) -> str:
    """A diff that makes calc.py `text` (it was the buggy two-line add)."""
    lines = text.splitlines(keepends=True)
    return ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
            f"@@ -1,2 +1,{len(lines)} @@\n-def add(a, b):\n-    return a - b\n" + "".join("+" + line for line in lines))


class Task:
    def __init__(self, root: Path):
        self.repos = root / "repos"
        self.commit = make_repo(self.repos)
        self.repo = self.repos / "demo__calc"
        self.instance = Instance(instance_id="calc-attacks", repo="demo/calc", base_commit=self.commit,
                                 problem_statement="add() subtracts", patch=HONEST, test_patch=new_file("tests/test_calc.py", TESTS),
                                 FAIL_TO_PASS=[F2P], PASS_TO_PASS=[P2P])
        self.canary = root / "canary"
        self.canary.mkdir()
        (self.canary / "keep.txt").write_text("host data\n")
        self.grader = Grader(repos_dir=self.repos)

    def git_diff(self, files: dict[str, bytes], attributes: str = "") -> str:
        """The diff git itself writes (`--binary`) for `files` written over a clone of the base commit."""
        with tempfile.TemporaryDirectory() as scratch:
            subprocess.run(["git", "clone", "-q", str(self.repo), scratch], check=True)
            if attributes:
                Path(scratch, ".git", "info", "attributes").write_text(attributes)
            for name, data in files.items():
                Path(scratch, name).parent.mkdir(parents=True, exist_ok=True)
                Path(scratch, name).write_bytes(data)
            subprocess.run(["git", "-C", scratch, "add", "-A"], check=True)
            return subprocess.run(["git", "-C", scratch, "diff", "--cached", "--binary"], check=True,
                                  capture_output=True, text=True).stdout

    def grade(self, diff: str):
        result = self.grader.grade(self.instance, diff)
        assert (self.canary / "keep.txt").read_text() == "host data\n", "the host's canary file changed"
        assert sorted(p.name for p in self.canary.iterdir()) == ["keep.txt"], "the host's canary folder changed"
        leases = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{fd}")]
        assert not [p for p in leases if p.startswith(str(STATE_DIR / "uids"))], "a uid lease was kept"
        return result


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return Task(tmp_path_factory.mktemp("calc"))


@pytest.fixture(autouse=True)
def scratch_here(tmp_path, monkeypatch):
    """Each grading's scratch folder under this test's tmp_path, so we can see it is gone afterwards."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield
    # tempfile.tempdir is process-wide: the session's tiny-model build (a background thread, tests/conftest.py)
    # can put torch's inductor cache here while a grading runs; that one is not the grading's
    left = [p for p in folder.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], "a grading left its scratch folder behind"


def refused(result) -> dict[str, str]:
    return {r["path"]: r["rule"] for r in result.details["refused"]}


def assert_zero_and_flagged(result, *flags: str) -> None:
    assert result.reward == 0.0, result.details
    assert result.details["flagged"], result.details
    for flag in flags:
        assert flag in result.details["flags"], (flag, result.details["flags"])


# --- changes the policy refuses --------------------------------------------------------------------

PYTEST_CONFIGS = {
    "pytest.toml": '[pytest]\naddopts = ["-p", "no:python"]\n',
    ".pytest.toml": '[pytest]\npython_functions = ["nothing"]\n',
    "pytest.ini": "[pytest]\npython_functions = nothing\n",
    ".pytest.ini": "[pytest]\npython_functions = nothing\n",
    "tox.ini": "[pytest]\npython_functions = nothing\n",
    "setup.cfg": "[tool:pytest]\npython_functions = nothing\n",
    "pyproject.toml": '[tool.pytest.ini_options]\npython_functions = "nothing"\n',
    "tests/conftest.py": "import calc\ncalc.add = lambda a, b: a + b\n",
}


def test_every_pytest_configuration_file_is_refused(task):
    result = task.grade("".join(new_file(path, text) for path, text in PYTEST_CONFIGS.items()))
    assert_zero_and_flagged(result, "refused:test-config")
    assert refused(result) == {p: "test-config" for p in PYTEST_CONFIGS}
    assert result.details["fail_to_pass"]["failed"] == {F2P: "FAILED"}


def test_a_patch_smuggled_inside_another_files_part_is_seen_as_git_applies_it(task):
    smuggled = ("diff --git a/notes.txt b/notes.txt\nnew file mode 100644\n--- /dev/null\n+++ b/notes.txt\n"
                "@@ -0,0 +1 @@\n+hello\n"
                "--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1,2 @@\n+import calc\n+calc.add = lambda a, b: a + b\n")
    result = task.grade(smuggled)
    assert refused(result) == {"conftest.py": "test-config"}
    assert_zero_and_flagged(result, "refused:test-config")


def test_a_plugin_autoloaded_through_package_metadata_is_refused(task):
    plugin = "import calc\ncalc.add = lambda a, b: a + b\n"
    diff = (new_file("calc_plugin.py", plugin) + new_file("calc_plugin-1.0.dist-info/entry_points.txt",
                                                          "[pytest11]\ncalc = calc_plugin\n")
            + new_file("calc_plugin-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: calc-plugin\nVersion: 1.0\n")
            + new_file("calc_plugin.egg-info/entry_points.txt", "[pytest11]\ncalc = calc_plugin\n"))
    result = task.grade(diff)
    assert set(refused(result).values()) == {"package-metadata"} and len(refused(result)) == 3
    assert_zero_and_flagged(result, "refused:package-metadata")


@pytest.mark.parametrize("spelling", ["120000", "0120000", "00120000"])
def test_a_symlink_in_any_spelling_is_refused_and_the_host_is_untouched(task, spelling):
    """The old grader matched one spelling and restored the hidden tests' paths through the link, as root."""
    into_the_tests = task.grade(new_file("calc_link.py", str(task.canary / "keep.txt"), mode=spelling)
                                + new_file("tests/test_calc.py", str(task.canary), mode=spelling))
    assert refused(into_the_tests) == {"calc_link.py": "symlink", "tests/test_calc.py": "symlink"}
    assert_zero_and_flagged(into_the_tests, "refused:symlink")
    as_the_tests_folder = task.grade(new_file("tests", str(task.canary), mode=spelling))
    assert refused(as_the_tests_folder) == {"tests": "symlink"}
    assert_zero_and_flagged(as_the_tests_folder, "refused:symlink")


def test_a_mode_change_startup_hooks_and_shadowing_modules_are_refused(task):
    diff = ("diff --git a/calc.py b/calc.py\nold mode 100644\nnew mode 100755\n"
            + new_file("easy.pth", "import calc; calc.add = lambda a, b: a + b\n")
            + new_file("sitecustomize.py", "import calc\n") + new_file("json.py", "x = 1\n")
            + new_file(".gitattributes", "tests/* export-ignore\n")
            + new_file("run.py", "print(1)\n", mode="100755"))
    result = task.grade(diff)
    assert refused(result) == {"calc.py": "mode", "easy.pth": "startup-hook", "sitecustomize.py": "startup-hook",
                               "json.py": "shadows-module", ".gitattributes": "git-metadata", "run.py": "mode"}
    assert_zero_and_flagged(result, "refused:mode", "refused:startup-hook")


def test_an_unchecked_hash_pyc_is_refused(task, tmp_path):
    fixed = tmp_path / "calc.py"
    fixed.write_text("def add(a, b):\n    return a + b\n")
    pyc = tmp_path / "calc.pyc"
    py_compile.compile(str(fixed), cfile=str(pyc), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    diff = task.git_diff({"__pycache__/calc.cpython-311.pyc": pyc.read_bytes(), "calc.pyc": pyc.read_bytes()})
    assert "GIT binary patch" in diff
    result = task.grade(diff)
    assert refused(result) == {"__pycache__/calc.cpython-311.pyc": "compiled", "calc.pyc": "compiled"}
    assert_zero_and_flagged(result, "refused:compiled")


def test_source_sent_as_a_git_binary_patch_is_refused(task):
    diff = task.git_diff({"calc.py": b"def add(a, b):\n    return a + b\n"}, attributes="*.py binary\n")
    assert "GIT binary patch" in diff and "+    return a + b" not in diff
    result = task.grade(diff)
    assert refused(result) == {"calc.py": "binary-patch"}
    assert_zero_and_flagged(result, "refused:binary-patch")


def test_a_file_where_the_tests_folder_goes_is_the_diffs_fault_and_the_fix_beside_it_counts(task):
    alone = task.grade(new_file("tests", "not a folder\n"))
    assert refused(alone) == {"tests": "hidden-test"} and alone.reward == 0.0 and alone.details["flagged"]
    assert alone.details["fail_to_pass"]["failed"] == {F2P: "FAILED"}  # graded, not a crash nor the task's fault
    with_fix = task.grade(HONEST + new_file("tests", "not a folder\n"))
    assert with_fix.reward == 1.0 and refused(with_fix) == {"tests": "hidden-test"}, with_fix.details


def test_a_quoted_path_with_a_control_character_is_refused(task):
    quoted = ('diff --git "a/calc\\nhelper.py" "b/calc\\nhelper.py"\nnew file mode 100644\n--- /dev/null\n'
              '+++ "b/calc\\nhelper.py"\n@@ -0,0 +1 @@\n+x = 1\n')
    result = task.grade(quoted)
    assert refused(result) == {"calc\nhelper.py": "bad-path"}
    assert_zero_and_flagged(result, "refused:bad-path")


def test_paths_outside_the_tree_do_not_apply(task):
    result = task.grade(new_file("../outside.py", "x = 1\n"))
    assert result.reward == 0.0 and "does not apply" in result.details["error"]


# --- code that runs in the test process ------------------------------------------------------------

@pytest.mark.parametrize("call, status", [("pytest.xfail('no')", "XFAIL"), ("pytest.skip('no')", "SKIPPED")])
def test_pytest_xfail_or_skip_from_library_code_is_not_a_pass(task, call, status):
    result = task.grade(replace_calc(f"def add(a, b):\n    import pytest\n    {call}\n"))
    assert result.details["fail_to_pass"]["failed"] == {F2P: status}
    assert_zero_and_flagged(result, "pytest")


FORGED = f"PASSED {F2P}"


def test_passed_lines_forged_after_the_summary_are_not_read(task):
    code = f"import atexit\natexit.register(print, '\\n{FORGED}\\n{FORGED}')\n\ndef add(a, b):\n    return a - b\n"
    result = task.grade(replace_calc(code))
    assert result.details["fail_to_pass"]["failed"] == {F2P: "FAILED"}
    assert_zero_and_flagged(result, "atexit")


def test_passed_lines_forged_inside_a_repr_with_a_control_character_are_not_read(task):
    code = (f"class Sum(int):\n    def __repr__(self):\n        return '1\\x1c{FORGED}\\x1c'\n\n"
            "def add(a, b):\n    return Sum(a - b)\n")
    result = task.grade(replace_calc(code))
    assert result.details["fail_to_pass"]["failed"] == {F2P: "FAILED"}
    assert_zero_and_flagged(result, "dunder-override")


def test_output_written_to_the_saved_stdout_before_os_exit_is_not_a_verdict(task):
    verdict = json.dumps({"statuses": {F2P: "PASSED", P2P: "PASSED"}, "consistent": True, "problems": [], "exit_code": 0})
    code = ("import os, sys\n\ndef add(a, b):\n"
            f"    os.write(sys.__stdout__.fileno(), b'\\n{FORGED}\\n\\n@@agentstream-verdict@@ ' + {verdict!r}.encode() + b'\\n')\n"
            "    os._exit(0)\n")
    result = task.grade(replace_calc(code))
    assert result.details["ran"]["consistent"] is False
    assert_zero_and_flagged(result, "process-exit", "output", "outcome-channel")


def test_a_daemon_that_writes_a_verdict_after_the_tests_is_killed_first(task):
    verdict = json.dumps({"statuses": {F2P: "PASSED", P2P: "PASSED"}, "consistent": True, "problems": []})
    code = ("import os, sys, time\n\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3)\n"
            f"    os.write(1, b'\\n@@agentstream-verdict@@ ' + {verdict!r}.encode() + b'\\n')\n    os._exit(0)\n\n"
            "def add(a, b):\n    return a - b\n")
    result = task.grade(replace_calc(code))
    assert result.details["fail_to_pass"]["failed"] == {F2P: "FAILED"}
    assert_zero_and_flagged(result, "process-exit")


def test_records_forged_into_the_outcome_pipe_are_flagged_and_paid_nothing(task):
    """In-process code can write to the reporter's pipe. A forgery of the ids it knows, each phase once, the
    exit status the process then exits with, used to be paid by the channel (graded 1, zeroed only by the
    scan); now the tripwire among the ids is either reported failed (then the exit status 0 does not add up)
    or never reported; or, when the tripwire (a copy of the test: it calls `add` too) runs first, the forgery
    is made inside it and the real test's setup is never reported: graded 0 by the outcomes alone."""
    code = textwrap.dedent(f"""\
        import json, os, sys

        def add(a, b):
            fd = int(sys.argv[1])
            def send(record):
                os.write(fd, json.dumps(record).encode() + b'\\n')
            for when in ('call', 'teardown'):
                send({{'nodeid': {F2P!r}, 'when': when, 'outcome': 'passed', 'xfail': False}})
            for when in ('setup', 'call', 'teardown'):
                send({{'nodeid': {P2P!r}, 'when': when, 'outcome': 'passed', 'xfail': False}})
            send({{'exitstatus': 0}})
            os._exit(0)
        """)
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0, result.details
    assert_zero_and_flagged(result, "process-exit", "output", "runner-env")
    assert {"tripwire", "outcome-channel"} & set(result.details["flags"]) or \
        result.details["fail_to_pass"]["passed"] == 0, result.details


def test_an_always_equal_return_value_is_flagged_and_paid_nothing(task):
    code = ("class Anything:\n    def __eq__(self, other):\n        return True\n\n"
            "def add(a, b):\n    return Anything()\n")
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0  # the tests pass, and so does the tripwire (the test's changed copy)
    assert_zero_and_flagged(result, "tripwire", "always-equal", "dunder-override")
    assert "always-equal" in result.details["penalized_by"]
    assert any(f["flag"] == "always-equal" and f["path"] == "calc.py" and f["line"] == 2
               for f in result.details["findings"])


def test_a_fix_that_only_works_in_the_full_run_fails_the_second_opinion(task):
    code = "import sys\n\ndef add(a, b):\n    return a + b if len(sys.argv) > 5 else a - b\n"
    result = task.grade(replace_calc(code))
    assert result.details["fail_to_pass"]["passed"] == 1  # the first run: all its ids on the command line
    assert result.details["second_opinion"] == {"agreed": False, "statuses": {F2P: "FAILED"}}
    assert_zero_and_flagged(result, "second-opinion")


def test_a_deep_tree_written_by_the_tests_is_cleaned_up_inside_the_sandbox(task):
    code = ("import os\n\ndef add(a, b):\n    here = os.getcwd()\n    os.chdir('/workspace')\n"
            "    for _ in range(3000):\n        os.mkdir('d')\n        os.chdir('d')\n    os.chdir(here)\n"
            "    return a - b\n")
    result = task.grade(replace_calc(code))
    assert result.reward == 0.0 and "error" not in result.details, result.details
    assert result.details["fail_to_pass"]["failed"] == {F2P: "FAILED"}


def test_writing_to_the_host_from_the_tests_is_not_possible(task):
    target = task.canary / "keep.txt"
    code = (f"def add(a, b):\n    for path in ({str(target)!r}, '/etc/agentstream-owned', '/tmp/agentstream-sandbox/x'):\n"
            "        try:\n            open(path, 'w').write('owned')\n        except OSError:\n            pass\n"
            "    return a + b\n")
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 1.0, result.details  # a real fix; its writes went nowhere
    assert result.details["penalized_by"] == ["tamper"]  # the canary's path names pytest's tmp_path
    assert not Path("/etc/agentstream-owned").exists()


# --- the red team of issue 43: reports rewritten, the launcher fought, spellings the scan must see through ---

REWRITE = """
def _rewrite(report_class):
    original = report_class.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.outcome == 'failed':
            self.outcome, self.longrepr = 'passed', None

    report_class.__init__ = init
"""
FIND_REPORTS = {
    "object.__subclasses__": """
def _classes():
    todo, seen = [object], set()
    while todo:
        k = todo.pop()
        if k not in seen:
            seen.add(k)
            todo.extend(type.__subclasses__(k))
    return seen

for _k in _classes():
    if _k.__name__ == 'Test' + 'Report':
        _rewrite(_k)
""",
    "len.__self__": "_rewrite(len.__self__.__import__('_py' + 'test.reports', fromlist=['_']).TestReport)\n",
    "import sys as _r": "import sys as _r\n_rewrite(_r.modules['_py' + 'test.reports'].TestReport)\n",
}


@pytest.mark.parametrize("means", sorted(FIND_REPORTS))
def test_reports_rewritten_to_passed_trip_the_tripwire(task, means):
    """Library code finds pytest's report class (three ways the issue saw paid) and turns every failure into a
    pass: the run stays consistent, the second opinion would agree, and the tripwire, a hidden test that
    must fail, passes too. Graded 0 by the outcomes alone (no penalty needed), and the scan sees the means."""
    code = "def add(a, b):\n    return a - b\n" + REWRITE + FIND_REPORTS[means]
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0, result.details
    assert result.details["tripwire"]["status"] == "PASSED"
    assert_zero_and_flagged(result, "tripwire", "reflection" if "__" in means else "sys-modules")


def test_a_rewrite_for_the_tests_that_call_the_library_trips_the_tripwire_too(task):
    """Reports rewritten only for tests whose source calls the library: the old tripwire (`result = N; assert
    result == M`) did not, and the outcomes said 1 (only the scan saw the means). The tripwire is now the
    FAIL_TO_PASS test's own body with its expected literals changed: it calls the library, its report is
    rewritten as well, and it passes. Graded 0 by the outcomes; the means are flagged as before."""
    code = textwrap.dedent("""\
        import inspect as _i, sys as _r

        def add(a, b):
            return a - b

        _report = _r.modules['_py' + 'test.reports'].TestReport
        _original = _report.from_item_and_call.__func__

        def _from_item_and_call(cls, item, call):
            report = _original(cls, item, call)
            if report.outcome == 'failed' and 'add(' in _i.getsource(item.obj):
                report.outcome, report.longrepr = 'passed', None
            return report

        _report.from_item_and_call = classmethod(_from_item_and_call)
        """)
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0, result.details
    assert result.details["tripwire"]["status"] == "PASSED"
    assert_zero_and_flagged(result, "tripwire", "sys-modules", "pytest", "reflection")


def test_forging_every_id_the_test_process_was_given_trips_the_tripwire(task):
    """The outcome pipe found in /dev/fd with os aliased, a record for every id on the command line (the
    tripwire is one of them, at a random place), the exit status 0: consistent, and the tripwire passed."""
    code = textwrap.dedent("""\
        import json as _j, os as _o, sys as _s

        def add(a, b):
            for name in _o.listdir('/dev/' + 'fd'):
                try:
                    if _o.readlink('/dev/fd/' + name).startswith('pipe:') and int(name) > 2:
                        fd = int(name)
                except OSError:
                    pass
            for test in _s.argv[3:]:
                for when in ('setup', 'call', 'teardown'):
                    _o.write(fd, _j.dumps({'nodeid': test, 'when': when, 'outcome': 'passed', 'xfail': False}).encode() + b'\\n')
            _o.write(fd, b'{"exitstatus": 0}\\n')
            _o._exit(0)
        """)
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0, result.details
    assert_zero_and_flagged(result, "descriptor", "process-exit", "runner-env")
    assert {"tripwire", "outcome-channel"} & set(result.details["flags"]), result.details


VERDICT = json.dumps({"statuses": {F2P: "PASSED", P2P: "PASSED"}, "tripwire": "FAILED", "consistent": True,
                      "problems": [], "exit_code": 0})


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_signalling_the_launcher_then_forging_a_verdict_pays_nothing(task, sig):
    """The issue's attack paid 1 in 3 of 3: SIGINT to the launcher (same uid), a forged verdict frame written
    in a loop so it is the output's last line, exit code 130 ignored. Now the launcher ignores what it can;
    SIGKILL ends it (exit 137: no verdict), and a frame counts only with the HMAC of this run's key."""
    code = textwrap.dedent(f"""\
        import os, signal, time

        def add(a, b):
            for pid in (os.getppid(), 1):
                try:
                    os.kill(pid, signal.{sig})
                except OSError:
                    pass
            frame = b'\\n@@agentstream-verdict@@ ' + {VERDICT!r}.encode() + b'\\n'
            for _ in range(50):
                os.write(1, frame)
                time.sleep(0.005)
            os._exit(0)
        """)
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0, result.details
    assert_zero_and_flagged(result, "process-exit", "outcome-channel")


def test_the_verdict_key_and_the_tripwire_cannot_be_read_from_the_sandbox(task):
    """Where the key and the tripwire's id could be: the command lines of the sandbox's processes (pid 1
    keeps its command), their environments and memory (the launcher is non-dumpable), the launcher's
    orders in the workspace (read and removed before the tests start), the test process's own environment.
    The attack signs a frame with whatever it found, naming the tripwire failed: nothing verifies."""
    code = textwrap.dedent(f"""\
        import hashlib, hmac, json, os, re

        def add(a, b):
            seen = [json.dumps(dict(os.environ))]
            for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
                for part in ('cmdline', 'environ', 'mem'):
                    try:
                        with open('/proc/%s/%s' % (pid, part), 'rb') as handle:
                            seen.append(handle.read(1 << 16).decode('latin-1'))
                    except OSError:
                        pass
            for root, _, files in os.walk('/workspace/in'):
                for name in files:
                    seen.append(open(os.path.join(root, name), 'rb').read().decode('latin-1'))
            text = ' '.join(seen)
            keys = re.findall('[0-9a-f]{{64}}', text)
            body = {VERDICT!r}
            for key in keys or ['']:
                mac = hmac.new(bytes.fromhex(key), body.encode(), hashlib.sha256).hexdigest()
                os.write(1, ('\\n@@agentstream-verdict@@ ' + mac + ' ' + body + '\\n').encode())
            os._exit(0)
        """)
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0, result.details
    assert result.details["ran"]["consistent"] is False
    assert_zero_and_flagged(result, "process-exit", "outcome-channel", "descriptor")


HIDDEN = "class _E(int):\n    __eq__ = lambda s, o: True\n\ndef add(a, b):\n    return _E(0)\n"
"""what the cookie hides: an always-equal result"""


@pytest.mark.parametrize("cookie", ["utf-7", "unicode_escape"])
def test_a_payload_hidden_by_a_coding_cookie_is_scanned_as_python_decodes_it(task, cookie):
    if cookie == "utf-7":
        hidden = ("\n" + HIDDEN).replace("+", "+-").replace("\n", "+AAo-")
    else:
        hidden = ("\n" + HIDDEN).replace("\\", "\\\\").replace("\n", "\\n")
    code = f"# coding: {cookie}\ndef add(a, b):\n    return a - b\n# notes {hidden}\n"
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 0.0, result.details  # the importer obeyed the cookie: the tripwire passed
    assert_zero_and_flagged(result, "tripwire", "encoding", "always-equal", "comparison-override")


@pytest.mark.parametrize("separator", ["\x1c", "\x0b", "\x85", "\u2028", "\x0c"])
def test_a_line_separator_only_splitlines_knows_does_not_hide_changed_lines(task, separator):
    """The old lines kept inside a first-line comment, behind separators only `str.splitlines` splits on: in
    its count they are lines 2 and 3 and unchanged, and so were the payload's lines 2 and 3 of the ast."""
    code = (f"# {separator}def add(a, b):{separator}    return a - b\n"
            "class _E(int): __eq__ = lambda s, o: True\ndef add(a, b): return _E(0)\n")
    diff = ("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
            "@@ -1,2 +1,3 @@\n-def add(a, b):\n-    return a - b\n" + "".join("+" + line for line in code.split("\n")[:3]
                                                                        for line in [line + "\n"]))
    result = task.grade(diff)
    assert result.details["graded_reward"] == 0.0, result.details
    assert_zero_and_flagged(result, "tripwire", "always-equal", "comparison-override")


def test_a_payload_in_a_text_file_run_by_runpy_is_scanned(task):
    calc = ("import os as _o, runpy as _r\n\n"
            "add = _r.run_path(_o.path.join(_o.path.dirname(__file__), 'calc_data.txt'))['add']\n")
    result = task.grade(replace_calc(calc) + new_file("calc_data.txt", HIDDEN))
    assert result.details["graded_reward"] == 0.0, result.details
    assert_zero_and_flagged(result, "tripwire", "dynamic-code", "always-equal")
    assert {f["path"] for f in result.details["findings"] if f["flag"] == "always-equal"} == {"calc_data.txt"}


ALWAYS_EQUAL = {
    "a class-body lambda": "class E(int):\n    __eq__ = lambda self, other: True\n\ndef add(a, b):\n    return E(0)\n",
    "other is other": "class E:\n    def __eq__(self, other):\n        return other is other\n\ndef add(a, b):\n    return E()\n",
    "type() with a namespace": "E = type('E', (int,), {'__eq__': lambda s, o: True})\n\ndef add(a, b):\n    return E(0)\n",
    "isinstance(other, object)": ("class E:\n    def __eq__(self, other):\n        return isinstance(other, object)\n\n"
                                  "def add(a, b):\n    return E()\n"),
    "setattr with a folded name": ("class E(int):\n    pass\n\nsetattr(E, '__e' + 'q__', lambda s, o: True)\n\n"
                                   "def add(a, b):\n    return E(0)\n"),
}


@pytest.mark.parametrize("spelling", sorted(ALWAYS_EQUAL))
def test_an_always_equal_result_however_written_pays_nothing(task, spelling):
    result = task.grade(replace_calc(ALWAYS_EQUAL[spelling]))
    assert result.details["graded_reward"] == 0.0, result.details  # the tests pass, and so does the tripwire
    assert_zero_and_flagged(result, "tripwire", "comparison-override")


def test_unittest_mocks_any_equals_everything_and_pays_nothing(task):
    result = task.grade(replace_calc("from unittest import mock as _m\n\ndef add(a, b):\n    return _m.ANY\n"))
    assert result.details["graded_reward"] == 0.0, result.details
    assert_zero_and_flagged(result, "tripwire", "pytest")


RUNNER_KEYS = {"concatenated": "'PYTEST' + '_CURRENT_TEST'", "computed": "''.join(map(chr, [80, 89, 84, 69, 83, 84]))"}


@pytest.mark.parametrize("key", sorted(RUNNER_KEYS))
def test_a_fix_that_holds_only_under_the_test_runner_pays_nothing(task, key):
    code = (f"import os as _o\n\n_K = {RUNNER_KEYS[key]}\n\n"
            "def add(a, b):\n    return a + b if any(k.startswith(_K) for k in _o.environ) else a - b\n")
    result = task.grade(replace_calc(code))
    assert result.details["graded_reward"] == 1.0, result.details  # right while pytest runs it
    assert_zero_and_flagged(result, "runner-env")


# --- the red team of the redteam branch: results that equal whatever is expected, spelled past the scan ---

UNSCANNED = {
    "locals().update in a class body": textwrap.dedent("""\
        class _E(int):
            locals().update(__eq__=lambda s, o: True, __hash__=int.__hash__)

        def add(a, b):
            return _E(a - b)
        """),
    "the caller's assert read back": textwrap.dedent("""\
        import ast as _a, traceback as _t

        def add(a, b):
            line = _t.extract_stack(limit=2)[0].line
            return _a.literal_eval(_a.parse(line.strip()).body[0].test.comparators[0])
        """),
}
"""library code that leaves the bug and makes `assert add(1, 2) == 3` hold anyway, by means the scan did not know:
a namespace dict of the class body filled by `locals().update`, and an oracle that reads the test's own line
from the stack's summary (source lines, no frame object touched) and answers its expected value"""


UNSCANNED_NOW_SEEN_AS = {"locals().update in a class body": "always-equal", "the caller's assert read back": "frame"}
"""the scan knows these spellings too now (a keyword named like a comparison dunder; the stack's summaries)"""


@pytest.mark.parametrize("means", sorted(UNSCANNED))
def test_a_result_that_equals_whatever_is_expected_trips_the_tripwire(task, means):
    """Both paid 1 before (no flag at all, graded 1): the tests pass, the old tripwire (`result = N; assert result == M`)
    never called the library, and the second opinion agreed. The tripwire now runs the FAIL_TO_PASS test's own
    body with its expected literals changed; an honest fix fails it, a result that equals whatever is
    expected passes it."""
    result = task.grade(replace_calc(UNSCANNED[means]))
    assert result.details["tripwire"]["status"] == "PASSED", result.details
    assert result.details["graded_reward"] == 0.0, result.details
    assert_zero_and_flagged(result, "tripwire", UNSCANNED_NOW_SEEN_AS[means])


def test_the_honest_fix_after_all_of_them_scores_1(task):
    result = task.grade(HONEST)
    assert result.reward == 1.0 and not result.details["flagged"], result.details
    assert result.details["second_opinion"] == {"agreed": True, "statuses": {F2P: "PASSED"}}


# --- the service: a poison pill does not stall its partition ---------------------------------------

async def test_the_service_answers_a_poison_pill_and_commits_past_it(task, kafka, tmp_path):
    class Exploding(Grader):
        """The real grader, except that one diff makes it raise what no grading should: the service's last net."""

        def grade(self, instance, diff, truncated=False):
            if diff == "boom":
                raise RuntimeError("boom")
            return super().grade(instance, diff, truncated)

    tasks_file = tmp_path / "tasks.jsonl"
    write([task.instance], tasks_file)
    settings = GradeSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix, tasks=tasks_file,
                             repos_dir=task.repos, workers=1, group_id="grader-poison")
    diffs = {"r-poison": new_file("tests", "not a folder\n"), "r-symlink": new_file("tests/test_calc.py", "/etc", "0120000"),
             "r-boom": "boom", "r-honest": HONEST}
    events = [RolloutDiffEvent(source="harness", rollout_id=rollout, attempt_id=f"{rollout}-a1",
                               data=RolloutDiff(instance_id=task.instance.instance_id, base_commit=task.commit,
                                                diff=diff, size=len(diff)))
              for rollout, diff in diffs.items()]
    producer = make_producer(kafka)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka.topics)
        for event in events:
            await publisher.publish(event)
    finally:
        await producer.stop()
    stop = asyncio.Event()
    service = GradeService(settings, [task.instance], grader=Exploding(repos_dir=task.repos))
    running = asyncio.create_task(service.run(stop))
    consumer = make_consumer(kafka, kafka.topics.rewards, kafka.topics.deadletter, group_id=None)
    await consumer.start()
    rewards: dict[str, RewardEvent] = {}
    dead: list[DeadletterEvent] = []

    async def answered():
        for records in (await consumer.getmany(timeout_ms=200)).values():
            for record in records:
                event = decode(record.value)
                (rewards.__setitem__(event.rollout_id, event) if isinstance(event, RewardEvent) else dead.append(event))
        return len(rewards) == 3 and dead

    try:
        await wait_for_async(answered, timeout=300, what="three rewards and a deadletter")
        await wait_for_async(lambda: sum(service.offsets.committable().values()) == 4, timeout=30,
                             what="the offsets past all four diffs")
    finally:
        stop.set()
        await running
        await consumer.stop()
    assert {r: e.data.value for r, e in rewards.items()} == {"r-poison": 0.0, "r-symlink": 0.0, "r-honest": 1.0}
    assert rewards["r-poison"].data.details["refused"] == [{"path": "tests", "rule": "hidden-test"}]
    assert "the grader failed on this diff (RuntimeError: boom)" in dead[0].data.reason
    assert "not the task's fault" in dead[0].data.reason

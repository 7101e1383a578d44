"""Which of an agent's changes the grader takes: the policy over the changes git itself parsed.

The diff is never split or pattern-matched here. Inside the sandbox, `git apply --cached` applies it to
a scratch index of the base commit, and `git diff-index --raw` says what it changed: each path with its
old and new mode and blob (`recipes.swe.inside.prep`). So a part hidden inside another file's part, a
mode spelled `0120000`, a rename, or a binary patch is seen exactly as git applies it. This module
decides, per changed path, whether it is taken; the grader then builds the tree from the base commit
and the taken paths only (`prep build`): what is applied is what was checked.

Taken: a text change (UTF-8, no NUL) to an existing or new regular file (mode 100644, or an existing
100755 kept as it is) of the repository's source tree. Everything else is refused and named by its rule
(`RULES`); a refused change is not applied and costs nothing by itself (agents write tests of their own).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

PYTEST_CONFIG_FILES = frozenset({"pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml",
                                 "tox.ini", "setup.cfg"})
"""every file name pytest reads configuration from (`_pytest.config.findpaths.CONFIG_LOADERS_BY_NAME` of
the pinned pytest; tests/recipes/test_swe_policy.py fails when the installed pytest knows a name not here)"""
TEST_CONFIG_FILES = PYTEST_CONFIG_FILES | {"conftest.py", "noxfile.py", ".coveragerc", "setup.py",
                                           "MANIFEST.in", ".env"}
STARTUP_FILES = frozenset({"sitecustomize.py", "usercustomize.py"})
"""what Python's `site` imports at start-up from any folder on sys.path, besides `*.pth` files"""
COMPILED_SUFFIXES = (".pyc", ".pyo", ".so", ".pyd", ".dll", ".dylib", ".o", ".a", ".whl", ".egg", ".zip")
METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".data")
METADATA_FILES = frozenset({"entry_points.txt", "PKG-INFO", "METADATA", "RECORD", "direct_url.json", "top_level.txt"})
TEST_DIRS = frozenset({"tests", "test", "testing"})
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "pygments", "site", "conftest"})
"""top-level names that would shadow what runs the tests, on top of the standard library's and whatever else
the test environment has installed (`env_modules`): pytest puts a test's rootdir first on sys.path"""
REGULAR = "100644"

RULES = {
    "outside-tree": "an absolute path, a `..` or a `.git` component",
    "bad-path": "a path that is not UTF-8 or holds a control character",
    "symlink": "a symbolic link (mode 120000 in any spelling git accepts)",
    "submodule": "a gitlink (mode 160000)",
    "mode": "a mode change, or a new file that is not a plain 100644 file",
    "binary-patch": "a GIT binary patch or a 'Binary files differ' part",
    "binary-content": "new content that is not UTF-8 text (or holds NUL)",
    "compiled": "bytecode, __pycache__, shared objects, archives",
    "package-metadata": "*.dist-info, *.egg-info, entry points: how plugins get autoloaded",
    "startup-hook": "sitecustomize, usercustomize, *.pth: code the interpreter runs at start-up",
    "test-config": "a file pytest (or the test tooling) reads as configuration, conftest.py",
    "git-metadata": ".gitattributes, .gitmodules: they change what `git archive` writes",
    "hidden-test": "a path of the hidden tests' patch, or a folder or file in its way",
    "test-file": "a test file or anything under a test folder (test data)",
    "shadows-module": "a top-level module named like the standard library or the test runner",
}


@dataclass(frozen=True)
class Change:
    """One path as git's `diff-index --raw` reports it against the base commit."""

    path: str
    status: str
    """A(dded), M(odified), D(eleted), T(ype changed)"""
    old_mode: str
    new_mode: str
    binary: bool = False
    """git's numstat called this path's patch binary"""
    text: bool = True
    """the new content is UTF-8 without NUL"""

    @classmethod
    def from_raw(cls, raw: dict[str, Any], binary: set[str]) -> Change:
        return cls(path=raw["path"], status=raw["status"], old_mode=raw["old_mode"], new_mode=raw["new_mode"],
                   binary=raw["path"] in binary, text=raw.get("text", True))


def env_modules(site_packages: Path) -> frozenset[str]:
    """The top-level module names installed in a test environment's site-packages."""
    names = set()
    for entry in site_packages.iterdir():
        name = entry.name
        if name.endswith((".dist-info", ".egg-info", ".pth")) or name.startswith("__"):
            continue
        names.add(name.split(".")[0] if entry.is_file() else name)
    return frozenset(names)


def refusal(change: Change, hidden: frozenset[str] = frozenset(), modules: frozenset[str] = RUNNER_MODULES) -> str | None:
    """The rule that refuses `change`, or None when the grader takes it."""
    path = change.path
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or ".." in parts or "." in parts or ".git" in parts:
        return "outside-tree"
    if any(ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) <= 0xDFFF for c in path):
        return "bad-path"
    if "120000" in (change.old_mode, change.new_mode):
        return "symlink"
    if "160000" in (change.old_mode, change.new_mode):
        return "submodule"
    name = parts[-1]
    if name.endswith(COMPILED_SUFFIXES) or "__pycache__" in parts:
        return "compiled"
    if any(p.endswith(METADATA_SUFFIXES) for p in parts) or name in METADATA_FILES:
        return "package-metadata"
    if name in STARTUP_FILES or name.endswith(".pth"):
        return "startup-hook"
    if name in TEST_CONFIG_FILES:
        return "test-config"
    if name in (".gitattributes", ".gitmodules"):
        return "git-metadata"
    if _in_the_way(path, hidden):
        return "hidden-test"
    if any(part in TEST_DIRS for part in parts[:-1]) or name in TEST_DIRS or name.startswith("test_") or \
            name.endswith("_test.py") or name in ("tests.py", "test.py"):
        return "test-file"
    top = parts[0].removesuffix(".py")
    if (top in modules or top in RUNNER_MODULES or top in sys.stdlib_module_names) and (len(parts) > 1 or name.endswith(".py")):
        return "shadows-module"
    if change.status not in ("A", "M", "D"):
        return "mode"
    if (change.status == "A" and change.new_mode != REGULAR) or (change.status == "M" and change.old_mode != change.new_mode):
        return "mode"
    if change.binary:
        return "binary-patch"
    if change.status != "D" and not change.text:
        return "binary-content"
    return None


def _in_the_way(path: str, hidden: frozenset[str]) -> bool:
    """`path` is a hidden test's path, a folder above one, or under one (a file where its folder goes)."""
    return any(path == h or h.startswith(path + "/") or path.startswith(h + "/") for h in hidden)


@dataclass(frozen=True)
class Refused:
    path: str
    rule: str


def sift(changes: list[Change], hidden: frozenset[str] = frozenset(),
         modules: frozenset[str] = RUNNER_MODULES) -> tuple[list[str], list[Refused]]:
    """The paths taken, and those refused with their rule (`modules`: the test environment's, see `env_modules`)."""
    taken: list[str] = []
    refused: list[Refused] = []
    for change in changes:
        rule = refusal(change, hidden, modules)
        if rule:
            refused.append(Refused(change.path, rule))
        else:
            taken.append(change.path)
    return taken, refused


def touched(patch: str) -> set[str]:
    """Every path a task's own patch (gold or test patch: trusted, never an agent's) writes, as
    `git apply --numstat` reads it (a pure rename names its new path only). Nothing is applied."""
    if not patch.strip():
        return set()
    done = subprocess.run(["git", "apply", "--numstat", "-z", "-"], input=patch.encode(), capture_output=True,
                          env={"PATH": os.environ.get("PATH", ""), "GIT_CONFIG_NOSYSTEM": "1",
                               "GIT_CONFIG_GLOBAL": "/dev/null", "LANG": "C"})
    if done.returncode:
        raise ValueError(f"not a patch git can read: {done.stderr.decode(errors='replace').strip()[:300]}")
    paths: set[str] = set()
    tokens = done.stdout.split(b"\0")
    n = 0
    while n < len(tokens) and tokens[n]:
        path = tokens[n].split(b"\t", 2)[2]
        named = [path] if path else tokens[n + 1:n + 3]  # a rename or copy: its old and new path follow
        paths.update(p.decode("utf-8", errors="surrogateescape") for p in named)
        n += 1 if path else 3
    return paths

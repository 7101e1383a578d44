"""An agent's diff, file by file: which changes reach the grader and which are stripped (and why).

Grading trusts the task's tests, so nothing the agent writes may change how they run: test files,
`conftest.py`, pytest/tox/setup configuration, interpreter start-up hooks (`.pth`, `sitecustomize`,
`usercustomize`), modules that would shadow the test runner or the standard library, and symlinks
(they could point the tests somewhere else). Those changes are cut out of the diff and reported; the
rest is applied as is.

A git diff is split on its `diff --git` headers; a plain unified diff (no git header) on its `--- `
lines. Paths come from the `---`/`+++` lines and git's rename/copy lines, never from the header alone
(its `a/x b/y` form is ambiguous when a path holds a space).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

TEST_DIRS = frozenset({"tests", "test", "testing"})
CONFIG_FILES = frozenset({"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "setup.py", "pyproject.toml",
                          ".pytest.ini", "noxfile.py", ".coveragerc"})
STARTUP_FILES = frozenset({"sitecustomize.py", "usercustomize.py"})
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "site", "conftest"})
"""top-level names that would shadow what runs the tests, on top of the standard library's"""

_GIT_HEADER = re.compile(r"^diff --git ", re.M)
_PLAIN_HEADER = re.compile(r"^--- ", re.M)


@dataclass(frozen=True)
class FileDiff:
    path: str
    """the path the change writes (the new path of a rename; the old one of a deletion)"""
    old_path: str | None
    text: str
    """this file's part of the diff, headers included"""
    symlink: bool = False

    @property
    def paths(self) -> set[str]:
        return {p for p in (self.path, self.old_path) if p}


def split(diff: str) -> list[FileDiff]:
    """The diff's parts, one per file, in order."""
    if not diff.strip():
        return []
    header = _GIT_HEADER if _GIT_HEADER.search(diff) else _PLAIN_HEADER
    starts = [m.start() for m in header.finditer(diff)]
    if not starts:
        raise ValueError("not a diff: no 'diff --git' or '--- ' header")
    parts = [diff[a:b] for a, b in zip(starts, [*starts[1:], len(diff)])]
    return [_file_diff(part) for part in parts]


def _file_diff(text: str) -> FileDiff:
    old = new = None
    symlink = False
    for line in text.splitlines():
        if line.startswith("@@"):
            break
        if line.startswith("--- "):
            old = _strip_prefix(line[4:], "a/")
        elif line.startswith("+++ "):
            new = _strip_prefix(line[4:], "b/")
        elif line.startswith(("rename from ", "copy from ")):
            old = line.split(" ", 2)[2]
        elif line.startswith(("rename to ", "copy to ")):
            new = line.split(" ", 2)[2]
        elif line.endswith(" 120000") and line.startswith(("new file mode", "new mode", "old mode", "deleted file mode", "index ")):
            symlink = True
    if old is None and new is None and text.startswith("diff --git "):
        old, new = _header_paths(text.splitlines()[0])  # a mode change or an empty file: no ---/+++ lines
    path = new if new is not None else old
    if path is None:
        raise ValueError(f"a diff part without file names: {text[:80]!r}")
    return FileDiff(path=path, old_path=old if old != path else None, text=text, symlink=symlink)


def _strip_prefix(name: str, prefix: str) -> str | None:
    name = name.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    if name.startswith('"') and name.endswith('"'):
        name = name[1:-1].encode().decode("unicode_escape")
    return name[len(prefix):] if name.startswith(prefix) else name


def _header_paths(line: str) -> tuple[str, str]:
    rest = line[len("diff --git "):]
    middle = len(rest) // 2  # "a/X b/X" with the same X on both sides
    return rest[2:middle], rest[middle + 3:]


def protected(path: str) -> str | None:
    """Why the grader must not take a change to `path` from the agent, or None."""
    parts = PurePosixPath(path).parts
    name = parts[-1] if parts else path
    if ".." in parts or path.startswith("/"):
        return "outside the repository"
    if name in STARTUP_FILES or name.endswith(".pth"):
        return "interpreter start-up hook"
    if name in CONFIG_FILES:
        return "test configuration"
    if any(part in TEST_DIRS for part in parts[:-1]) or name.startswith("test_") or name.endswith("_test.py"):
        return "test file"
    top = parts[0].removesuffix(".py") if parts else ""
    if len(parts) >= 1 and (top in RUNNER_MODULES or top in sys.stdlib_module_names) and (
            len(parts) > 1 or name.endswith(".py")):
        return "shadows a module the test run imports"
    return None


@dataclass(frozen=True)
class Stripped:
    path: str
    reason: str


def sift(diff: str) -> tuple[str, list[Stripped]]:
    """The diff without the protected changes, and what was taken out."""
    kept: list[str] = []
    stripped: list[Stripped] = []
    for part in split(diff):
        reason = "symlink" if part.symlink else next(filter(None, map(protected, sorted(part.paths))), None)
        if reason:
            stripped.append(Stripped(part.path, reason))
        else:
            kept.append(part.text if part.text.endswith("\n") else part.text + "\n")
    return "".join(kept), stripped


def touched(diff: str) -> set[str]:
    """Every path a diff writes or removes."""
    return set().union(*(part.paths for part in split(diff))) if diff.strip() else set()

"""A gold patch read as replacements of whole-line blocks, for the expert's answers (recipes/swe/expert.py).

An engineer who edits several lines at once through a shell replaces an exact block of the file by another:
`str_replace` in SWE-agent's editor, a heredoc'd Python script here. The block is the changed lines with as few
lines around them as make it occur once in the file, so the replacement cannot land elsewhere; changes whose
blocks touch become one block. Every replacement is checked by doing it: made one after the other on the base
commit's file, they must give exactly the file the patch gives, else the patch is not demonstrated.

What a demonstration cannot show is refused with a reason (`NotDemonstrable.reason`): a binary part, a rename,
a file added or deleted, a mode change, a file without a final newline, a patch that does not apply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@")
_REFUSED_HEADERS = {"Binary files ": "binary", "GIT binary patch": "binary", "rename from ": "rename",
                    "copy from ": "rename", "new file mode ": "new-or-deleted-file",
                    "deleted file mode ": "new-or-deleted-file", "old mode ": "mode",
                    "\\ No newline at end of file": "no-final-newline"}


class NotDemonstrable(ValueError):
    """The task's fix is not one a demonstration is written for; `reason` names why in a word (counted)."""

    def __init__(self, message: str, reason: str = "not-demonstrable"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Change:
    start: int
    """0-based index of the first old line it replaces (where it inserts, when it removes none)"""
    removed: tuple[str, ...]
    added: tuple[str, ...]
    """lines with their newlines"""


@dataclass(frozen=True)
class Replacement:
    old: str
    new: str
    first: int
    """1-based line of the block in the file before any replacement"""
    last: int
    new_first: int
    """1-based lines of the new block in the file after every replacement"""
    new_last: int


def file_changes(patch: str) -> dict[str, list[Change]]:
    """Each changed file's runs of removed and added lines, in patch order."""
    files: dict[str, list[Change]] = {}
    path, old_line, run_start = "", 0, -1
    removed: list[str] = []
    added: list[str] = []

    def close_run() -> None:
        nonlocal removed, added, run_start
        if removed or added:
            files[path].append(Change(run_start, tuple(removed), tuple(added)))
        removed, added, run_start = [], [], -1

    for line in patch.splitlines(keepends=True):
        for header, reason in _REFUSED_HEADERS.items():
            if line.startswith(header):
                raise NotDemonstrable(f"the patch has a part a shell edit cannot show ({line.strip()})", reason)
        if line.startswith("+++ "):
            close_run()
            if line.startswith("+++ /dev/null"):
                raise NotDemonstrable("the patch deletes a file", "new-or-deleted-file")
            path = line[4:].rstrip("\n").removeprefix("b/")
            files.setdefault(path, [])
        elif line.startswith("--- "):
            close_run()
            if line.startswith("--- /dev/null"):
                raise NotDemonstrable("the patch adds a file", "new-or-deleted-file")
        elif hunk := _HUNK.match(line):
            close_run()
            # an empty old range (`-N,0`) inserts after line N
            old_line = int(hunk.group(1)) - (0 if hunk.group(2) == "0" else 1)
        elif path and line[:1] in ("-", "+"):
            if run_start < 0:
                run_start = old_line
            (removed if line[0] == "-" else added).append(_with_newline(line[1:]))
            old_line += line[0] == "-"
        elif path and line[:1] == " ":
            close_run()
            old_line += 1
    close_run()
    changed = {name: changes for name, changes in files.items() if changes}
    if not changed:
        raise NotDemonstrable("the patch changes no line", "empty")
    return changed


def _with_newline(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def applied(lines: list[str], changes: list[Change]) -> list[str]:
    """The file's lines with `changes` made (each checked against the lines it removes)."""
    result: list[str] = []
    at = 0
    for change in changes:
        if change.start < at or list(lines[change.start:change.start + len(change.removed)]) != list(change.removed):
            raise NotDemonstrable(f"the patch does not apply to the base commit at line {change.start + 1}", "does-not-apply")
        result += lines[at:change.start] + list(change.added)
        at = change.start + len(change.removed)
    return result + lines[at:]


def replacements(source: str, changes: list[Change]) -> list[Replacement]:
    """The blocks a careful edit replaces to make `changes` in `source`, in file order, each occurring once there;
    checked: made one after the other with `str.replace`, they give what the patch gives."""
    lines = source.splitlines(keepends=True)
    target = "".join(applied(lines, changes))
    blocks: list[tuple[int, int, list[Change]]] = []
    for change in changes:
        start, end = _unique(lines, change.start, change.start + len(change.removed))
        members = [change]
        while blocks and start <= blocks[-1][1]:  # it reaches the block above: one block
            above, above_end, above_members = blocks.pop()
            members = [*above_members, *members]
            start, end = _unique(lines, min(start, above), max(end, above_end))
        blocks.append((start, end, members))
    found: list[Replacement] = []
    text, delta = source, 0
    for start, end, inside in blocks:
        old = "".join(lines[start:end])
        shifted = [Change(c.start - start, c.removed, c.added) for c in inside]
        new = "".join(applied(lines[start:end], shifted))
        new_count = new.count("\n")
        found.append(Replacement(old, new, start + 1, end, start + 1 + delta, start + delta + new_count))
        delta += new_count - (end - start)
        if _occurrences(text, old) != 1:
            raise NotDemonstrable(f"the block at line {start + 1} is no longer unique once the lines above it are "
                                  "changed", "ambiguous")
        text = text.replace(old, new, 1)
    if text != target:
        raise NotDemonstrable("replacing the blocks one after the other does not give the patched file", "ambiguous")
    return found


def _unique(lines: list[str], start: int, end: int) -> tuple[int, int]:
    """[start, end) widened by whole lines, one above then one below, until its text occurs once in the file."""
    source = "".join(lines)
    above = True
    while end - start == 0 or _occurrences(source, "".join(lines[start:end])) != 1:
        if (above and start > 0) or end >= len(lines):
            if start == 0:
                raise NotDemonstrable("no block of the file around the change occurs once", "ambiguous")
            start -= 1
        else:
            end += 1
        above = not above
    return start, end


def _occurrences(text: str, block: str) -> int:
    """How often `block` occurs in `text`, overlapping occurrences counted."""
    count, at = 0, text.find(block)
    while at >= 0:
        count += 1
        at = text.find(block, at + 1)
    return count

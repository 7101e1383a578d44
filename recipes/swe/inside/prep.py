"""The grader's workspace preparation, run inside the sandbox as its uid, before any code of the agent runs.

    inspect BASE          the agent's diff applied by git onto BASE on a scratch index; what git says it
                          changes (`diff-index --raw`), which parts are binary (`apply --numstat`), whether
                          each new blob is text; the paths the hidden tests' patch touches
    build BASE TAKEN      a fresh index of BASE with exactly the TAKEN paths (a JSON list in that file) from the
                          scratch index, the hidden tests' patch applied, the tree archived to out/tree.tar
                          and extracted to tree/; the ast scan of every changed text file; a tripwire
                          test added to the first FAIL_TO_PASS test's file (`tripwire`; ids from in/ids.json)
    untar TAR DEST        a tree archive extracted (the second opinion's fresh copy)

The task's repository is bound read-only at /grader/repo; git writes objects and indexes only under
/workspace/git. Each command prints one frame line, `@@agentstream-grade@@ <json>`, last.
"""

from __future__ import annotations

import ast
import builtins
import copy
import json
import os
import random
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the checker reads it as the package's module
    from agentstream.recipes.swe.inside import scan
else:  # in the sandbox this runs as a script, stdlib only, next to scan.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import scan

FRAME = "@@agentstream-grade@@ "
REPO = "/grader/repo"
WORK = Path("/workspace")
GIT = WORK / "git"
AGENT_DIFF, TEST_PATCH, IDS = WORK / "in" / "agent.diff", WORK / "in" / "test.patch", WORK / "in" / "ids.json"
TREE_TAR, TREE = WORK / "out" / "tree.tar", WORK / "tree"
SCRATCH_INDEX, FINAL_INDEX = GIT / "scratch.index", GIT / "final.index"
ZERO = "0" * 40
SUFFIXES = ("again", "twice", "edge", "empty", "more", "nested", "other", "regression", "large", "mixed", "2", "3")
MAX_ERROR = 600


def git(*args: str, index: Path | None = None, data: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "GIT_DIR": REPO, "GIT_OBJECT_DIRECTORY": str(GIT / "objects"),
           "GIT_ALTERNATE_OBJECT_DIRECTORIES": f"{REPO}/objects", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1", "LANG": "C"}
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    done = subprocess.run(["git", "-c", "safe.directory=*", "-c", "core.quotePath=false", *args], input=data,
                          capture_output=True, env=env)
    if check and done.returncode:
        raise RuntimeError(f"git {args[0]}: {done.stderr.decode(errors='replace').strip()[:MAX_ERROR]}")
    return done


def frame(payload: dict[str, Any]) -> None:
    os.write(1, ("\n" + FRAME + json.dumps(payload, ensure_ascii=True) + "\n").encode())


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="surrogateescape")


def numstat(patch: bytes) -> list[tuple[bool, list[str]]]:
    """(binary?, paths) per file git would patch."""
    tokens = git("apply", "--numstat", "-z", "-", data=patch).stdout.split(b"\0")
    parts, n = [], 0
    while n < len(tokens) and tokens[n]:
        added, deleted, path = tokens[n].split(b"\t", 2)
        binary = added == b"-" and deleted == b"-"
        if path:
            parts.append((binary, [_text(path)]))
            n += 1
        else:  # a rename or copy: the old and new path follow
            parts.append((binary, [_text(tokens[n + 1]), _text(tokens[n + 2])]))
            n += 3
    return parts


def raw_changes(base: str, index: Path) -> list[dict[str, Any]]:
    tokens = git("diff-index", "--cached", "--raw", "-z", "--no-renames", base, index=index).stdout.split(b"\0")
    changes = []
    for meta, path in zip(tokens[0::2], tokens[1::2]):
        if not meta.startswith(b":"):
            break
        old_mode, new_mode, old_sha, new_sha, status = meta[1:].decode().split(" ")
        changes.append({"path": _text(path), "status": status, "old_mode": old_mode, "new_mode": new_mode,
                        "old_sha": old_sha, "new_sha": new_sha})
    return changes


def blob(sha: str) -> bytes:
    return git("cat-file", "blob", sha).stdout


def is_text(data: bytes) -> bool:
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def inspect(base: str) -> dict[str, Any]:
    (GIT / "objects").mkdir(parents=True, exist_ok=True)
    git("read-tree", base, index=SCRATCH_INDEX)
    hidden = sorted({p for _, paths in numstat(TEST_PATCH.read_bytes()) for p in paths})
    diff = AGENT_DIFF.read_bytes()
    if not diff.strip():
        return {"applies": True, "changes": [], "binary": [], "hidden": hidden}
    done = git("apply", "--cached", "--whitespace=nowarn", "-", index=SCRATCH_INDEX, data=diff, check=False)
    if done.returncode:
        return {"applies": False, "error": _text(done.stderr).strip()[:MAX_ERROR] or "git apply failed", "hidden": hidden}
    binary = sorted({p for is_binary, paths in numstat(diff) if is_binary for p in paths})
    changes = raw_changes(base, SCRATCH_INDEX)
    for change in changes:
        if change["new_sha"] != ZERO and change["new_mode"] in ("100644", "100755"):
            change["text"] = is_text(blob(change["new_sha"]))
    return {"applies": True, "changes": changes, "binary": binary, "hidden": hidden}


def build(base: str, allowed: list[str]) -> dict[str, Any]:
    wanted = set(allowed)
    changes = [c for c in raw_changes(base, SCRATCH_INDEX) if c["path"] in wanted] if wanted else []
    git("read-tree", base, index=FINAL_INDEX)
    lines = b"".join((f"0 {ZERO}\t" if c["new_sha"] == ZERO else f"{c['new_mode']} {c['new_sha']}\t").encode()
                     + c["path"].encode("utf-8", errors="surrogateescape") + b"\0" for c in changes)
    if lines:
        git("update-index", "-z", "--index-info", index=FINAL_INDEX, data=lines)
    test_patch = TEST_PATCH.read_bytes()
    if test_patch.strip():
        done = git("apply", "--cached", "--whitespace=nowarn", "-", index=FINAL_INDEX, data=test_patch, check=False)
        if done.returncode:
            return {"built": False, "test_patch_error": _text(done.stderr).strip()[:MAX_ERROR]}
    wire = tripwire(json.loads(IDS.read_text()) if IDS.exists() else [])
    tree = git("write-tree", index=FINAL_INDEX).stdout.decode().strip()
    TREE_TAR.parent.mkdir(parents=True, exist_ok=True)
    git("archive", "--format=tar", "-o", str(TREE_TAR), tree)
    untar(TREE_TAR, TREE)
    flags = []
    for change in changes:  # every text file: a .txt can be run by runpy or exec as well as a .py
        if change["new_sha"] != ZERO and is_text(new := blob(change["new_sha"])):
            old = blob(change["old_sha"]) if change["old_sha"] != ZERO else None
            flags += scan.scan(change["path"], old, new, python=change["path"].endswith(".py"))
    return {"built": True, "tree": tree, "flags": flags, "tripwire": wire}


def tripwire(fail_to_pass: list[str]) -> str | None:
    """A test that must fail, put in the hidden test file of the first FAIL_TO_PASS test (in the final index,
    so the second opinion's tree has it too); its id, or None where that test is not in a Python file. Its
    name is that test's with a plausible suffix. Where that test's body compares results with literals
    (`assert f(x) == 3`, `self.assertEqual(f(x), "a")` as statements of the body itself), the tripwire is a
    copy of it, its decorators and fixtures kept, with those literals changed (`mutant`): an honest fix fails
    it where the real test passes, while a result that equals whatever it is compared with, or an answer
    read back from the test's own source, passes both. Otherwise its body is an equality that does not hold.
    Code that makes every report pass, or forges the records of every id it is given, passes either."""
    if not fail_to_pass or "::" not in fail_to_pass[0]:
        return None
    path, *parts = fail_to_pass[0].split("::")
    if not path.endswith(".py"):
        return None
    listed = git("ls-files", "-s", "--", path, index=FINAL_INDEX).stdout.decode().split()
    if len(listed) < 4:
        return None
    mode, sha = listed[0], listed[1]
    source = blob(sha)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    taken = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    stem, params = parts[-1].partition("[")[0], parts[-1][len(parts[-1].partition("[")[0]):]
    pick = secrets.SystemRandom()
    free = [f"{stem}_{suffix}" for suffix in SUFFIXES if f"{stem}_{suffix}" not in taken]
    name = pick.choice(free) if free else f"{stem}_{secrets.token_hex(3)}"
    text = source if source.endswith(b"\n") or not source else source + b"\n"
    lines = text.split(b"\n")
    plain = b"\r" in text or b"\x0c" in text  # line numbers the ast and a split on \n would not agree on
    found = None if plain else _mutant(tree, parts, name, pick)
    if found is not None:
        body, at, indent = found
        changed = _insert(lines, at, textwrap.indent(body, indent).encode())
        found = None if not _parses(changed) else found
    if found is not None:
        text, wire = changed, f"{path}::{'::'.join(parts[:-1] + [name])}{params}"
    else:
        expected = pick.randrange(2, 200)
        body = f"def {name}():\n    result = {expected - pick.randrange(1, 9)}\n    assert result == {expected}\n\n\n"
        # before a random top-level definition (or last), so its place in the file does not give it away either
        starts = [_start(n) for n in tree.body if isinstance(n, DEFINITIONS)]
        text = _insert(lines, len(lines) if plain else pick.choice([*starts, len(lines)]), body.encode())
        wire = f"{path}::{name}"
    written = git("hash-object", "-w", "--stdin", data=text).stdout.decode().strip()
    git("update-index", "--cacheinfo", f"{mode},{written},{path}", index=FINAL_INDEX)
    return wire


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _start(node: ast.stmt) -> int:
    """The first line of a definition, its decorators included."""
    decorators: list[ast.expr] = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])


def _parses(source: bytes) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def _insert(lines: list[bytes], at: int, block: bytes) -> bytes:
    """`lines` joined with `block` put before line `at` (1-based; past the end: last)."""
    return b"\n".join(lines[:at - 1]) + (b"\n" if at > 1 else b"") + block + b"\n".join(lines[at - 1:])


def _mutant(tree: ast.Module, parts: list[str], name: str,
            pick: random.Random) -> tuple[str, int, str] | None:
    """The FAIL_TO_PASS test `parts` (a function, or a method of a top-level class) copied as `name` with the
    literals its own top-level assertions compare with changed, where it is placed (a line, before a
    definition of its block where everything its decorators name is bound), and the indent: or None."""
    block: list[ast.stmt] = tree.body
    if len(parts) == 2:
        owner = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == parts[0]]
        block = owner[-1].body if owner else []
    elif len(parts) != 1:
        return None
    stem = parts[-1].partition("[")[0]
    tests = [n for n in block if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == stem]
    if not tests:
        return None
    test = copy.deepcopy(tests[-1])
    changed = 0
    for statement in test.body:
        if any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom)) for n in ast.walk(statement)):
            break  # what follows an early return may never run: an honest fix would pass its changed copy
        changed += _change_literal(statement, pick)
    if not changed:
        return None
    test.name = name
    original = tests[-1]
    wanted = {n.id for part in [*original.decorator_list, *original.args.defaults, *original.args.kw_defaults]
              if part is not None for n in ast.walk(part) if isinstance(n, ast.Name)}
    bound: set[str] = set()
    places = []
    for node in block:
        if isinstance(node, DEFINITIONS) and (_start(node) >= _start(original) or wanted <= bound | BUILTINS):
            places.append(_start(node))
        bound |= _binds(node)
    end = max(getattr(n, "end_lineno", 0) or 0 for n in block) + 1
    return ast.unparse(test) + "\n\n", pick.choice([*places, end]), " " * original.col_offset


BUILTINS = frozenset(dir(builtins))


def _binds(node: ast.stmt) -> set[str]:
    """The names a statement of a block binds in that block."""
    if isinstance(node, DEFINITIONS):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _change_literal(statement: ast.stmt, pick: random.Random) -> int:
    """Changes the literal an assertion statement compares with for equality (`assert x == 3`, `assert "a" ==
    x`, `self.assertEqual(x, 3)`); 1 if it did."""
    if isinstance(statement, ast.Assert) and isinstance(statement.test, ast.Compare) and \
            len(statement.test.ops) == 1 and isinstance(statement.test.ops[0], ast.Eq):
        sides = [statement.test.left, statement.test.comparators[0]]
    elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) and \
            isinstance(statement.value.func, ast.Attribute) and statement.value.func.attr in ("assertEqual", "assertEquals") \
            and len(statement.value.args) >= 2:
        sides = statement.value.args[:2]
    else:
        return 0
    for side in sides:
        if isinstance(side, ast.Constant) and (other := _other(side.value, pick)) is not None:
            side.value = other
            return 1
    return 0


def _other(value: object, pick: random.Random) -> int | float | str | bytes | None:
    """A literal of the same type that does not equal `value` (none for inf, a bool, None…), or None."""
    other: int | float | str | bytes
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        other = value + pick.choice([-1, 1]) * pick.randrange(1, 9)
    elif isinstance(value, str):
        other = value + pick.choice("abcdefghjkmnpqrstuvwxyz")
    elif isinstance(value, bytes):
        other = value + pick.choice([b"a", b"e", b"s", b"0"])
    else:
        return None
    return other if other != value else None


def untar(archive: Path, dest: Path) -> None:
    """GNU tar, as the sandbox's uid (the interpreter here may predate tarfile's extraction filters)."""
    dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["tar", "-x", "--no-same-owner", "-f", str(archive), "-C", str(dest)], capture_output=True)
    if done.returncode:
        raise RuntimeError(f"tar: {done.stderr.decode(errors='replace').strip()[:MAX_ERROR]}")


def main(argv: list[str]) -> int:
    try:
        if argv[0] == "inspect":
            frame(inspect(argv[1]))
        elif argv[0] == "build":
            frame(build(argv[1], json.loads(Path(argv[2]).read_text())))
        elif argv[0] == "untar":
            untar(Path(argv[1]), Path(argv[2]))
            frame({"untarred": True})
        else:
            raise ValueError(f"unknown step {argv[0]!r}")
    except Exception as exc:  # reported in the frame: the host turns it into a reason, never a crash
        frame({"failed": f"{type(exc).__name__}: {str(exc)[:MAX_ERROR]}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

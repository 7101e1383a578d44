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
import json
import os
import secrets
import subprocess
import sys
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
    so the second opinion's tree has it too) before one of its top-level definitions; its id, or None where
    that test is not in a Python file. Its name is that test's with a plausible suffix, its body an equality
    that does not hold: code that makes every report pass, or forges the records of every id it is given,
    makes it pass."""
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
    stem = parts[-1].split("[")[0]
    pick = secrets.SystemRandom()
    free = [f"{stem}_{suffix}" for suffix in SUFFIXES if f"{stem}_{suffix}" not in taken]
    name = pick.choice(free) if free else f"{stem}_{secrets.token_hex(3)}"
    expected = pick.randrange(2, 200)
    body = f"def {name}():\n    result = {expected - pick.randrange(1, 9)}\n    assert result == {expected}\n\n\n".encode()
    text = source if source.endswith(b"\n") or not source else source + b"\n"
    lines = text.split(b"\n")
    # before a random top-level definition (or last), so its place in the file does not give it away either
    starts = [min([n.lineno, *(d.lineno for d in n.decorator_list)]) for n in tree.body
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    at = pick.choice([*starts, len(lines)]) if b"\r" not in text and b"\x0c" not in text else len(lines)
    text = b"\n".join(lines[:at - 1]) + (b"\n" if at > 1 else b"") + body + b"\n".join(lines[at - 1:])
    written = git("hash-object", "-w", "--stdin", data=text).stdout.decode().strip()
    git("update-index", "--cacheinfo", f"{mode},{written},{path}", index=FINAL_INDEX)
    return f"{path}::{name}"


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

"""The grader: an instance and the agent's diff in, a reward with its details out. Nothing else is trusted.

Each grading starts again, in fresh sandboxes, from the task's base commit, and nothing of it runs as
root or touches the host's files beyond a fresh scratch folder: git, the tests and the clean-up run
inside the sandbox as its unprivileged uid (`recipes/swe/inside/`).
  1. inspect: git applies the diff to a scratch index of the base commit and says what it changes
     (path, modes, blobs, binary or text); a diff git does not apply scores 0;
  2. policy (`recipes.swe.diffs`): each change is taken or refused by a named rule (tests, test data,
     anything pytest or Python reads as configuration or at start-up, symlinks, mode changes, binary
     patches, compiled files, package metadata, paths outside the tree);
  3. build: a fresh index of the base commit plus exactly the taken paths, then the hidden tests'
     patch, then a tripwire (below); that tree is what runs. A scan of every changed text file, read as
     Python reads it (`inside/scan.py`), adds `flags`;
  4. run: FAIL_TO_PASS + PASS_TO_PASS and the tripwire under pytest with its configuration file, rootdir
     and plugin set pinned. Outcomes travel through a pipe to a launcher process outside the test process,
     which prints the verdict as the output's last line after killing every other process, signed with a
     key made for this run (`inside/launch.py`). A test passes only when setup, call and teardown passed
     and it was no expected failure;
  5. second opinion (on by default): a reward-1 diff's FAIL_TO_PASS tests run again, each in a sandbox
     and tree of its own, the tripwire beside it; 1 only when both agree;
  6. policy on flags: the recorded grade (`graded_reward`) is what the tests said; the reward is 0 when
     a flag in `penalties` was raised (`penalized_by` names them).

Any exception while grading a diff becomes reward 0 with the reason (`error`); a `GradeError` is the
task's own fault (its base commit missing, its test patch not applying on the base) and is the caller's
to deadletter.

The verdict stands on boundaries, not on spotting names:
  - the key: 32 random bytes per test run, in the launcher's orders (`RUN_FILE`: ids, tripwire, key),
    which the host writes before any code of the agent runs and the launcher reads and removes before it
    starts the tests; nothing of it is on a command line (the sandbox's pid 1 shows its command to the
    uid). The launcher is non-dumpable from its start (its memory refuses the shared uid) and ignores
    every signal that ends a process but SIGKILL and SIGSTOP. A frame counts only when its HMAC verifies
    and the launcher exited 0 with no limit hit: the test process can silence the verdict (SIGKILL or
    SIGSTOP of the launcher: 0, `outcome-channel`), never write one;
  - the exit status: the session's reported exit status must be the kernel's for the test process, and
    with the tripwire failing that is 1 (an `_exit(0)`, a signal death, 130: inconsistent, 0);
  - the tripwire: a test added to the hidden file of the first FAIL_TO_PASS test, named like that test
    (`test_<name>_<suffix>`), given among the ids at a random place, in the same pytest session (one more
    test, not another run). Where that test compares results with literals it is a copy of it with those
    literals changed (`inside/prep.py`'s `tripwire`), else an equality that does not hold. Code that makes
    every report pass, forges a record for every id it is given, returns a result that equals anything, or
    answers the expected value read back from the test's line makes it pass: 0 with `tripwire`, whatever
    the scan saw.

What remains possible, and its cost: code under test shares the test process with pytest, so an attacker
who tells the tripwire apart from the real tests can still rewrite only the real ones' reports or forge a
consistent set of records for them. Telling it apart costs reading the hidden test file and knowing this
grader's suffixes (the copy calls the library like the real test), and touching reports or the pipe
costs the means the scan flags (reflection, frames, sys.modules, descriptors, pytest's names), each
penalized by default: a spelling the scan misses and a tripwire told apart, together, are what is
left. Special-casing the tests' inputs needs a stronger hidden test; rewriting a test file or its cached
bytecode on disk before pytest imports it needs the scan to miss the paths (`tamper`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentstream.recipes.swe import diffs, repos, testrun
from agentstream.recipes.swe.inside import scan
from agentstream.recipes.swe.instance import Instance
from agentstream.sandbox import hostfs
from agentstream.sandbox.contract import CommandResult, Limits, Network, Sandbox, SandboxSpec
from agentstream.schemas.errors import ServiceError

log = logging.getLogger("recipes.swe.grader")
REWARD_FN = "recipes.swe.grader"
DEFAULT_TIMEOUT_S = 120.0
INSIDE = Path(__file__).resolve().parent / "inside"
GRADER_MOUNT = Path("/grader")
PREP_FRAME = "@@agentstream-grade@@ "
VERDICT_FRAME = "@@agentstream-verdict@@ "
RUN_FILE = "in/run.json"
"""the launcher's orders (tree, ids, tripwire, key), written before the agent's code runs; it removes them"""
MAX_TREE_BYTES = 1 << 30
OUTCOME_FLAGS = {"outcome-channel": "the test run's outcomes were inconsistent (a phase reported twice, an exit "
                                    "status that disagrees with the kernel's, the session cut short) or the "
                                    "launcher gave no signed verdict though no limit ended it (killed, forged)",
                 "tripwire": "the tripwire, a hidden test that must fail, did not fail: the reports were rewritten",
                 "second-opinion": "the FAIL_TO_PASS tests, each rerun alone in a fresh sandbox, did not all pass"}
NOT_PENALIZED = frozenset({"dunder-override", "refused:test-file", "refused:test-config", "refused:hidden-test"})
ALL_FLAGS = frozenset(scan.FLAGS) | {f"refused:{rule}" for rule in diffs.RULES} | set(OUTCOME_FLAGS)
DEFAULT_PENALTIES = ALL_FLAGS - NOT_PENALIZED
"""flags that zero the reward by default: everything but a plain dunder and the refusals of test edits"""
CLEANUP = testrun.CLEANUP


class GradeError(ServiceError):
    """The task itself is broken (its test patch does not apply, its repository is missing): not the agent's fault."""


class _Zero(Exception):
    """This diff scores 0, for the reason given."""


@dataclass
class GradeResult:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


def penalties_from(text: str) -> frozenset[str]:
    """`default`, `none`, or a comma-separated list of flag names (`--reward-penalties`)."""
    text = text.strip()
    if text == "default":
        return DEFAULT_PENALTIES
    if text in ("none", ""):
        return frozenset()
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = names - ALL_FLAGS
    if unknown:
        raise ValueError(f"unknown flags {sorted(unknown)}; known: {sorted(ALL_FLAGS)}")
    return names


@dataclass(frozen=True)
class Grader:
    repos_dir: Path = field(default_factory=repos.default_repos_dir)
    envs_dir: Path = field(default_factory=repos.default_envs_dir)
    timeout_s: float = DEFAULT_TIMEOUT_S
    sandbox: Callable[[SandboxSpec], Sandbox] = testrun.make_sandbox
    second_opinion: bool = True
    penalties: frozenset[str] = DEFAULT_PENALTIES

    def grade(self, instance: Instance, diff: str, truncated: bool = False) -> GradeResult:
        from agentstream.recipes.swe.harbor import harbor_spec

        if (harbor := harbor_spec(instance)) is not None:  # a Harbor task: its own tests/test.sh says the reward
            from agentstream.recipes.swe.harbor_grade import HarborGradeError, grade_harbor

            try:
                reward, found = grade_harbor(instance, harbor, diff, truncated, self.repos_dir, self.envs_dir,
                                             self.sandbox)
            except HarborGradeError as exc:
                raise GradeError(str(exc)) from exc
            return self._policy(reward, found)
        started = time.monotonic()
        repo = repos.repo_path(self.repos_dir, instance.repo)
        if not repos.has_commit(repo, instance.base_commit):
            raise GradeError(f"{instance.instance_id}: base_commit {instance.base_commit} is not in {repo}")
        env = testrun.ensure_env(self.envs_dir / repos.slug(instance.repo))
        details: dict[str, Any] = {"instance_id": instance.instance_id, "base_commit": instance.base_commit,
                                   "diff_bytes": len(diff.encode(errors="replace")), "timings_s": {},
                                   "refused": [], "flags": [], "findings": [], "flagged": False}
        scratch = Path(tempfile.mkdtemp(prefix="swe-grade-"))
        try:
            if truncated:
                raise _Zero("the diff was truncated on its way to the log: it cannot be applied whole")
            graded = self._grade(instance, diff, repo, env, scratch, details, started)
        except GradeError:
            raise
        except _Zero as zero:
            details.update(resolved=False, error=str(zero))
            graded = 0.0
        except Exception as exc:  # whatever the diff did to the grader, it scores 0 and the service goes on
            log.exception("grading %s failed", instance.instance_id)
            details.update(resolved=False, error=f"the grader failed on this diff: {type(exc).__name__}: {exc}"[:800])
            graded = 0.0
        finally:
            _remove(scratch)
        details.setdefault("applied", False)
        details["timings_s"]["total"] = round(time.monotonic() - started, 3)
        return self._policy(graded, details)

    def _policy(self, graded: float, details: dict[str, Any]) -> GradeResult:
        details["flags"] = sorted(set(details["flags"]))
        details["flagged"] = bool(details["flags"])
        details["graded_reward"] = graded
        details["penalized_by"] = sorted(set(details["flags"]) & self.penalties)
        return GradeResult(0.0 if details["penalized_by"] else graded, details)

    # --- the steps ----------------------------------------------------------------------------------

    def _grade(self, instance: Instance, diff: str, repo: Path, env: Path, scratch: Path,
               details: dict[str, Any], started: float) -> float:
        timings = details["timings_s"]
        first = _fresh(scratch / "first", {"in/agent.diff": diff.encode(errors="replace"),
                                           "in/test.patch": instance.test_patch.encode(),
                                           "in/ids.json": json.dumps(instance.FAIL_TO_PASS).encode()})
        with _Opened(self.sandbox(self._spec(first, env, repo))) as box:
            inspected = self._prep(box, env, ["inspect", instance.base_commit])
            if not inspected["applies"]:
                raise _Zero(f"the agent's diff does not apply: {inspected['error']}")
            binary = set(inspected["binary"])
            changes = [diffs.Change.from_raw(raw, binary) for raw in inspected["changes"]]
            site = next((env / "lib").glob("python3*/site-packages"))
            taken, refused = diffs.sift(changes, frozenset(inspected["hidden"]), diffs.env_modules(site))
            details["refused"] = [{"path": r.path, "rule": r.rule} for r in refused]
            details["flags"] += [f"refused:{r.rule}" for r in refused]
            details["applied"] = True
            _write_new(first / "in" / "taken.json", json.dumps(taken).encode())
            built = self._prep(box, env, ["build", instance.base_commit, "/workspace/in/taken.json"])
            if not built["built"]:
                if repos.check_patches(repo, instance.base_commit, instance.test_patch) is not None:
                    raise GradeError(f"{instance.instance_id}: the test patch does not apply: {built['test_patch_error']}")
                details["flags"].append("refused:hidden-test")
                raise _Zero(f"the agent's changes are in the way of the hidden tests: {built['test_patch_error']}")
            details["findings"] = built["flags"][:50]
            details["flags"] += [f["flag"] for f in built["flags"]]
            tree_tar = _read_regular(first / "out" / "tree.tar") if self.second_opinion else b""
            timings["prepare"] = round(time.monotonic() - started, 3)
            wire = built.get("tripwire")
            ids = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
            key = secrets.token_bytes(32)
            _write_new(first / RUN_FILE, _orders(ids, wire, key))
            run, verdict, problem = self._run_tests(box, env, "", key)
        timings["tests"] = round(run.duration_s, 3)
        statuses = verdict.get("statuses", {}) if verdict else {}
        f2p, p2p = _count(statuses, instance.FAIL_TO_PASS), _count(statuses, instance.PASS_TO_PASS)
        consistent = bool(verdict and verdict["consistent"])
        details.update(fail_to_pass=f2p, pass_to_pass=p2p, ran=_ran(run, verdict, problem, len(ids)))
        if (verdict and not consistent) or (verdict is None and run.limit is None):
            details["flags"].append("outcome-channel")
        passed = f2p["passed"] == f2p["total"] and p2p["passed"] == p2p["total"]
        details["tripwire"] = {"id": wire, "status": verdict.get("tripwire") if verdict else None}
        if passed and wire is not None and details["tripwire"]["status"] != "FAILED":
            details["flags"].append("tripwire")
            passed = False
        resolved = consistent and passed
        if not resolved:
            details.update(resolved=False, output_tail=testrun.scrub(_before_frame(run.output)[-2000:]))
            return 0.0
        if self.second_opinion and not self._second_opinions_agree(instance, scratch, env, repo, tree_tar, wire, details):
            return 0.0
        details["resolved"] = True
        return 1.0

    def _second_opinions_agree(self, instance: Instance, scratch: Path, env: Path, repo: Path, tree_tar: bytes,
                               wire: str | None, details: dict[str, Any]) -> bool:
        """Whether every FAIL_TO_PASS test passes again in a second opinion (`_second_opinion`); where one does
        not, the attempt is flagged and not resolved."""
        mark = time.monotonic()
        opinion = [self._second_opinion(scratch, n, env, repo, tree_tar, test, wire)
                   for n, test in enumerate(instance.FAIL_TO_PASS)]
        details["timings_s"]["second_opinion"] = round(time.monotonic() - mark, 3)
        agreed = all(status == "PASSED" for status in opinion)
        details["second_opinion"] = {"agreed": agreed, "statuses": dict(zip(instance.FAIL_TO_PASS, opinion))}
        if not agreed:
            details["flags"].append("second-opinion")
            details["resolved"] = False
        if any(status.startswith("TRIPWIRE") for status in opinion):
            details["flags"].append("tripwire")
        return agreed

    def _second_opinion(self, scratch: Path, n: int, env: Path, repo: Path, tree_tar: bytes, test: str,
                        wire: str | None) -> str:
        key = secrets.token_bytes(32)
        workspace = _fresh(scratch / f"second-{n}", {"in/tree.tar": tree_tar, RUN_FILE: _orders([test], wire, key)})
        with _Opened(self.sandbox(self._spec(workspace, env, repo))) as box:
            untar = _python(env, "prep.py", "untar", "/workspace/in/tree.tar", "/workspace/tree")
            _, verdict, _ = self._run_tests(box, env, f"{untar} >/dev/null && ", key)
        if not verdict or not verdict["consistent"]:
            return "INCONSISTENT"
        if wire is not None and verdict.get("tripwire") != "FAILED":
            return f"TRIPWIRE {verdict.get('tripwire')}"
        return str(verdict["statuses"].get(test, "NOT RUN"))

    def _run_tests(self, box: Sandbox, env: Path, before: str,
                   key: bytes) -> tuple[CommandResult, dict[str, Any] | None, str | None]:
        """The launcher's run of its orders (`_orders`): its result, the verdict when it is the launcher's
        (signed with this run's key, the launcher exited 0), else why not."""
        command = f"{before}exec {_python(env, 'launch.py', f'/workspace/{RUN_FILE}')}"
        run = box.run(command, timeout_s=self.timeout_s)
        return (run, *_signed_verdict(run, key))

    def _prep(self, box: Sandbox, env: Path, args: list[str]) -> dict[str, Any]:
        done = box.run(_python(env, "prep.py", *args), timeout_s=self.timeout_s)
        answer = _frame(done.output, PREP_FRAME)
        if answer is None:
            raise RuntimeError(f"prep {args[0]} gave no answer (exit {done.exit_code}, limit {done.limit}): "
                               f"{done.output[-400:]}")
        if "failed" in answer:
            raise RuntimeError(f"prep {args[0]}: {answer['failed']}")
        return answer

    def _spec(self, workspace: Path, env: Path, repo: Path) -> SandboxSpec:
        spec = testrun.sandbox_spec(workspace, env, self.timeout_s)
        git_dir = Path(repos.git(repo, "rev-parse", "--absolute-git-dir").stdout.decode().strip())
        binds = [*spec.binds, (git_dir, GRADER_MOUNT / "repo"), (INSIDE, GRADER_MOUNT / "inside")]
        limits = Limits(command_timeout_s=self.timeout_s, attempt_timeout_s=max(self.timeout_s * 4, 300.0))
        return SandboxSpec(workspace=workspace, limits=limits, network=Network.NONE, binds=binds, env=spec.env)


class _Opened:
    """A grading sandbox: emptied from inside (CLEANUP) and closed on the way out, whatever happened; a
    failure of either is logged and never hides the grading's own outcome."""

    def __init__(self, box: Sandbox):
        self.box = box

    def __enter__(self) -> Sandbox:
        return self.box

    def __exit__(self, *exc: object) -> None:
        try:
            self.box.run(CLEANUP, timeout_s=60)
        except Exception:
            log.exception("emptying a grading sandbox failed")
        try:
            self.box.close()
        except Exception:
            log.exception("closing a grading sandbox failed")


def _python(env: Path, script: str, *args: str) -> str:
    argv = [str(env.resolve() / "bin" / "python"), "-I", str(GRADER_MOUNT / "inside" / script), *args]
    return " ".join(shlex.quote(arg) for arg in argv)


def _frame(output: str, marker: str) -> dict[str, Any] | None:
    """The JSON of the output's last line when it is a `marker` frame (a frame anywhere else is not ours)."""
    at = output.rfind("\n" + marker)
    if at < 0:
        return None
    line, _, rest = output[at + 1 + len(marker):].partition("\n")
    if rest.strip():
        return None
    try:
        answer = json.loads(line)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _orders(ids: list[str], wire: str | None, key: bytes) -> bytes:
    return json.dumps({"tree": "/workspace/tree", "ids": ids, "tripwire": wire, "key": key.hex()}).encode()


def _signed_verdict(run: CommandResult, key: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The launcher's verdict, or None and the reason: it counts only when the launcher itself ended the
    command (exit 0, no limit) and its last line is a frame whose HMAC verifies under this run's key."""
    if run.limit is not None:
        return None, f"a limit ended the test run ({run.limit})"
    if run.exit_code != 0:
        return None, f"the launcher exited with {run.exit_code} (killed by the tests?)"
    at = run.output.rfind("\n" + VERDICT_FRAME)
    line, _, rest = run.output[at + 1 + len(VERDICT_FRAME):].partition("\n") if at >= 0 else ("", "", "")
    if at < 0 or rest.strip():
        return None, "no verdict frame as the output's last line"
    mac, _, body = line.partition(" ")
    if not hmac.compare_digest(mac.encode(), hmac.new(key, body.encode(), hashlib.sha256).hexdigest().encode()):
        return None, "a verdict frame that is not signed with this run's key (forged)"
    answer = json.loads(body)
    return (answer, None) if isinstance(answer, dict) else (None, "a verdict that is not an object")


def _before_frame(output: str) -> str:
    at = output.rfind("\n" + VERDICT_FRAME)
    return output if at < 0 else output[:at]


def _ran(run: CommandResult, verdict: dict[str, Any] | None, problem: str | None, tests: int) -> dict[str, Any]:
    ran: dict[str, Any] = {"exit_code": run.exit_code, "limit": run.limit, "tests": tests}
    if verdict is None:
        ran.update(consistent=False, problems=[f"no verdict from the launcher: {problem}"])
    else:
        ran.update({key: verdict.get(key) for key in ("consistent", "problems", "collected", "exitstatus")},
                   pytest_exit_code=verdict.get("exit_code"))
    return ran


def _count(statuses: dict[str, str], ids: list[str]) -> dict[str, Any]:
    failed = [test for test in ids if statuses.get(test) != "PASSED"]
    return {"total": len(ids), "passed": len(ids) - len(failed),
            "failed": {test: statuses.get(test, "NOT RUN") for test in failed[:50]}}


def _fresh(folder: Path, files: dict[str, bytes]) -> Path:
    """A new folder (in the grading's own scratch) holding `files`, written before any sandbox owns it."""
    folder.mkdir()
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


def _write_new(path: Path, data: bytes) -> None:
    """A new file in a workspace the sandbox's uid owns by now (only the grader's prep ran there): never
    through a link, never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _read_regular(path: Path) -> bytes:
    """A file the prep step wrote, read without following a link (nothing of the agent's has run yet)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not (info.st_mode & 0o170000 == 0o100000) or info.st_size > MAX_TREE_BYTES:
            raise RuntimeError(f"{path.name} is not a regular file under {MAX_TREE_BYTES} bytes")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read()
    finally:
        os.close(fd)


def _remove(scratch: Path) -> None:
    """The scratch folder, emptied inside the sandboxes already (CLEANUP); whatever a limit kept CLEANUP
    from removing goes without following a link or recursing. What cannot go is logged, never the
    grading's outcome."""
    if problems := hostfs.remove_tree(scratch):
        log.warning("could not remove all of %s: %s", scratch, "; ".join(problems[:5]))

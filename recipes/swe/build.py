"""The local task set: bugs injected into a pinned pure-Python package, kept when its own tests catch them.

`agentstream tasks swe build` (see `recipes/swe/README.md`):
  1. the pinned sdist is downloaded once (pip, sha256 checked) and unpacked into a git repository
     under the repos directory: one pristine commit;
  2. its whole test suite runs once in the sandbox: the tests that pass are the baseline;
  3. candidate bugs (`recipes.swe.mutate`) are drawn in a seeded order; for each, the suite runs on the
     buggy source; a candidate is kept when 1..MAX_F2P baseline tests fail and nothing fails to collect;
  4. a kept bug becomes a task: its base commit is the buggy source with the failing tests' functions
     removed from their files (the hidden tests), `test_patch` puts them back, `patch` (gold) undoes
     the bug; the gold patch is then graded by the real grader and the task kept only if it scores 1;
  5. the problem statement is made from the failing tests' output (the exception and its message,
     never a line of the test's code); the split is by bug site (`recipes.swe.split`): no file (or, with
     `split_by="function"`, no function) holds both a validation and a training bug.

Same package version, same seed, same limit: the same tasks, ids, commits and split.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from agentstream.recipes.swe import repos, testrun
from agentstream.recipes.swe.grader import Grader
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.mutate import KINDS, Mutation, end_line, mutations
from agentstream.recipes.swe.split import Level, split_by_site
from agentstream.schemas.errors import ServiceError
from agentstream.settings import agentstream_home

MAX_F2P = 12
"""a bug that fails more tests breaks the package wholesale (an import error): not a task"""
P2P_SAMPLE = 20
"""PASS_TO_PASS tests kept per task (a stable sample), so grading runs a few dozen tests, not the suite"""
PRISTINE_REF = "refs/heads/main"
JUNIT = ".agentstream-junit.xml"


def task_id(prefix: str, mutation: Mutation) -> str:
    """A built task's id: the package, the kind of bug and the edit's key (`pypi__toolz-1.2.0.drop_branch__0a1b2c3d`)."""
    return f"{prefix}.{mutation.kind}__{mutation.key}"


def kind_of(instance_id: str) -> str:
    """The kind of bug a built task's id names (`task_id`); `other` for any other id."""
    built = re.search(r"\.([a-z_]+)__[0-9a-f]{8}$", instance_id)
    return built.group(1) if built else "other"


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sha256: str
    repo: str
    sources: tuple[str, ...]
    """source folders or files bugs are injected into (test folders under them excluded)"""
    skip: tuple[str, ...] = ()
    """source files left alone"""

    @property
    def id_prefix(self) -> str:
        return f"{repos.slug(self.repo)}-{self.version}"


TOOLZ = Package(name="toolz", version="1.2.0", repo="pypi/toolz",
                sha256="9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
                sources=("toolz",), skip=("toolz/_signatures.py", "toolz/compatibility.py", "toolz/_version.py"))
"""toolz 1.2.0: pure Python, its tests ship inside the sdist and need only pytest, and the whole suite is fast
enough to run once per candidate bug (recipes/swe/README.md has the comparison)"""
PINNED = {"toolz": TOOLZ}


@dataclass
class Built:
    instances: list[Instance]
    tried: int
    rejected: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class BuildError(ServiceError):
    """The build cannot go on; the message names the fix."""


# --- the repository -----------------------------------------------------------------------------


def fetch_sdist(package: Package, cache: Path | None = None) -> Path:
    """The pinned sdist, downloaded once with pip and checked against its sha256."""
    cache = cache or agentstream_home() / "swe" / "sdists"
    cache.mkdir(parents=True, exist_ok=True)
    found = [p for p in cache.glob(f"{package.name}-{package.version}.tar.gz") if _sha256(p) == package.sha256]
    if found:
        return found[0]
    with tempfile.TemporaryDirectory() as scratch:
        command = ["uv", "run", "--no-project", "--with", "pip", "python", "-m", "pip", "download", "-q",
                   "--no-binary", ":all:", "--no-deps", "-d", scratch,
                   f"{package.name}=={package.version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        sdists = list(Path(scratch).glob("*.tar.gz"))
        if not sdists:
            raise BuildError(f"could not download the sdist of {package.name}=={package.version}: "
                             f"{done.stderr.strip()[-400:]} (is PyPI reachable?)")
        if _sha256(sdists[0]) != package.sha256:
            raise BuildError(f"{sdists[0].name}: sha256 {_sha256(sdists[0])}, pinned {package.sha256}")
        target = cache / f"{package.name}-{package.version}.tar.gz"
        shutil.move(sdists[0], target)
    return target


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_repo(package: Package, sdist: Path, repos_dir: Path) -> tuple[Path, str]:
    """The package's repository and its pristine commit (made from the sdist on first use)."""
    repo = repos.repo_path(repos_dir, package.repo)
    if (repo / "HEAD").exists() and repos.has_commit(repo, PRISTINE_REF):
        return repo, repos.git(repo, "rev-parse", PRISTINE_REF).stdout.decode().strip()
    repo.mkdir(parents=True, exist_ok=True)
    repos.git(repo, "init", "-q", "--bare", "-b", "main")
    with tempfile.TemporaryDirectory() as scratch:
        with tarfile.open(sdist) as tar:
            tar.extractall(scratch, filter="data")
        (top,) = Path(scratch).iterdir()
        for egg in top.rglob("*.egg-info"):
            shutil.rmtree(egg)
        env = {"GIT_INDEX_FILE": str(Path(scratch) / "index"), "GIT_WORK_TREE": str(top)}
        repos.git(repo, "add", "-A", ".", env=env)
        tree = repos.git(repo, "write-tree", env=env).stdout.decode().strip()
    sha = repos.git(repo, "commit-tree", tree, "-m", f"{package.name} {package.version} from its sdist").stdout.decode().strip()
    repos.git(repo, "update-ref", PRISTINE_REF, sha)
    return repo, sha


# --- running the suite -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SuiteRun:
    statuses: dict[str, str]
    messages: dict[str, str]
    """test id → the failure's message (exception type and text)"""
    tracebacks: dict[str, str]
    """test id → the failure's traceback (pytest's `--tb=short`)"""
    output: str


def run_suite(grader: Grader, workspace: Path, env: Path) -> SuiteRun:
    with grader.sandbox(testrun.sandbox_spec(workspace, env, grader.timeout_s)) as box:
        result = box.run(testrun.pytest_command(env, junit=JUNIT), timeout_s=grader.timeout_s)
    messages, tracebacks = _junit_failures(workspace / JUNIT)
    return SuiteRun(testrun.parse_pytest_log(result.output), messages, tracebacks, result.output)


def _junit_failures(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({junit key: message}, {junit key: traceback}) of the failed and errored cases."""
    messages: dict[str, str] = {}
    tracebacks: dict[str, str] = {}
    if not path.exists():
        return messages, tracebacks
    for case in ElementTree.parse(path).iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            key = f"{case.get('classname', '')}::{case.get('name', '')}"
            messages[key] = problem.get("message") or ""
            tracebacks[key] = problem.text or ""
    path.unlink()
    return messages, tracebacks


_FRAME = re.compile(r"^(?P<path>[^\s:][^:]*\.py):(?P<line>\d+): in (?P<function>\S+)$")


def _junit_key(test_id: str) -> str:
    """A pytest node id as junitxml names it: `a/b/test_x.py::C::test_y` → `a.b.test_x.C::test_y`."""
    path, *rest = test_id.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]]) + "::" + rest[-1]


# --- the tasks -------------------------------------------------------------------------------------


def candidates(package: Package, repo: Path, pristine: str, seed: int, kinds: Collection[str] = KINDS) -> list[Mutation]:
    """Every candidate bug of `kinds`, in the seeded order the build tries them."""
    files = repos.git(repo, "ls-tree", "-r", "--name-only", pristine).stdout.decode().split()
    found: list[Mutation] = []
    for path in sorted(files):
        if (path.endswith(".py") and path.startswith(package.sources) and path not in package.skip
                and "tests" not in Path(path).parts and not Path(path).name.startswith("test_")):
            found += [m for m in mutations(path, repos.read(repo, pristine, path)) if m.kind in kinds]
    random.Random(seed).shuffle(found)
    return found


def hide_tests(source: str, functions: set[str]) -> str | None:
    """The test file without the named test functions (`name` or `Class::name`), or None if that breaks it."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    drop: list[tuple[int, int, str]] = []

    def visit(body: list[ast.stmt], prefix: str, indent: str) -> None:
        remaining = len(body)
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}::", " " * (node.col_offset + 4))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{prefix}{node.name}" in functions:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                remaining -= 1
                drop.append((first, end_line(node), f"{indent}pass\n" if remaining == 0 and prefix else ""))

    visit(tree.body, "", "")
    for first, last, filler in sorted(drop, reverse=True):
        lines[first - 1:last] = [filler] if filler else []
    hidden = "".join(lines)
    try:
        compile(hidden, "<hidden>", "exec")
    except SyntaxError:
        return None
    return hidden


@dataclass
class Builder:
    package: Package
    grader: Grader
    repo: Path
    pristine: str
    baseline: set[str]
    template: Path
    """a checkout of the pristine commit, copied for each candidate"""
    _commit_lock: threading.Lock = field(default_factory=threading.Lock)

    def env(self) -> Path:
        return self.grader.envs_dir / repos.slug(self.package.repo)

    def attempt(self, mutation: Mutation) -> Instance | str:
        """The task this bug makes, or why there is none."""
        with tempfile.TemporaryDirectory(prefix="swe-build-") as scratch:
            workspace = Path(scratch) / "workspace"
            shutil.copytree(self.template, workspace, symlinks=True)
            source_path = workspace / mutation.path
            original = source_path.read_text()
            source_path.write_text(mutation.apply(original))
            run = run_suite(self.grader, workspace, self.env())
        if any(status == "ERROR" for status in run.statuses.values()):
            return "collection or fixture errors"
        failing = sorted(test for test in self.baseline if run.statuses.get(test) not in testrun.PASSING)
        if not failing:
            return "no test fails"
        if len(failing) > MAX_F2P:
            return "too many tests fail"
        return self._task(mutation, original, failing, run)

    def _task(self, mutation: Mutation, original: str, failing: list[str], run: SuiteRun) -> Instance | str:
        instance_id = task_id(self.package.id_prefix, mutation)
        by_file: dict[str, set[str]] = {}
        for test in failing:
            path, *names = test.split("::")
            by_file.setdefault(path, set()).add("::".join(names).split("[")[0])
        files: dict[str, str | None] = {mutation.path: mutation.apply(original)}
        for path, functions in sorted(by_file.items()):
            hidden = hide_tests(repos.read(self.repo, self.pristine, path), functions)
            if hidden is None:
                return "the failing tests cannot be hidden"
            files[path] = hidden
        hidden_ids = {t for t in self.baseline if t.split("::")[0] in by_file
                      and "::".join(t.split("::")[1:]).split("[")[0] in by_file[t.split("::")[0]]}
        with self._commit_lock:
            base = repos.commit_files(self.repo, self.pristine, files, f"task {instance_id}",
                                      ref=f"refs/tasks/{instance_id}")
        others = sorted(self.baseline - set(failing))
        others.sort(key=lambda t: (t not in hidden_ids, hashlib.sha256(f"{instance_id}:{t}".encode()).hexdigest()))
        instance = Instance(
            instance_id=instance_id, repo=self.package.repo, base_commit=base,
            problem_statement=problem_statement(self.package, failing, run, self.repo, self.pristine),
            patch=repos.diff(self.repo, base, self.pristine, mutation.path),
            test_patch=repos.diff(self.repo, base, self.pristine, *sorted(by_file)),
            FAIL_TO_PASS=failing, PASS_TO_PASS=sorted(others[:P2P_SAMPLE]),
            mutation={"kind": mutation.kind, "path": mutation.path, "line": mutation.line,
                      "function": mutation.function},
            package=f"{self.package.name}=={self.package.version}",
        )
        gold = self.grader.grade(instance, instance.patch)
        if gold.reward != 1.0:
            return "the gold patch does not pass"
        return instance


def problem_statement(package: Package, failing: list[str], run: SuiteRun, repo: Path, pristine: str) -> str:
    """What the failing tests printed, never their code: the exception and message of each, and where in
    the library it was raised, as a user's bug report shows it (lines that appear in the test files,
    the test files' frames, and pytest's `+ where`/`+ and` expansions of the test's expressions are
    dropped, addresses scrubbed)."""
    test_paths = {test.split("::")[0] for test in failing}
    code_lines = set()
    for path in test_paths:
        code_lines |= {line.strip() for line in repos.read(repo, pristine, path).splitlines() if len(line.strip()) > 3}

    def shown_lines(text: str) -> list[str]:
        return [line.rstrip() for line in testrun.scrub(text).splitlines()
                if line.strip() and line.strip() not in code_lines and not line.lstrip().startswith("+")]  # "+ where …"/"+ and …": the test's sub-expressions

    def report(test: str) -> str:
        message = shown_lines(run.messages.get(_junit_key(test), ""))[:12] or ["(no message)"]
        frames = shown_lines("\n".join(library_frames(run.tracebacks.get(_junit_key(test), ""), test_paths)))
        where = ["raised in the library at:", *(f"  {line}" for line in frames)] if frames else []
        return f"{test.split('::')[-1]}:\n" + "\n".join(f"    {line}" for line in message + where)

    # a test of one name in several classes (one per mapping type, say) reports the same thing: once
    first = list(Counter(report(test) for test in failing).items())[:3]
    shown = [text if count == 1 else text.replace(":\n", f" ({count} checks):\n", 1) for text, count in first]
    hidden = len(failing) - sum(count for _, count in first)
    more = f"\n\n({hidden} more failing check(s) not shown.)" if hidden else ""
    return (f"`{package.name}` {package.version} misbehaves: {len(failing)} check(s) of the maintainers' test "
            f"suite fail after a recent change to the library. What they report:\n\n" + "\n\n".join(shown) + more +
            "\n\nFix the library code so that the behaviour is correct again. The failing checks are not in "
            "your checkout; do not change the tests.")


def library_frames(traceback: str, test_paths: set[str], keep: int = 3) -> list[str]:
    """The innermost `keep` frames of a `--tb=short` traceback in the package's own files (not its tests,
    not the standard library's), each as `path, line N, in function` and its source line."""
    frames: list[list[str]] = []
    inside = False
    for line in traceback.splitlines():
        header = _FRAME.match(line)
        if header:
            path = header["path"]
            inside = not (path.startswith("/") or path in test_paths or Path(path).name.startswith(("test_", "conftest")))
            if inside:
                frames.append([f"{path}, line {header['line']}, in {header['function']}"])
        elif inside and line.startswith("    ") and line.strip() and set(line.strip()) != {"^"}:  # 3.11's carets
            frames[-1].append(f"  {line.strip()}")
        elif not line.startswith("    "):
            inside = False
    return [line for frame in frames[-keep:] for line in frame]


def build(package: Package = TOOLZ, *, limit: int = 60, seed: int = 0, repos_dir: Path | None = None,
          envs_dir: Path | None = None, workers: int = 2, timeout_s: float = 120.0,
          progress: Callable[[int, int, int], None] | None = None, grader: Grader | None = None,
          split_by: Level = "file", kinds: Collection[str] = KINDS) -> Built:
    """Build up to `limit` tasks from bugs of `kinds`, split by bug site (`recipes.swe.split`);
    `progress(kept, tried, total)` after each candidate."""
    import time

    started = time.monotonic()
    repos_dir = repos_dir or repos.default_repos_dir()
    envs_dir = envs_dir or repos.default_envs_dir()
    grader = grader or Grader(repos_dir=repos_dir, envs_dir=envs_dir, timeout_s=timeout_s)
    repo, pristine = ensure_repo(package, fetch_sdist(package), repos_dir)
    env = testrun.ensure_env(envs_dir / repos.slug(package.repo))
    with tempfile.TemporaryDirectory(prefix="swe-build-") as scratch:
        template = Path(scratch) / "pristine"
        repos.checkout(repo, pristine, template)
        probe = Path(scratch) / "baseline"
        shutil.copytree(template, probe, symlinks=True)
        base_run = run_suite(grader, probe, env)
        baseline = set(testrun.passed(base_run.statuses, base_run.statuses))
        if not baseline:
            raise BuildError(f"no test of {package.name} passes in the sandbox; its output ends:\n{base_run.output[-1500:]}")
        builder = Builder(package, grader, repo, pristine, baseline, template)
        pool = candidates(package, repo, pristine, seed, kinds)
        results, rejected = _in_order(builder.attempt, pool, limit, workers, progress)
    instances = [r for r in results if isinstance(r, Instance)][:limit]
    split = split_by_site(instances, split_by)
    for instance in instances:
        instance.split = split.splits[instance.instance_id]
    return Built(instances, tried=len(results), rejected=rejected, seconds=time.monotonic() - started)


def _in_order(attempt: Callable[[Mutation], Instance | str], pool: list[Mutation], limit: int, workers: int,
              progress: Callable[[int, int, int], None] | None) -> tuple[list[Instance | str], dict[str, int]]:
    """Candidates tried `workers` at a time; the result is the shortest prefix of `pool` that holds
    `limit` tasks, whatever order the workers finish in (so the build is deterministic)."""
    done: dict[int, Instance | str] = {}
    running: dict[Future[Instance | str], int] = {}
    following = iter(range(len(pool)))

    def prefix_kept() -> int | None:
        kept = 0
        for index in range(len(pool)):
            if index not in done:
                return None
            kept += isinstance(done[index], Instance)
            if kept >= limit:
                return index + 1
        return len(pool)

    with ThreadPoolExecutor(workers, thread_name_prefix="swe-build") as executor:
        while True:
            while len(running) < workers and (index := next(following, None)) is not None:
                running[executor.submit(attempt, pool[index])] = index
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                index = running.pop(future)
                done[index] = future.result()
            kept = sum(isinstance(r, Instance) for r in done.values())
            if progress:
                progress(kept, len(done), len(pool))
            end = prefix_kept()
            if end is not None:
                for future in running:
                    future.cancel()
                wait(running)
                return _with_reasons([done[i] for i in range(end)])
    return _with_reasons([done[i] for i in sorted(done)])


def _with_reasons(results: list[Instance | str]) -> tuple[list[Instance | str], dict[str, int]]:
    rejected: dict[str, int] = {}
    for result in results:
        if isinstance(result, str):
            rejected[result] = rejected.get(result, 0) + 1
    return results, rejected


def write(instances: list[Instance], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as file:
        for instance in instances:
            file.write(orjson.dumps(instance.model_dump(mode="json")) + b"\n")


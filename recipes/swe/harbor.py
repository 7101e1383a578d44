"""Harbor-format tasks (the format SkyRL, rLLM, verifiers, NeMo Gym and TRL consume), loaded as coding tasks.

A Harbor task is a folder: `task.toml` (metadata, timeouts), `instruction.md` (what the agent is told),
`environment/Dockerfile` (the container the agent works in), `tests/test.sh` (the verifier: it writes the
reward to /logs/verifier/reward.txt, or reward.json) and optionally `solution/solve.sh`. `load_harbor` takes
one such folder or a folder of them and gives `Instance`s the rest of the recipe runs unchanged:

- the instruction is the problem statement;
- the environment is a local git repository (`harbor__<task>` in the repos folder) whose one commit holds
  the files the Dockerfile copies into its WORKDIR: the harness checks it out as it checks out any base
  commit, and the agent's diff is taken against it;
- the hidden tests are the task's tests/ folder, named in `Instance.harbor`: never in the agent's
  workspace nor in its sandbox; the grader (`recipes.swe.harbor_grade`) binds them at /tests after the
  attempt, in a fresh sandbox, and the reward is what test.sh writes.

No image is built (no registry is reachable here and there is no Docker daemon): a task runs in this
project's sandbox, whose system is the host's (Debian 12, Python 3.11) with no network. So a Dockerfile is
read, not run, and only what that sandbox can honour is taken: FROM one of `BASES`, WORKDIR /workspace, COPY
of files from environment/, ENV; CMD, ENTRYPOINT, LABEL, EXPOSE, USER, ARG, SHELL and HEALTHCHECK change
nothing an attempt sees and are passed over. Anything else (RUN, ADD of a URL, COPY --from, another WORKDIR,
a docker-compose.yaml, GPUs) is refused with the file, its line and why, before anything runs.
"""

from __future__ import annotations

import re
import shlex
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentstream.recipes.swe.instance import Instance, assign_splits
from agentstream.recipes.swe.repos import FIXED, git, has_commit, repo_path
from agentstream.recipes.swe.task_errors import InstanceFileError
from agentstream.sandbox.contract import WORKSPACE_MOUNT
from agentstream.schemas.errors import ConfigurationError

OWNER = "harbor"
"""the repository owner of every Harbor task's environment (`harbor/<task>`, on disk `harbor__<task>`)"""
BASES = ("python:3.11", "python:3.11-slim", "python:3.11-bookworm", "python:3.11-slim-bookworm",
         "debian:bookworm", "debian:bookworm-slim", "debian:12", "debian:12-slim")
"""the images this sandbox stands for: its system is the host's /usr (Debian 12, Python 3.11), read-only"""
IGNORED = frozenset({"CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "USER", "ARG", "SHELL", "HEALTHCHECK",
                     "MAINTAINER", "STOPSIGNAL", "VOLUME", "ONBUILD"})
"""instructions that change nothing an attempt sees here (the sandbox picks the user, there is no network)"""
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
"""Harbor's default [verifier] timeout_sec"""


class HarborTaskError(InstanceFileError):
    """A Harbor task folder that cannot run here: the message names the file, the field or line, and why."""

    def __init__(self, message: str):
        ConfigurationError.__init__(self, message)
        self.path, self.problems = Path(message.split(":", 1)[0]), []


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Verifier(_Section):
    timeout_sec: float = Field(DEFAULT_VERIFIER_TIMEOUT_S, gt=0)
    env: dict[str, str] = {}


class _Agent(_Section):
    timeout_sec: float | None = Field(None, gt=0)


class _Environment(_Section):
    docker_image: str | None = None
    gpus: int = Field(0, ge=0)


class _Package(_Section):
    name: str


class TaskToml(BaseModel):
    """The fields of Harbor's task.toml this loader reads; the others are kept in `metadata` or passed over."""

    model_config = ConfigDict(extra="allow")
    task: _Package | None = None
    metadata: dict[str, Any] = {}
    verifier: _Verifier = Field(default_factory=_Verifier)
    agent: _Agent = Field(default_factory=_Agent)
    environment: _Environment = Field(default_factory=_Environment)


class HarborSpec(BaseModel):
    """What the grader needs of a Harbor task, carried in `Instance.harbor` (instances files keep it)."""

    task_dir: str
    """the task's folder on the grader's host (its tests/ are bound at /tests when grading)"""
    verifier_timeout_s: float
    verifier_env: dict[str, str] = {}
    env: dict[str, str] = {}
    """the Dockerfile's ENV, for the agent's commands and the verifier's"""
    agent_timeout_s: float | None = None

    @property
    def tests(self) -> Path:
        return Path(self.task_dir) / "tests"


def harbor_spec(instance: Instance) -> HarborSpec | None:
    """The instance's Harbor spec, or None for an SWE-bench instance."""
    raw = (instance.model_extra or {}).get("harbor")
    return HarborSpec.model_validate(raw) if raw is not None else None


def is_harbor_dir(path: Path) -> bool:
    """A Harbor task folder, or a folder of them."""
    return path.is_dir() and ((path / "task.toml").is_file() or any(path.glob("*/task.toml")))


def load_harbor(path: Path, repos_dir: Path) -> list[Instance]:
    """Every task under `path` (a task folder or a folder of task folders) as an Instance, its environment
    committed to `repos_dir`; HarborTaskError naming each bad folder's file and field."""
    folders = [path] if (path / "task.toml").is_file() else sorted(p.parent for p in path.glob("*/task.toml"))
    if not folders:
        raise HarborTaskError(f"{path}: no task.toml in it nor in any folder inside it: not a Harbor task folder")
    parsed, problems = [], []
    for folder in folders:
        try:
            parsed.append(_read_task(folder))
        except HarborTaskError as exc:
            problems.append(str(exc))
    ids = [task.instance_id for task in parsed]
    if repeated := sorted({i for i in ids if ids.count(i) > 1}):
        problems.append(f"{path}: task names repeat: {', '.join(repeated)}")
    if problems:
        raise HarborTaskError(f"{len(problems)} bad Harbor task(s), nothing was run:\n  " + "\n  ".join(problems))
    splits = assign_splits(ids)
    return [task.instance(_commit_environment(task, repos_dir), splits[task.instance_id]) for task in parsed]


@dataclass
class _Task:
    folder: Path
    instance_id: str
    instruction: str
    config: TaskToml
    copies: list[tuple[Path, str]]
    """(file or folder in environment/, destination relative to the workspace)"""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def repo(self) -> str:
        return f"{OWNER}/{self.instance_id}"

    def instance(self, commit: str, split: str) -> Instance:
        spec = HarborSpec(task_dir=str(self.folder.resolve()), verifier_timeout_s=self.config.verifier.timeout_sec,
                          verifier_env=self.config.verifier.env, env=self.env,
                          agent_timeout_s=self.config.agent.timeout_sec)
        given = self.config.metadata.get("split")
        return Instance.model_validate({
            "instance_id": self.instance_id, "repo": self.repo, "base_commit": commit,
            "problem_statement": self.instruction, "patch": "", "test_patch": "",
            "FAIL_TO_PASS": ["tests/test.sh"], "PASS_TO_PASS": [],
            "split": given if given in ("train", "validation") else split,
            "harbor": spec.model_dump(mode="json")})


def _read_task(folder: Path) -> _Task:
    config = _read_toml(folder / "task.toml")
    instruction = _need_file(folder / "instruction.md").read_text(encoding="utf-8").strip()
    if not instruction:
        raise HarborTaskError(f"{folder / 'instruction.md'}: empty: the instruction is what the agent is told")
    test_sh = _need_file(folder / "tests" / "test.sh")
    if test_sh.is_symlink():
        raise HarborTaskError(f"{test_sh}: a symlink: the verifier must be a file of the task")
    environment = folder / "environment"
    if (environment / "docker-compose.yaml").exists() or (environment / "docker-compose.yml").exists():
        raise HarborTaskError(f"{environment / 'docker-compose.yaml'}: several containers cannot run here: "
                              "a task runs in one sandbox")
    if config.environment.gpus:
        raise HarborTaskError(f"{folder / 'task.toml'}: environment.gpus = {config.environment.gpus}: the sandbox "
                              "has no GPU")
    name = config.task.name if config.task else folder.name
    instance_id = re.sub(r"[^A-Za-z0-9._-]+", "__", name).strip("_")
    if config.environment.docker_image is not None:
        _check_base(config.environment.docker_image, f"{folder / 'task.toml'}: environment.docker_image")
        if not (environment / "Dockerfile").is_file():
            return _Task(folder, instance_id, instruction, config, [])
    copies, env = _read_dockerfile(_need_file(environment / "Dockerfile"), environment)
    return _Task(folder, instance_id, instruction, config, copies, env)


def _need_file(path: Path) -> Path:
    if not path.is_file():
        raise HarborTaskError(f"{path}: missing: a Harbor task needs task.toml, instruction.md, "
                              "environment/Dockerfile and tests/test.sh")
    return path


def _read_toml(path: Path) -> TaskToml:
    try:
        data = tomllib.loads(_need_file(path).read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise HarborTaskError(f"{path}: not TOML ({exc})") from None
    if "version" in data:  # Harbor's older spelling of schema_version
        data.setdefault("schema_version", data.pop("version"))
    try:
        return TaskToml.model_validate(data)
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_url=False))
        raise HarborTaskError(f"{path}: {reasons}") from None


def _check_base(image: str, where: str) -> None:
    bare = image.split("@", 1)[0].removeprefix("docker.io/").removeprefix("library/")
    if bare not in BASES:
        raise HarborTaskError(f"{where}: image {image!r} cannot be built or pulled here (no registry, no Docker "
                              f"daemon); the sandbox stands for {', '.join(BASES)} (the host's Debian 12 and "
                              "Python 3.11)")


def _instructions(dockerfile: Path) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments), continuation lines joined and comments dropped."""
    out: list[tuple[int, str, str]] = []
    pending, start = "", 0
    for number, line in enumerate(dockerfile.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = (pending + stripped).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((start, word.upper(), rest.strip()))
    if pending:
        out.append((start, pending.split(" ", 1)[0].upper(), pending.partition(" ")[2].strip()))
    return out


def _read_dockerfile(dockerfile: Path, context: Path) -> tuple[list[tuple[Path, str]], dict[str, str]]:
    copies: list[tuple[Path, str]] = []
    env: dict[str, str] = {}
    seen_from = False
    for number, word, args in _instructions(dockerfile):
        where = f"{dockerfile}:{number}: {word}"
        if word == "FROM":
            if seen_from:
                raise HarborTaskError(f"{where}: a second FROM (a multi-stage build) needs the image built")
            _check_base(args.split()[0] if args else "", where)
            seen_from = True
        elif word == "WORKDIR":
            if Path(args) != WORKSPACE_MOUNT:
                raise HarborTaskError(f"{where} {args}: the sandbox's one writable tree is {WORKSPACE_MOUNT}; "
                                      f"a task runs here with WORKDIR {WORKSPACE_MOUNT}")
        elif word in ("COPY", "ADD"):
            copies += _copies(where, args, context)
        elif word == "ENV":
            env.update(_env(where, args))
        elif word == "RUN":
            raise HarborTaskError(f"{where}: the image is not built here (no registry, no Docker daemon, no network "
                                  "in the sandbox): put the files the task needs in environment/ and COPY them")
        elif word not in IGNORED:
            raise HarborTaskError(f"{where}: an instruction this loader does not know")
    if not seen_from:
        raise HarborTaskError(f"{dockerfile}: no FROM")
    return copies, env


def _copies(where: str, args: str, context: Path) -> list[tuple[Path, str]]:
    words = shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    if bad := [f for f in flags if not f.startswith(("--chown", "--chmod"))]:
        raise HarborTaskError(f"{where}: {bad[0]}: only files of environment/ can be copied here")
    paths = [w for w in words if not w.startswith("--")]
    if len(paths) < 2:
        raise HarborTaskError(f"{where}: a source and a destination are needed")
    *sources, dest = paths
    dest_path = Path(dest)
    if dest_path.is_absolute():
        try:
            dest_path = dest_path.relative_to(WORKSPACE_MOUNT)
        except ValueError:
            raise HarborTaskError(f"{where}: destination {dest} is outside {WORKSPACE_MOUNT}, the sandbox's one "
                                  "writable tree") from None
    if ".." in dest_path.parts:
        raise HarborTaskError(f"{where}: destination {dest} leaves {WORKSPACE_MOUNT}")
    into_folder = dest.endswith("/") or len(sources) > 1 or str(dest_path) == "."
    out = []
    root = context.resolve()
    for source in sources:
        if "://" in source:
            raise HarborTaskError(f"{where}: {source}: nothing is fetched here (no network)")
        path = (context / source).resolve()
        if path != root and root not in path.parents:
            raise HarborTaskError(f"{where}: {source} is outside environment/")
        if not path.exists():
            raise HarborTaskError(f"{where}: {source} is not in environment/")
        if path.is_dir():
            out.append((path, str(dest_path)))
        else:
            out.append((path, str(dest_path / path.name) if into_folder else str(dest_path)))
    return out


def _env(where: str, args: str) -> dict[str, str]:
    words = shlex.split(args)
    if words and "=" not in words[0]:  # the old form: ENV NAME value with spaces
        return {words[0]: args.partition(" ")[2].strip().strip('"')}
    pairs = [w.partition("=") for w in words]
    if any(not sep for _, sep, _ in pairs):
        raise HarborTaskError(f"{where}: expected NAME=value pairs")
    return {name: value for name, _, value in pairs}


def _commit_environment(task: _Task, repos_dir: Path) -> str:
    """The files the Dockerfile copies, as the one commit (no parent) of `harbor__<task>`: the same files give
    the same sha on every machine (fixed author and dates), so a task set loaded again names the same commit."""
    repo = repo_path(repos_dir, task.repo)
    if not (repo / "HEAD").exists():
        repo.mkdir(parents=True, exist_ok=True)
        git(repo, "init", "--quiet", "--bare")
    with tempfile.TemporaryDirectory(prefix="harbor-env-") as scratch:
        tree = Path(scratch) / "tree"
        tree.mkdir()
        for source, dest in task.copies:
            _copy(source, tree / dest)
        index = {"GIT_INDEX_FILE": str(Path(scratch) / "index")}
        git(tree, f"--git-dir={repo}", f"--work-tree={tree}", "add", "-A", "-f", ".", env=index)
        tree_sha = git(tree, f"--git-dir={repo}", "write-tree", env=index).stdout.decode().strip()
    commit = git(repo, "commit-tree", tree_sha, "-m", f"{task.instance_id}: its environment",
                 env=FIXED).stdout.decode().strip()
    if not has_commit(repo, commit):
        raise HarborTaskError(f"{task.folder}: its environment could not be committed to {repo}")
    git(repo, "update-ref", "refs/heads/main", commit)
    return commit


def _copy(source: Path, dest: Path) -> None:
    """A file or a folder of environment/ into the tree, without following a link out of it."""
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
    else:
        shutil.copy2(source, dest, follow_symlinks=False)

"""Running a repository's tests inside a sandbox, and reading what pytest reported.

The test environment is a venv with pytest pinned, built once (uv) and bound read-only into every
sandbox. The package under test is never installed in it: a `.pth` file in the venv appends the
workspace to `sys.path`, and the interpreter runs isolated (`-I`: no PYTHONPATH, no current
directory first), so the workspace comes *after* the standard library and pytest and cannot shadow
them. The venv also holds an empty `sitecustomize`/`usercustomize`, found before any in the workspace.

Statuses come from pytest's `-rA` summary, read as SWE-bench's `parse_log_pytest` reads it
(swebench.harness.log_parsers.python; swebench itself is not a dependency: it pulls docker, modal and
datasets for these ten lines).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from agentstream.sandbox.contract import WORKSPACE_MOUNT, Limits, Network, Sandbox, SandboxSpec
from agentstream.schemas.errors import ServiceError

PYTEST_VERSION = "9.2.0"
STATUSES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")
PASSING = frozenset({"PASSED", "XFAIL"})
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_env_lock = threading.Lock()
CLEANUP = "chmod -R u+rwX /workspace 2>/dev/null; rm -rf /workspace/* /workspace/.[!.]* /workspace/..?* 2>/dev/null; true"
"""run inside, as the sandbox's uid, before a grading sandbox is closed: whatever the tests left (however deep)
goes there, not by a recursive walk on the host"""


class EnvError(ServiceError):
    """The test environment could not be built; the message names the fix."""


def ensure_env(path: Path, pytest_version: str = PYTEST_VERSION) -> Path:
    """The test venv at `path`, made on first use (system Python 3.11 + pytest), under a lock."""
    marker = path / ".agentstream-ready"
    with _env_lock:
        if marker.exists():
            return path
        python = _system_python()
        path.parent.mkdir(parents=True, exist_ok=True)
        for command in (["uv", "venv", "-q", "--clear", "--python", python, str(path)],
                        ["uv", "pip", "install", "-q", "--python", str(path / "bin" / "python"),
                         f"pytest=={pytest_version}"]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise EnvError(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]} "
                               f"(is uv on PATH, and PyPI reachable?)")
        site = next((path / "lib").glob("python3*/site-packages"))
        (site / "agentstream_workspace.pth").write_text(f"{WORKSPACE_MOUNT}\n")
        (site / "sitecustomize.py").write_text("# agentstream: shadows any sitecustomize in the workspace\n")
        (site / "usercustomize.py").write_text("# agentstream: shadows any usercustomize in the workspace\n")
        marker.write_text(pytest_version + "\n")
    return path


def _system_python() -> str:
    # an interpreter under /usr is visible inside every sandbox (the system is bound read-only)
    for candidate in ("/usr/bin/python3.11", "/usr/bin/python3"):
        if Path(candidate).exists():
            return candidate
    raise EnvError("no system Python 3 under /usr/bin; install it (apt-get install python3)")


def sandbox_spec(workspace: Path, env: Path, timeout_s: float) -> SandboxSpec:
    limits = Limits(command_timeout_s=timeout_s, attempt_timeout_s=max(timeout_s * 4, 300.0))
    return SandboxSpec(workspace=workspace, limits=limits, network=Network.NONE, binds=_binds(env),
                       env={"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"})


def _binds(env: Path) -> list[tuple[Path, Path]]:
    try:
        from agentstream.sandbox.local import python_binds
    except ImportError:  # a backend without the helper: the venv at its own path (its interpreter is under /usr)
        return [(env.resolve(), env.resolve())]
    return list(python_binds(env))


def make_sandbox(spec: SandboxSpec) -> Sandbox:
    from agentstream.sandbox.local import LocalSandbox

    return LocalSandbox(spec)


def pytest_command(env: Path, test_ids: Sequence[str] = (), junit: str | None = None) -> str:
    argv = [str(env.resolve() / "bin" / "python"), "-I", "-m", "pytest", "-rA", "-p", "no:cacheprovider",
            "--tb=short", "-q", "--color=no", "-o", "console_output_style=classic"]
    if junit:
        argv.append(f"--junitxml={junit}")
    argv += list(test_ids)
    return " ".join(shlex.quote(arg) for arg in argv)


def parse_pytest_log(log: str) -> dict[str, str]:
    """{test id: status} from a `-rA` summary (the rule of swebench's parse_log_pytest)."""
    statuses: dict[str, str] = {}
    for line in log.splitlines():
        if not line.startswith(STATUSES):
            continue
        if line.startswith("FAILED"):
            line = line.replace(" - ", " ")
        words = line.split()
        if len(words) <= 1 or (words[0] == "SKIPPED" and re.fullmatch(r"\[\d+\]", words[1])):
            continue
        statuses[words[1]] = words[0]
    return statuses


def passed(statuses: dict[str, str], ids: Iterable[str]) -> list[str]:
    return [test for test in ids if statuses.get(test) in PASSING]


def scrub(text: str) -> str:
    """Output without what differs from run to run (memory addresses)."""
    return _ADDRESS.sub("0x…", text)

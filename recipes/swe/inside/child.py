"""The test process (started by `launch.py`): pytest with its configuration, rootdir and plugins pinned,
and a reporter, loaded before anything else, that streams every test's outcome to the launcher.

    python -I child.py FD TREE TEST_ID...

FD is the write end of the launcher's pipe; it is made close-on-exec at once, so no program the tests
start inherits it. The reporter writes one JSON line per event: the ids collected, each phase's report
(setup/call/teardown, outcome, whether it was an expected failure) and the session's exit status. Code
under test runs in this process and could write to FD too; the launcher refuses a run in which a phase
is reported twice or the exit status disagrees with the process's own.

Configuration: the tree's own pytest configuration file (the first of pytest's names at the tree's root
that holds pytest settings: it is the base commit's, changes to it are refused) is copied outside the
tree and passed with `-c`; `--rootdir` and `--confcutdir` are the tree; plugin autoloading is off and only the entry points
installed in the test environment itself are loaded (`-p`), never metadata found in the workspace.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the test environment's pytest, imported by main once sys.path is pinned
    import pytest

WORKSPACE = "/workspace"


class Reporter:
    def __init__(self, fd: int):
        self.fd = fd

    def send(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=True) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.send({"collected": [item.nodeid for item in session.items]})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.send({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                   "xfail": hasattr(report, "wasxfail")})

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
        self.send({"exitstatus": int(exitstatus)})


def installed_plugins() -> list[str]:
    """pytest11 entry points of the test environment's own site-packages (read before the tree is on sys.path)."""
    from importlib import metadata

    paths = [p for p in sys.path if p and not p.startswith(WORKSPACE)]
    names = {ep.name for dist in metadata.distributions(path=paths) for ep in dist.entry_points if ep.group == "pytest11"}
    return sorted(names)


def pinned_config(tree: str) -> str:
    from pathlib import Path

    from _pytest.config.findpaths import CONFIG_LOADERS_BY_NAME, load_config_dict_from_file

    folder = tempfile.mkdtemp(prefix="agentstream-pytest-config-")
    for name in CONFIG_LOADERS_BY_NAME:
        candidate = Path(tree) / name
        if candidate.is_file() and not candidate.is_symlink() and load_config_dict_from_file(candidate) is not None:
            copy = Path(folder) / name
            copy.write_bytes(candidate.read_bytes())
            return str(copy)
    empty = Path(folder) / "pytest.ini"
    empty.write_text("[pytest]\n")
    return str(empty)


def main(argv: list[str]) -> int:
    fd, tree, ids = int(argv[0]), argv[1], argv[2:]
    os.set_inheritable(fd, False)
    plugins = installed_plugins()
    config = pinned_config(tree)
    # the tree goes last on sys.path, nothing else of the workspace (the test venv's .pth names /workspace)
    sys.path[:] = [p for p in sys.path if not (p == WORKSPACE or p.startswith(WORKSPACE + "/"))] + [tree]
    os.chdir(tree)
    import pytest

    args = ["-c", config, "--rootdir", tree, "--confcutdir", tree, "-p", "no:cacheprovider", "-q", "-rA", "--tb=short", "--color=no",
            "-o", "console_output_style=classic"]
    for name in plugins:
        args += ["-p", name]
    return int(pytest.main([*args, "--", *ids], plugins=[Reporter(fd)]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

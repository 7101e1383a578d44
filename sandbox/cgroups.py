"""Limits that sum over every process of one sandbox: a cgroup of its own.

rlimits are per process (RLIMIT_AS) or per uid (RLIMIT_NPROC) and say nothing of page cache, tmpfs
pages or CPU shares; a cgroup does. Each sandbox gets one group per hierarchy, made under the host
process's own group (so whatever bounds the host bounds its sandboxes too):
  - memory: `Limits.memory_bytes` for all its processes together, page cache and tmpfs pages (/tmp)
    included, swap too where the kernel accounts it; past it the kernel's OOM killer ends a process of
    the group, and the command reports `memory`;
  - pids: `Limits.processes` tasks (threads count, as with RLIMIT_NPROC); a fork past it fails (EAGAIN);
  - cpu: `Limits.cpus` cores of quota per 100 ms period (CFS bandwidth);
  - freezer (v1) or cgroup.kill (v2): what is left is frozen, killed and the group removed at close.
Every process joins before it runs anything of the sandbox's: a command starts as `sh -c 'echo $$ >
<group>/cgroup.procs …; exec "$@"'` (`join_argv`), still root, and everything it starts is born inside.

cgroup v1 (one hierarchy per controller) and v2 (one unified tree, when it has the controllers and the
host's group may delegate them) are both handled; a host with neither is told once in the log, and the
sandbox keeps its rlimits alone.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agentstream.sandbox.contract import Limits

log = logging.getLogger(__name__)

PREFIX = "agentstream-sandbox-"
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")
V1_REQUIRED = ("memory", "pids")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
JOIN = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; exec "$@"'
"""moves the shell into each cgroup.procs file named before `--`, then becomes the command after it"""
_warned = False


@dataclass
class Cgroup:
    dirs: dict[str, Path]
    """controller -> the group's directory (v1); v2: {"unified": the one directory}"""
    version: int

    @property
    def _unique_dirs(self) -> list[Path]:
        return list(dict.fromkeys(self.dirs.values()))

    def join_argv(self) -> list[str]:
        """The argv prefix that starts a command inside the group."""
        return ["/bin/sh", "-c", JOIN, "cgroup-join", *(str(d / "cgroup.procs") for d in self._unique_dirs), "--"]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for folder in self._unique_dirs:
            try:
                found.update(int(line) for line in (folder / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                pass
        return found

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return _counter(self.dirs.get("memory", self.dirs.get("unified")), name, "oom_kill")

    def fork_refusals(self) -> int:
        return _counter(self.dirs.get("pids", self.dirs.get("unified")), "pids.events", "max")

    def peak_memory(self) -> int:
        folder = self.dirs.get("memory", self.dirs.get("unified"))
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((folder / name).read_text()) if folder else 0
        except (FileNotFoundError, ValueError):
            return 0

    def kill_all(self, timeout_s: float = 10.0) -> bool:
        """SIGKILL every process of the group (frozen first where a freezer exists, so a fork bomb cannot
        outrun the kill); True once none is left."""
        deadline = time.monotonic() + timeout_s
        while self.pids():
            if time.monotonic() > deadline:
                return False
            if self.version == 2 and (self.dirs["unified"] / "cgroup.kill").exists():
                _write(self.dirs["unified"] / "cgroup.kill", "1")
            else:
                with self._frozen():
                    for pid in self.pids():
                        _kill(pid)
            time.sleep(0.005)
        return True

    def _frozen(self) -> _Freeze:
        return _Freeze(self.dirs.get("freezer"))

    def remove(self) -> list[str]:
        """Kill what is left and remove the group; what could not be done, if anything."""
        problems = [] if self.kill_all() else [f"processes still in {self._unique_dirs[0]}"]
        for folder in self._unique_dirs:
            try:
                folder.rmdir()
            except FileNotFoundError:
                pass
            except OSError as error:
                problems.append(f"rmdir {folder}: {error.strerror}")
        return problems


class _Freeze:
    def __init__(self, folder: Path | None):
        self.state = folder / "freezer.state" if folder else None

    def __enter__(self) -> None:
        if self.state is None:
            return
        _write(self.state, "FROZEN")
        deadline = time.monotonic() + 2.0
        while self.state.read_text().strip() != "FROZEN" and time.monotonic() < deadline:
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        if self.state is not None:
            _write(self.state, "THAWED")  # the killed processes die as they thaw


def create(name: str, limits: Limits) -> Cgroup | None:
    """A new group `PREFIX + name` with `limits` (one left by a crashed sandbox of that name is emptied and
    reused), or None where this host has no usable cgroups (logged once)."""
    hierarchies = _hierarchies()
    try:
        if "unified" in hierarchies and not any(c in hierarchies for c in V1_REQUIRED):
            return _create_v2(hierarchies["unified"] / f"{PREFIX}{name}", limits)
        missing = [c for c in V1_REQUIRED if c not in hierarchies]
        if missing:
            _warn(f"no cgroup v1 hierarchy for {', '.join(missing)} and no cgroup v2 with its controllers")
            return None
        group = Cgroup({c: hierarchies[c] / f"{PREFIX}{name}" for c in V1_CONTROLLERS if c in hierarchies}, 1)
        for folder in group.dirs.values():
            folder.mkdir(exist_ok=True)
        group.kill_all()
        _set_v1(group, limits)
        return group
    except OSError as error:
        _warn(f"could not make a cgroup ({error})")
        return None


def leftovers() -> dict[str, list[Path]]:
    """name -> directories of every sandbox group in this process's hierarchies (a host process that died
    leaves its sandbox's groups behind; the caller removes those nobody holds)."""
    found: dict[str, list[Path]] = {}
    for folder in _hierarchies().values():
        try:
            for entry in folder.iterdir():
                if entry.name.startswith(PREFIX):
                    found.setdefault(entry.name[len(PREFIX):], []).append(entry)
        except OSError:
            pass
    return found


def remove_empty(dirs: Iterable[Path]) -> None:
    for folder in dirs:
        try:
            folder.rmdir()  # refused while a process is inside
        except OSError:
            pass


def _set_v1(group: Cgroup, limits: Limits) -> None:
    memory = group.dirs["memory"]
    _write(memory / "memory.limit_in_bytes", str(limits.memory_bytes))
    if (memory / "memory.memsw.limit_in_bytes").exists():
        _write(memory / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))  # no escape into swap
    _write(group.dirs["pids"] / "pids.max", str(limits.processes))
    if "cpu" in group.dirs:
        _write(group.dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(group.dirs["cpu"] / "cpu.cfs_quota_us", str(_quota_us(limits)))


def _create_v2(folder: Path, limits: Limits) -> Cgroup | None:
    available = set((folder.parent / "cgroup.controllers").read_text().split())
    if not set(V2_CONTROLLERS) <= available:
        _warn(f"cgroup v2 at {folder.parent} lacks {', '.join(sorted(set(V2_CONTROLLERS) - available))}")
        return None
    _write(folder.parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS))
    folder.mkdir(exist_ok=True)
    group = Cgroup({"unified": folder}, 2)
    group.kill_all()
    _write(folder / "memory.max", str(limits.memory_bytes))
    if (folder / "memory.swap.max").exists():
        _write(folder / "memory.swap.max", "0")
    _write(folder / "pids.max", str(limits.processes))
    _write(folder / "cpu.max", f"{_quota_us(limits)} {CPU_PERIOD_US}")
    return group


def _quota_us(limits: Limits) -> int:
    return max(1000, int(limits.cpus * CPU_PERIOD_US))


def _hierarchies() -> dict[str, Path]:
    """controller (v1) or "unified" (v2) -> this process's own group directory in that hierarchy."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else ["unified"]:
            own[controller] = path
    found: dict[str, Path] = {}
    for fields in _mounts():
        root, point, fstype, options = fields
        names = ["unified"] if fstype == "cgroup2" else [o for o in options.split(",") if o in V1_CONTROLLERS]
        for name in names:
            if name in own and name not in found:
                found[name] = Path(point) / os.path.relpath(own[name], root)
    return found


def _mounts() -> Iterable[tuple[str, str, str, str]]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, after = line.split(" - ", 1)
        fields, tail = before.split(), after.split()
        if tail[0] in ("cgroup", "cgroup2"):
            yield fields[3], fields[4], tail[0], tail[2] if len(tail) > 2 else ""


def _counter(folder: Path | None, name: str, key: str) -> int:
    if folder is None:
        return 0
    try:
        for line in (folder / name).read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
    except (FileNotFoundError, ValueError):
        pass
    return 0


def _write(path: Path, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _warn(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("sandbox: %s; commands are bounded by rlimits alone (per process: no total memory, "
                    "page cache or CPU quota)", why)

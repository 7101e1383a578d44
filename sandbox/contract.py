"""The sandbox contract every backend keeps, and what callers (harness, grader, task builder) use.

A sandbox holds one workspace (a directory the caller owns on the host). Commands run inside it with:
  - the workspace as the only writable tree (mounted at `WORKSPACE_MOUNT`), a private /tmp;
  - the system read-only, plus the read-only `binds` the caller names (a task's Python environment);
  - no network (`Network.NONE`), or only the gateway (`Network.GATEWAY`, for whole-harness mode);
  - an environment built from nothing but `env` (no variable of the caller's leaks in: no credentials);
  - the `Limits` below, per command and per attempt.
A command that breaks a limit is ended and reported in its `CommandResult`; it never raises. Errors
that are the caller's (a workspace that does not exist, bubblewrap missing) raise `SandboxError`.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agentstream.schemas.errors import ServiceError

WORKSPACE_MOUNT = Path("/workspace")
"""where the workspace appears inside every sandbox"""
IN_POD_ENV = "AGENTSTREAM_SANDBOX"
"""set to `pod` in every sandbox pod (`sandbox.kubernetes.pod_spec`): a harness there runs its commands in
the pod itself (`sandbox.inpod`), not in a sandbox of its own"""


class SandboxError(ServiceError):
    """The caller's mistake or a missing host tool; the message names the fix."""


class Network(enum.Enum):
    NONE = "none"
    """tools-only mode: the harness runs outside, its commands inside, with no network at all"""
    GATEWAY = "gateway"
    """whole-harness mode: the one address the sandbox can reach is the gateway"""


@dataclass(frozen=True)
class Limits:
    cpu_seconds: int = 120
    """RLIMIT_CPU per command"""
    memory_bytes: int = 4 << 30
    """memory of the whole sandbox, page cache and /tmp included (local: its memory cgroup; Kubernetes: the
    container's limit), and RLIMIT_AS per process unless `address_space_bytes` says otherwise"""
    address_space_bytes: int | None = None
    """RLIMIT_AS per process, where it must differ from `memory_bytes`: it counts address space reserved, not
    memory used, and some runtimes reserve far more than they use (Bun: ~135 GB at start); the memory cgroup
    still bounds what they use"""
    processes: int = 256
    """tasks of the whole sandbox (local: its pids cgroup, RLIMIT_NPROC behind it; a fork bomb ends here)"""
    file_size_bytes: int = 256 << 20
    """RLIMIT_FSIZE"""
    command_timeout_s: float = 120.0
    """wall clock per command"""
    attempt_timeout_s: float = 1800.0
    """wall clock for everything run in one sandbox, counted from its creation"""
    tmp_bytes: int = 1 << 30
    """size of the private /tmp (a tmpfs: it is memory)"""
    disk_bytes: int = 8 << 30
    """size of the workspace, blocks and inodes (local: the ext4 disk it is copied onto; Kubernetes: its
    emptyDir's sizeLimit)"""
    cpus: float = 1.0
    """CPU cores (local: the cgroup's CFS quota; Kubernetes: the container's cpu limit)"""

    @property
    def address_space(self) -> int:
        """RLIMIT_AS per process."""
        return self.memory_bytes if self.address_space_bytes is None else self.address_space_bytes

    def budget(self, left_s: float, timeout_s: float | None) -> tuple[float, str]:
        """A command's wall clock and the limit that ends it: its own timeout (`timeout_s`, else
        `command_timeout_s`), or the `left_s` seconds the attempt has left when those are fewer."""
        wanted = self.command_timeout_s if timeout_s is None else timeout_s
        return (wanted, "command_timeout") if wanted <= left_s else (left_s, "attempt_timeout")


@dataclass(frozen=True)
class CommandResult:
    command: str
    exit_code: int
    """the command's exit code as bash reports it (128+N when a signal N ended it inside); negative (-9)
    when the sandbox killed it (a timeout) or did not run it (the attempt's time was spent)"""
    output: str
    """stdout and stderr interleaved, as a terminal would show them (truncated past a limit)"""
    duration_s: float
    limit: str | None = None
    """set when a limit ended the command: 'command_timeout', 'attempt_timeout', 'cpu', 'memory', 'processes',
    'file_size', 'disk' (the workspace or /tmp is full: ENOSPC)"""

    @classmethod
    def not_run(cls, command: str, limits: Limits) -> CommandResult:
        """A command asked for once the attempt's time was spent."""
        note = f"[sandbox: not run: the attempt's {limits.attempt_timeout_s:g} s are spent]"
        return cls(command, -signal.SIGKILL, note, 0.0, "attempt_timeout")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None


@dataclass(frozen=True)
class SandboxSpec:
    workspace: Path
    """host directory mounted read-write at WORKSPACE_MOUNT"""
    limits: Limits = field(default_factory=Limits)
    network: Network = Network.NONE
    binds: Sequence[tuple[Path, Path]] = ()
    """(host path, sandbox path) pairs mounted read-only"""
    env: Mapping[str, str] = field(default_factory=dict)
    """the whole environment of commands (PATH, HOME and the like are filled in if missing)"""
    gateway_url: str | None = None
    """with Network.GATEWAY: the gateway as the host sees it"""


class Sandbox(Protocol):
    spec: SandboxSpec

    def run(self, command: str, timeout_s: float | None = None, cwd: str | None = None) -> CommandResult:
        """Run a shell command (bash -c) inside the sandbox, cwd relative to the workspace."""
        ...

    def close(self) -> None:
        """End everything still running inside; idempotent."""
        ...

    def __enter__(self) -> Sandbox: ...

    def __exit__(self, *exc: object) -> None: ...

"""The sandbox contract inside a sandbox pod: the pod is the sandbox, commands are its processes.

In a Kubernetes Job made from `sandbox.kubernetes.pod_spec` the isolation is the pod's (non-root,
no capabilities, read-only root, seccomp, cgroup limits, the NetworkPolicy that allows only the
gateway). bubblewrap cannot run there (it needs root or user namespaces, both refused), and need
not: the harness and its commands share the pod by design (whole-harness mode). What this backend
still does per command, as the local one does:
  - an environment built from `SandboxSpec.env` only (none of the harness's variables, so not its
    rollout token);
  - the rlimits of `Limits` (cpu, address space, processes, file size; no core files);
  - the per-command and per-attempt wall clocks: the command's process group is killed at the deadline;
  - output kept as the local backend keeps it (first and last halves).

Commands run as the harness's uid (no privileges to switch). What keeps the harness's secrets (the
attempt's gateway token, in its environment and memory) from them, without privileges:
  - the harness makes itself non-dumpable (`prctl(PR_SET_DUMPABLE, 0)`, `harden`) before the first
    command runs: its /proc files (environ, mem, maps, fd) become root-owned and unreadable to
    same-uid processes that are not root, and ptrace and process_vm_readv are refused;
  - it refuses to run commands if an ancestor in the pod is readable: a wrapper that holds the same
    environment (`/bin/sh -c CMD` without exec, `uv run`, `timeout`) would hand the token out. The
    Job runs a one-command agent with `exec` (`sandbox.kubernetes.agent_command`), so the pod's
    first process is the harness itself;
  - the harness writes the token to no file (mini-swe-agent saves no trajectory, `output_path: None`;
    its config folder stays empty), and the commands inherit no descriptor of it.
This holds against a command running as a non-root uid, as the pod's are (runAsNonRoot, uid 1000, no
capabilities: tests/sandbox/test_inpod.py attacks it). A root command could read anything, so as root
no protection is claimed. What a command can still reach: the gateway, through the NetworkPolicy, but
without the token; the token itself is scoped to this one attempt and expires with it. No operator
credential is in the pod to find (the controller's Job carries none: tests/recipes/test_swe_kubernetes.py). A
process that leaves the command's process group (`setsid`) outlives the command; the pod's deadline
ends it. Binds are the image's own paths (a per-repo image holds the task's Python): nothing is mounted.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import threading
import time
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentstream.sandbox.contract import IN_POD_ENV, WORKSPACE_MOUNT, CommandResult, SandboxError, SandboxSpec
from agentstream.sandbox.local import DEFAULT_ENV
from agentstream.sandbox.output import collect, kill_group, limit_of

PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4  # <linux/prctl.h>


class PodEnvironment(BaseSettings):
    """What a sandbox pod's environment says about where its processes run (`sandbox.kubernetes.pod_spec`)."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore")

    sandbox: str = Field("", validation_alias=IN_POD_ENV, description="`pod` in every sandbox pod: a harness "
                         "there runs its commands in the pod itself, not in a sandbox of its own")


def in_sandbox_pod() -> bool:
    return PodEnvironment().sandbox == "pod"


def harden() -> None:
    """Keep this process's secrets from the commands it runs, which share its uid: see the docstring.

    prctl through ctypes: the PyPI wrappers (python-prctl, pyprctl) are unmaintained since 2020/21,
    and this is one call. Non-dumpable holds until this process execs or changes its uid; the
    commands (forked, then exec'd) start dumpable again, which is theirs to be."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SandboxError(f"cannot make the harness non-dumpable ({os.strerror(ctypes.get_errno())}): its "
                           "commands could read its environment; is this Linux?")
    if os.geteuid() == 0:
        return  # a root command reads every process anyway: the pod runs as a non-root uid
    for pid in _ancestors():
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                environ.read(1)
        except OSError:
            continue  # another uid's, or non-dumpable: a command cannot read it either
        raise SandboxError(
            f"process {pid} ({_name(pid)}), an ancestor of this harness, is readable by its commands and holds "
            "its environment (the attempt's token): start the harness with `exec` (the Job's command is "
            "`/bin/sh -c CMD`: give one command, which sandbox.kubernetes runs with exec), not under a wrapper "
            "process such as a shell, `uv run` or `timeout`")


def _ancestors() -> list[int]:
    """This process's parent, its parent, … up to the pod's (or the host's) first process."""
    found: list[int] = []
    pid = os.getppid()
    while pid > 0 and pid not in found:
        found.append(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state; the name may hold spaces
    return found


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


class InPodSandbox:
    """`Sandbox` for commands run by a harness that is itself inside a sandbox pod."""

    def __init__(self, spec: SandboxSpec):
        if not spec.workspace.is_dir():
            raise SandboxError(f"the workspace {spec.workspace} is not a directory")
        harden()  # before any command: they share our uid, and our environment holds the attempt's token
        self.spec = spec
        self.workspace = spec.workspace.resolve()
        self.deadline = time.monotonic() + spec.limits.attempt_timeout_s
        self._running: set[subprocess.Popen[bytes]] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _limit_self(self) -> None:  # in the child, before exec
        limits = self.spec.limits
        for kind, value in ((resource.RLIMIT_CPU, limits.cpu_seconds), (resource.RLIMIT_AS, limits.address_space),
                            (resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_FSIZE, limits.file_size_bytes),
                            (resource.RLIMIT_CORE, 0)):
            hard = value + 1 if kind == resource.RLIMIT_CPU else value
            resource.setrlimit(kind, (value, hard))

    def _cwd(self, cwd: str | None) -> Path:
        """`cwd` relative to the workspace; an absolute path under WORKSPACE_MOUNT is mapped onto it."""
        path = Path(cwd or "")
        if path.is_absolute():
            try:
                path = path.relative_to(WORKSPACE_MOUNT)
            except ValueError:
                return path
        return self.workspace / path

    def run(self, command: str, timeout_s: float | None = None, cwd: str | None = None) -> CommandResult:
        if self._closed:
            raise SandboxError("this sandbox is closed; open a new one")
        began = time.monotonic()
        left = self.deadline - began
        if left <= 0:
            return CommandResult.not_run(command, self.spec.limits)
        budget, timeout_limit = self.spec.limits.budget(left, timeout_s)
        process = subprocess.Popen(["/bin/bash", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, cwd=self._cwd(cwd), env={**DEFAULT_ENV, **self.spec.env},
                                   start_new_session=True, preexec_fn=self._limit_self)
        with self._lock:
            self._running.add(process)
        try:
            output, timed_out = collect(process, began + budget, until_eof=False)
            kill_group(process)  # at a timeout the command; else what it left running in the background
            exit_code = process.wait()
        finally:
            with self._lock:
                self._running.discard(process)
        duration = time.monotonic() - began
        text = output.text()
        if timed_out:
            note = f"it ran past {budget:g} s" if timeout_limit == "command_timeout" else "the attempt's time ran out"
            return CommandResult(command, -signal.SIGKILL, f"{text}\n[sandbox: killed: {note}]", duration,
                                 timeout_limit)
        return CommandResult(command, exit_code, text, duration, limit_of(exit_code, output.tail_text()))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running = list(self._running)
        for process in running:
            kill_group(process)
            process.wait()

    def __enter__(self) -> InPodSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



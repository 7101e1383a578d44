"""Background server processes of the local stack: start detached, await readiness, stop.

A server's state (pid, address) lives in a small JSON file next to its data, so `status` and
`stop` work from any shell. A pid in a stale file is not taken for the server when it is dead, when it
has since been given to another process (its start time differs), or when it names a thread of another
process (which `kill` would signal as that whole process).
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from agentstream.schemas.errors import ServiceError
from agentstream.stack.exits import how_it_ended


class StackError(ServiceError):
    """A local server could not be started or reached; the message says what to do."""


@dataclass
class ServerState:
    pid: int
    url: str
    log: str
    details: dict[str, Any]
    started: float | None = None
    """the process's start time (psutil's `create_time`): a pid in a stale file may since name another
    process, and then it is not this server (None in files written before it was recorded)"""

    @classmethod
    def of_process(cls, pid: int, url: str, log: str, details: dict[str, Any]) -> ServerState:
        return cls(pid=pid, url=url, log=log, details=details, started=start_time(pid))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> ServerState | None:
        try:
            return cls(**json.loads(path.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid) and (self.started is None or start_time(self.pid) == self.started)


def start_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def pid_alive(pid: int) -> bool:
    if not psutil.pid_exists(pid):  # unlike kill(pid, 0), False for a thread id: a thread of another process
        return False
    # a zombie child of ours still answers kill(0); reap it if it is one
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return _not_zombie(pid)


def _not_zombie(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# The handles of the servers spawned here, for the life of this process: a server runs on after its starter
# drops the handle (it is stopped and reaped by its pid), which Python would otherwise report as a leak.
_SPAWNED: list[subprocess.Popen[bytes]] = []


@atexit.register
def _note_reaped() -> None:
    """A handle whose server was stopped and reaped by its pid (`pid_alive`) learns so before it goes."""
    for proc in _SPAWNED:
        proc.poll()


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
          own_session: bool = True) -> subprocess.Popen[bytes]:
    """Start `cmd` with `env` added to this process's environment, output appended to `log`; in its own session
    (it outlives this process), or with `own_session=False` in this process's group (a signal to the group
    reaches it too)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=own_session,
        )
    _SPAWNED.append(proc)
    return proc


def spawned(pid: int) -> subprocess.Popen[bytes] | None:
    """The handle of the server `pid` if this process spawned it: only its parent can read how it ended."""
    return next((proc for proc in _SPAWNED if proc.pid == pid), None)


class Stopped(KeyboardInterrupt):
    """The run was told to stop (SIGTERM, or Ctrl-C): raised in the main thread so that every `finally` on the way
    out stops what it started. A KeyboardInterrupt, so asyncio and the code that lets Ctrl-C through pass it on."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Within: the first SIGTERM or SIGINT raises `Stopped`, later ones are ignored, so the stopping is not cut short.

    Python ends a process at once on SIGTERM, running no `finally`: the servers a run started, each in a session of
    its own (`spawn`), would run on with nobody to stop them. Outside the main thread (a test's worker thread)
    there is no signal to take, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.getsignal(signum) for signum in signums}
    told: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        if not told:
            told.append(signum)
            raise Stopped(signum)

    for signum in signums:
        signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written)"


def await_ready(
    name: str, proc: subprocess.Popen[bytes], ready: Callable[[], bool], log: Path, timeout: float,
    on_wait: Callable[[float], None] | None = None,
) -> None:
    """Poll `ready()` until it holds; fail with the log's tail if the process dies or time runs out. However the
    wait ends without it ready (a Ctrl-C or SIGTERM too), the process is stopped: no state file names it yet."""
    start = time.monotonic()
    try:
        while not ready():
            elapsed = time.monotonic() - start
            if proc.poll() is not None:
                ended = how_it_ended(proc.returncode, log, None)
                raise StackError(f"{name} {ended} while starting. Log ({log}):\n{tail(log)}")
            if elapsed > timeout:
                raise StackError(f"{name} was not ready after {timeout:.0f} s. Log ({log}):\n{tail(log)}")
            if on_wait:
                on_wait(elapsed)
            time.sleep(0.25)
    except BaseException:
        stop_pid(proc.pid, grace=5)
        raise


def stop_pid(pid: int, grace: float = 30.0) -> bool:
    """SIGTERM the process group, wait up to `grace` seconds, then SIGKILL. True if it was running."""
    if not pid_alive(pid):
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        _signal_group(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.05)
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing): one installer at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

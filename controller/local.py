"""The local launcher: each attempt is `/bin/sh -c AGENT` in a process group of its own.

A group of its own means a timeout or a shutdown can signal everything the agent started
(its children, their children) at once, and that nothing the agent leaves behind outlives the
attempt: once the agent exits, whatever remains of its group is killed. Output goes to files in
the attempt's folder, so nothing an agent prints can fill the controller's memory.

A controller killed with SIGKILL cannot stop its agents. The next one finds them by the
attempt id in their environment (/proc/PID/environ) and kills their groups before rerunning
those attempts, so an interrupted attempt never runs alongside its replacement.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import orjson
import psutil

from agentstream.controller.attempt import Attempt, Exit, Gateway, LaunchError, agent_env, tail_text
from agentstream.controller.history import AttemptRecord


@dataclass
class LocalRun:
    process: asyncio.subprocess.Process
    dir: Path
    grace_s: float
    tail_chars: int
    worker: str = field(init=False)

    def __post_init__(self) -> None:
        self.worker = f"pid {self.process.pid} on {socket.gethostname()}"

    @property
    def pgid(self) -> int:
        return self.process.pid  # the group leader: start_new_session made it so

    async def wait(self) -> Exit:
        code = await self.process.wait()
        error = None if code == 0 else _describe(code)
        return Exit(code, error)

    async def stop(self) -> None:
        _signal_group(self.pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self._group_ended(), self.grace_s)
        except TimeoutError:
            pass
        _signal_group(self.pgid, signal.SIGKILL)
        await self.process.wait()

    async def _group_ended(self) -> None:
        """The grace period is the whole group's, not its leader's: `/bin/sh -c AGENT` dies of the SIGTERM at
        once, while the agent it started (not exec'ed by dash) still takes its diff and closes its sandbox."""
        await self.process.wait()
        while _group_alive(self.pgid):
            await asyncio.sleep(0.05)

    async def close(self) -> tuple[str, str]:
        _signal_group(self.pgid, signal.SIGKILL)  # whatever the agent left running in its group
        return tail_text(self.dir / "stdout", self.tail_chars), tail_text(self.dir / "stderr", self.tail_chars)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


WITHHELD = frozenset({"AGENTSTREAM_TOKEN_SECRET", "AGENTSTREAM_API_KEYS"})
"""operator secrets that may be in the controller's environment (the documented way to give them) and never
reach an agent: with the token secret an agent could mint any rollout's token, with an operator key act as
the operator. (A Kubernetes Job's pod gets none of the controller's environment at all.)"""


class LocalLauncher:
    name: Literal["local"] = "local"

    def __init__(self, command: str, timeout_s: float, grace_s: float, tail_chars: int, cwd: Path | None = None):
        self.command = command
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.tail_chars = tail_chars
        self.cwd = cwd

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def launch(self, attempt: Attempt, gateway: Gateway) -> LocalRun:
        attempt.dir.mkdir(parents=True, exist_ok=True)
        task_file = attempt.dir / "task.json"
        task_file.write_bytes(orjson.dumps(attempt.rollout.task.input))
        inherited = {name: value for name, value in os.environ.items() if name not in WITHHELD}
        env = {**inherited, **agent_env(gateway, attempt, str(task_file.resolve()), self.timeout_s)}
        try:
            with open(attempt.dir / "stdout", "wb") as stdout, open(attempt.dir / "stderr", "wb") as stderr:
                process = await asyncio.create_subprocess_exec(
                    "/bin/sh", "-c", self.command, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                    env=env, cwd=self.cwd, start_new_session=True,
                )
        except OSError as exc:
            raise LaunchError(f"could not start the agent: {exc}") from exc
        return LocalRun(process, attempt.dir, self.grace_s, self.tail_chars)

    async def reap(self, run_id: str, interrupted: list[AttemptRecord]) -> None:
        ids = {a.attempt_id for a in interrupted}
        if not ids:
            return
        own = os.getpgrp()
        for pid in _pids_with_attempt(ids):
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            if pgid == own:  # never signal our own group; only that process
                _signal_pid(pid)
            else:
                _signal_group(pgid, signal.SIGKILL)


def _signal_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pids_with_attempt(attempt_ids: set[str]) -> list[int]:
    """Processes whose environment names one of these attempts (this user's, readable ones)."""
    # a process gone meanwhile is skipped; one not ours to read has no environment (None)
    return [process.pid for process in psutil.process_iter(["environ"])
            if process.pid != os.getpid() and (process.info["environ"] or {}).get("AGENTSTREAM_ATTEMPT_ID") in attempt_ids]

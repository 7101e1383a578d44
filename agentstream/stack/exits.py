"""How a child process ended, said so that its operator knows what to do: a kill by the kernel's
out-of-memory killer is named as such, with the trainer's memory estimate when its log has one.

A SIGKILL arrives with no message in the child's log (exit -9 from Popen, 137 through a shell). The kernel
counts its out-of-memory kills (`oom_kill` in /proc/vmstat, the machine's, which a container sees too):
read when the child starts and again when it is found dead, a moved count makes the kill the kernel's.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

VMSTAT = Path("/proc/vmstat")
ESTIMATE = re.compile(r"peak estimate ([\d.]+) GiB.*available ([\d.]+) GiB")
"""the trainer's start-up line (trainer/memory.py, `Fit.describe`)"""
SHELL_SIGKILL = 128 + signal.SIGKILL


def oom_kills(vmstat: Path = VMSTAT) -> int | None:
    """The kernel's count of out-of-memory kills since boot; None where it does not say."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def how_it_ended(returncode: int, log: Path, oom_kills_before: int | None, vmstat: Path = VMSTAT) -> str:
    """`exited with code 1`, `was killed by SIGTERM`, or for a SIGKILL whether the kernel's out-of-memory
    killer did it (its count moved since `oom_kills_before`, or cannot be read), with the advice that fits."""
    if returncode not in (-signal.SIGKILL, SHELL_SIGKILL):
        if returncode < 0:
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"exited with code {returncode}"
    now = oom_kills(vmstat)
    if oom_kills_before is not None and now is not None and now == oom_kills_before:
        return "was killed by SIGKILL, not by the kernel's out-of-memory killer (it counted no kill meanwhile)"
    known = "killed by the kernel, out of memory" if now is not None and oom_kills_before is not None \
        else "killed by SIGKILL, most likely by the kernel, out of memory"
    if found := _estimate(log):
        return (f"was {known} (peak estimate {found[0]} GiB, available {found[1]} GiB): "
                "try --gradient-checkpointing / --micro-batch-size 1")
    return f"was {known}"


def _estimate(log: Path) -> tuple[str, str] | None:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = ESTIMATE.findall(text)
    return found[-1] if found else None

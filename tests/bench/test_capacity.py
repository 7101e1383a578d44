"""`python -m bench capacity` measures by running benchmarks as its children one after the other: a child that leaves
a process behind holding its output (the sandbox's warden keeps stderr until it has cleaned up) must not hold the
capacity run up. Run as a program, as the benchmarks are: tests import nothing of bench/."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from agentstream.stack.process import pid_alive

REPO = Path(__file__).parents[2]

LEAVES_ONE_BEHIND = """
import subprocess, sys
left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
print(left.pid)
"""
"""a child that exits at once, leaving a process that holds its stdout and stderr for a minute"""

CAPACITY_CHILD = """
import sys, time
from bench.capacity import child
began = time.monotonic()
said = child(["-c", sys.argv[1]], timeout=20)
print(said.strip(), time.monotonic() - began)
"""


def test_a_child_is_read_when_it_exits_though_a_process_it_left_holds_its_output():
    """Before, its output was read from pipes to their end: the 20 s timeout, not the child's exit, ended it."""
    done = subprocess.run([sys.executable, "-c", CAPACITY_CHILD, LEAVES_ONE_BEHIND], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    left, seconds = done.stdout.split()[-2:]
    try:
        assert pid_alive(int(left)), "the process the child left holds its output still"
        assert float(seconds) < 15, f"read {seconds} s after the start: it waited for the process left behind"
    finally:
        if pid_alive(int(left)):
            os.kill(int(left), signal.SIGKILL)

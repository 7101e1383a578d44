"""A command's output, as both sandbox backends keep it: the first and last halves of a bounded
budget, read until the command ends or its deadline comes, and which limit (if any) ended it."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import time

OUTPUT_LIMIT = 1 << 20
_FORK_FAILED = re.compile(r"fork: (retry: )?Resource temporarily unavailable|Cannot fork")
_FAILURE_MESSAGES = (
    ("processes", re.compile(r"BlockingIOError: \[Errno 11\]")),
    ("memory", re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|xmalloc: .*cannot allocate|"
                          r"out of memory")),
    ("file_size", re.compile(r"File too large")),
    ("disk", re.compile(r"No space left on device|Disk quota exceeded")),
)


class Output:
    """The first and last OUTPUT_LIMIT/2 bytes of a stream, and how many bytes fell between."""

    def __init__(self, limit: int = OUTPUT_LIMIT):
        self.half = limit // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.half:
                excess = len(self.tail) - self.half
                self.dropped += excess
                del self.tail[:excess]

    def text(self) -> str:
        if not self.dropped:
            return (self.head + self.tail).decode(errors="replace")
        marker = f"\n[sandbox: output truncated: {self.dropped} bytes not shown]\n"
        return self.head.decode(errors="replace") + marker + self.tail.decode(errors="replace")

    def tail_text(self) -> str:
        return (self.head[-4096:] + self.tail[-4096:]).decode(errors="replace")


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group a command was started in (`start_new_session=True`)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def collect(process: subprocess.Popen[bytes], deadline: float, *, until_eof: bool) -> tuple[Output, bool]:
    """The command's output (True: the deadline came first). `until_eof`: until every holder of the
    pipe is gone, which the local backend's pid namespace makes the moment its whole tree has died (so
    the next command starts with none of it left). Otherwise until the command exits; then its process
    group is killed and the pipe drained: in a pod no pid namespace ends a background child, and one
    that left the group would hold the pipe open for ever."""
    output = Output()
    stream = process.stdout
    assert stream is not None
    os.set_blocking(stream.fileno(), False)
    with selectors.DefaultSelector() as selector, stream:
        selector.register(stream, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return output, True
            exited = not until_eof and process.poll() is not None
            if exited:
                kill_group(process)
            if selector.select(min(left, 0.05)) or exited:
                data = stream.read(64 << 10)
                if data:
                    output.add(data)
                elif data is not None or (exited and not selector.select(0.2)):
                    return output, False


def limit_of(exit_code: int, tail: str) -> str | None:
    """Which limit ended a command that exited on its own. Signals are exact; a limit the kernel reports
    as a failed call (fork, malloc, write) is recognised by the messages programs print for it."""
    if exit_code == 128 + signal.SIGXCPU:
        return "cpu"
    if exit_code == 128 + signal.SIGXFSZ:
        return "file_size"
    if _FORK_FAILED.search(tail):
        return "processes"  # even at exit 0: a shell fork bomb's parent returns at once
    if exit_code != 0:
        for limit, pattern in _FAILURE_MESSAGES:
            if pattern.search(tail):
                return limit
    return None

"""One sandbox's own mount and network namespaces, made once (as root) and entered by every command.

Why: the sandboxed commands run as an unprivileged uid, and unprivileged bubblewrap resolves every
bind source by path with that uid's permissions, so a workspace under a 0700 directory (pytest's
/tmp/pytest-of-root, /root/…) or a uv interpreter under /root/.local could not be mounted. Here a
short-lived thread (as root) unshares a mount namespace, makes it private (nothing propagates back
to the host), mounts a tmpfs over `STAGE` and bind-mounts the workspace and the read-only binds into
it, so inside this namespace they sit under a path anyone may traverse. The same thread unshares a
network namespace and brings its loopback up: nothing listens there unless the gateway relay does.

The thread ends; the namespaces live on through two open descriptors (`/proc/thread-self/ns/*`).
Commands enter them with `nsenter --mount=/proc/<this pid>/fd/N --net=/proc/<this pid>/fd/M` (nothing
inherited), drop to the sandbox uid, and start bubblewrap from there. Closing the descriptors after
the last command ends frees both namespaces; the host never sees a mount.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agentstream.sandbox.contract import SandboxError

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = struct.Struct("16sH22x")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: Path, fstype: str | None, flags: int, data: str | None = None) -> None:
    def encode(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    _check(_libc.mount(encode(source), encode(str(target)), encode(fstype), flags, encode(data)), f"mount {target}")


def _bind(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        target.mkdir()
    else:
        target.touch()
    _mount(str(source), target, None, MS_BIND | MS_REC)


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = _IFREQ.unpack(fcntl.ioctl(sock, SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0)))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | IFF_UP))


@dataclass
class Namespaces:
    mount_fd: int
    net_fd: int
    listener: socket.socket | None
    """a listening TCP socket inside the network namespace (127.0.0.1:listen_port), if one was asked for"""

    def nsenter(self) -> list[str]:
        """The nsenter arguments that put a child of this process into both namespaces. nsenter (root)
        opens them through this process's /proc entry, so the descriptors are never inherited by the
        sandbox (they are close-on-exec)."""
        here = f"/proc/{os.getpid()}/fd"
        return [shutil.which("nsenter") or "nsenter", f"--mount={here}/{self.mount_fd}", f"--net={here}/{self.net_fd}"]

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for fd in (self.mount_fd, self.net_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.mount_fd = self.net_fd = -1


def create(stage: Path, binds: Sequence[tuple[Path, str]], shared: Sequence[tuple[Path, str]],
           files: dict[str, str], listen_port: int | None, tmpfs_bytes: int = 16 << 20) -> Namespaces:
    """New mount + network namespaces with `stage` holding `binds` (host path → name under stage, bound
    read-write; bubblewrap decides what it binds read-only), `shared` (host path → name, bound read-only
    if it exists: gathered here so that a command binds their folder once, not each of them) and `files`
    (name → text, readable by all).
    With `listen_port`, a socket listens on 127.0.0.1:port inside."""
    outcome: dict[str, object] = {}

    def build() -> None:  # runs in its own thread: unshare() moves only this thread
        try:
            _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
            _mount(None, Path("/"), None, MS_REC | MS_PRIVATE)  # before any mount: nothing reaches the host
            _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0755,size={tmpfs_bytes}")
            for source, name in binds:
                _bind(source, stage / name)
            for source, name in shared:
                if source.exists():
                    _bind(source, stage / name)
                    _mount(None, stage / name, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            for name, text in files.items():
                path = stage / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                path.chmod(0o644)
            _loopback_up()
            if listen_port is not None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", listen_port))
                listener.listen(64)
                outcome["listener"] = listener
            outcome["mount_fd"] = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            outcome["net_fd"] = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            outcome["error"] = exc

    _in_thread(build)
    if "error" in outcome:
        for key in ("mount_fd", "net_fd"):
            if key in outcome:
                os.close(outcome[key])  # type: ignore[arg-type]
        raise SandboxError(f"could not create the sandbox's namespaces: {outcome['error']} "
                           "(the local sandbox needs root: CAP_SYS_ADMIN for mount and network namespaces)")
    return Namespaces(outcome["mount_fd"], outcome["net_fd"], outcome.get("listener"))  # type: ignore[arg-type]


def _in_thread(work: Callable[[], None]) -> None:
    thread = threading.Thread(target=work, name="sandbox-namespaces")
    thread.start()
    thread.join()

"""What a host process that dies leaves of its sandboxes, undone by a process that outlives it.

The kernel frees most of a sandbox by itself when the process holding it dies: its namespaces (two
descriptors), its commands (`--die-with-parent`, and their pid namespace with them), its uid lease (an
flock) and its loop device (autoclear, once nothing mounts it). Two things it does not free: the
workspace disk mounted over the workspace's folder in the host's mount namespace (the caller reads and
writes the workspace there while the sandbox is open, the grader its inputs and outputs), and the
sandbox's cgroups. Left alone, the disk stays mounted over the folder, on a deleted image, until the
next sandbox on that folder takes it off and the dead one's writes are gone.

So the first sandbox a process opens starts a warden: `python -m agentstream.sandbox.warden`, a child
in a session of its own (the controller signals an agent's whole process group; the warden is not in
it), holding the other end of a unix socket. Each sandbox tells it what it holds, passing descriptors
(`hold`: its uid lease, its workspace folder, its cgroups; `disk`: the disk's root), and `done` at the
end of `close`. The warden watches the host process with a pidfd. When it dies, the warden does for
every sandbox not done what `close` would have: kills what is left in the cgroup, copies the disk's
tree back into the folder as its owner (the dead sandbox's writes are kept, as a close keeps them),
unmounts the disk (its loop device detaches itself), removes the cgroups, and only then closes its
copies of the lease and of the folder's lock, so no new sandbox takes that uid or that folder half
cleaned. A disk the host mounted but died before telling of (killed between the mount and the `disk`
message) is taken off too: while the warden holds the folder's lock, a sandbox disk over the folder is the
dead one's (`disk.take_off`); nothing of the agent's is on it yet. Then it exits. It costs one process per host process, started once (not per sandbox), idle
on a poll until then.

The descriptors it holds share their open file with the sandbox's, and so the flocks: the uid's lease
and the folder's lock (`LocalSandbox._claim`) stay held, by the warden alone, through the clean-up.

If the warden itself is killed with its host (a SIGKILL to both), the next sandbox on the folder finds
a disk whose lock nobody holds and takes it off (logged: its writes are lost), and cgroups of uids whose
lease nobody holds are removed at every sandbox's start (`local._remove_stale_cgroups`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("agentstream.sandbox.warden")  # also when run as __main__

MESSAGE_BYTES = 64 * 1024
MAX_FDS = 8

# --- the host process's side ----------------------------------------------------------------------

_lock = threading.Lock()
_link: tuple[int, socket.socket] | None = None
"""(the pid that started the warden, our end of its socket): a forked child starts its own"""
_ids = iter(range(1, 1 << 62))


def new_id() -> int:
    with _lock:
        return next(_ids)


def tell(message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send the warden `message` (and copies of `fds`), starting it first if this process has none. If it
    cannot be reached, the sandbox still works and closes; only a death of this process would then leave
    the disk to the next sandbox on the folder (logged)."""
    global _link
    try:
        with _lock:
            socket.send_fds(_socket(), [json.dumps(message).encode()], list(fds))
    except OSError as error:
        if _link is not None:
            _link[1].close()
        _link = None  # the next sandbox starts a new warden
        log.warning("sandbox: the warden did not take %s (%s); if this process dies, the next sandbox on the "
                    "workspace cleans up after it", message.get("op"), error)


def _socket() -> socket.socket:
    global _link
    if _link is None or _link[0] != os.getpid():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            _spawn(theirs.fileno())
        atexit.register(_close)
        _link = (os.getpid(), ours)
    return _link[1]


def _spawn(channel: int) -> None:
    """The warden, in a session of its own; not a Popen: it outlives us by design (no reaping, no warning).
    `-P`: nothing of the current folder is importable in it."""
    os.set_inheritable(channel, True)
    try:
        os.posix_spawn(sys.executable, [sys.executable, "-P", "-m", "agentstream.sandbox.warden", str(os.getpid()),
                                        str(channel)], _warden_env(), setsid=True,
                       file_actions=[(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                                     (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0)])
    finally:
        os.set_inheritable(channel, False)


def _close() -> None:
    """At exit: the warden reads the end of the socket as our death (and cleans up what is still open)."""
    if _link is not None and _link[0] == os.getpid():
        _link[1].close()


def _warden_env() -> dict[str, str]:
    """Nothing of the host process's environment but what starts Python: not its credentials, and not the
    attempt id the controller finds an interrupted attempt's processes by (the warden must outlive those)."""
    return {name: os.environ[name] for name in ("PATH", "PYTHONPATH", "LANG") if name in os.environ}


# --- the warden's side ---------------------------------------------------------------------------


@dataclass
class Held:
    """One open sandbox of the host process, as the warden knows it."""

    workspace: str
    owner: tuple[int, int]
    bound: bool
    """no disk: the workspace was chowned to the sandbox's uid (to chown back)"""
    cgroup: dict[str, Any] | None
    """{"dirs": {controller: path}, "version": 1|2}"""
    disks: str = ""
    """where its disk's image was made (`local.DISKS`): a disk over the folder from there is the sandbox's; "" if
    it has none (bound)"""
    fds: dict[str, int] = field(default_factory=dict)
    """"lease", "folder", "root" (the disk's): copies of the sandbox's own descriptors"""

    def close_fds(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def clean(held: Held) -> list[str]:
    """What `LocalSandbox.close` would have done; what could not be done."""
    from pathlib import Path

    from agentstream.sandbox import cgroups, disk, hostfs

    problems: list[str] = []
    group = cgroups.Cgroup({k: Path(v) for k, v in held.cgroup["dirs"].items()},
                           held.cgroup["version"]) if held.cgroup else None
    if group is not None and not group.kill_all():
        problems.append("processes survived the kill")
    if "root" in held.fds and "folder" in held.fds:
        problems += disk.give_back(Path(held.workspace), held.fds["folder"], held.fds.pop("root"), *held.owner)
    elif held.bound:
        problems += hostfs.chown_tree(Path(held.workspace), *held.owner)
    if "folder" in held.fds and held.disks:  # a disk it mounted but died before telling of (nothing copied onto it)
        problems += disk.take_off(Path(held.workspace), held.fds["folder"], Path(held.disks))
    if group is not None:
        problems += group.remove()
    held.close_fds()  # the lease and the folder's lock go last
    return problems


def serve(holder: int, channel: socket.socket) -> None:
    """Keep what the host process's sandboxes tell; when it dies, clean up what it left open."""
    held: dict[int, Held] = {}
    try:
        watch = os.pidfd_open(holder)
    except ProcessLookupError:  # it died before this process got here: what it told is in the socket still
        watch = -1
    if watch >= 0 and os.getppid() != holder:  # it died, and the pid is another process's by now
        os.close(watch)
        watch = -1
    while watch >= 0:
        ready, _, _ = select.select([channel.fileno(), watch], [], [])
        if watch in ready or not _receive(channel, held):
            break
    channel.setblocking(False)
    while _receive(channel, held):  # what it told just before it died
        pass
    for sandbox in held.values():
        try:
            problems = clean(sandbox)
        except Exception as error:  # the next one is still cleaned; the next sandbox on this folder finishes it
            problems = [repr(error)]
        log.warning("sandbox warden: the host process %d died with a sandbox open on %s; cleaned up%s", holder,
                    sandbox.workspace, f" with problems: {'; '.join(problems[:5])}" if problems else "")


def _receive(channel: socket.socket, held: dict[int, Held]) -> bool:
    """One message into `held`; False at the end (the host process closed the socket, or nothing is left)."""
    try:
        data, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, MAX_FDS)
    except (BlockingIOError, ConnectionResetError):
        return False
    if not data:
        return False
    message = json.loads(data)
    number, op = int(message["id"]), message["op"]
    if op == "hold":
        held[number] = Held(message["workspace"], (message["owner"][0], message["owner"][1]), message["bound"],
                            message.get("cgroup"), message.get("disks", ""), dict(zip(message["fds"], fds)))
    elif op == "disk" and number in held:
        held[number].fds.update(zip(message["fds"], fds))
    elif op == "done" and number in held:
        held.pop(number).close_fds()
    else:
        for fd in fds:
            os.close(fd)
    return True


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    holder, fd = int(sys.argv[1]), int(sys.argv[2])
    serve(holder, socket.socket(fileno=fd))


if __name__ == "__main__":
    main()

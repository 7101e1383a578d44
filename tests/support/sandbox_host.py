"""What the local sandbox leaves on the host, as the host sees it: mounts, loop devices, wardens."""

from __future__ import annotations

import os
from pathlib import Path

from agentstream.sandbox.local import DISKS, UidLease

WARDEN_MODULE = b"agentstream.sandbox.warden"


def mounted(folder: Path) -> bool:
    """Whether anything is mounted over `folder` in this process's mount namespace."""
    return any(point == str(folder) for point in mount_points())


def mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def loop_images() -> dict[str, str]:
    """The backing file of every bound loop device, by device name."""
    found = {}
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            found[backing.parts[3]] = backing.read_text().strip()
        except OSError:
            pass
    return found


def unleased_disks(among: dict[str, str]) -> dict[str, str]:
    """The loop devices of `among` on a sandbox's disk image whose uid nobody leases: no sandbox open, no
    warden cleaning up after one, yet the disk is still held (mounted somewhere, or a descriptor left open)."""
    left = {}
    for device, image in among.items():
        name = image.removesuffix(" (deleted)")
        if not name.startswith(f"{DISKS}/") or not name.endswith(".img"):
            continue
        lease = UidLease.hold_if_free(int(Path(name).stem))
        if lease is not None:
            lease.release()
            left[device] = image
    return left


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


def wardens() -> dict[int, int]:
    """Every running sandbox warden (`sandbox.warden`), by pid: the pid of the host process it watches."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if WARDEN_MODULE in argv:  # python -P -m agentstream.sandbox.warden HOLDER CHANNEL
            try:
                found[int(entry.name)] = int(argv[argv.index(WARDEN_MODULE) + 1])
            except (IndexError, ValueError):
                pass
    return found

"""A workspace disk of `Limits.disk_bytes`: a sparse ext4 image on a loop device.

RLIMIT_FSIZE bounds the size of a file, not the blocks it holds (`fallocate --keep-size`, many small
files, inodes, directories), and the host's filesystem has no quota for one sandbox. An ext4 image of
`disk_bytes` is a real bound on all of them: every block and inode the agent takes is the image's, and
past it writes fail with ENOSPC. It is sparse, so the host pays only for what is written.

Why not a tmpfs: its pages are memory (charged to the sandbox's memory cgroup), so the workspace and
the processes' memory would share one budget, and a repository's worth of files would sit in RAM.

The image is attached with LOOP_CONFIGURE and LO_FLAGS_AUTOCLEAR and unlinked at once: the loop device
detaches itself when its filesystem's last mount goes (the one over the workspace, taken off by `close` or,
if the host process died, by its warden, `sandbox.warden`; and the sandbox's mount namespace), and the
image's blocks go back to the host with it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

from agentstream.sandbox import hostfs
from agentstream.sandbox.contract import SandboxError
from agentstream.sandbox.namespaces import MS_NODEV, MS_NOSUID, _check, _libc, _mount

LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
_LOOP_CONFIG = struct.Struct("=II QQQQQ IIII 64s64s32s QQ 64x")
"""struct loop_config: fd, block_size, struct loop_info64 (device, inode, rdevice, offset, sizelimit,
number, encrypt_type, encrypt_key_size, flags, file_name, crypt_name, encrypt_key, init[2]), reserved"""
MKFS_OPTIONS = ("-q", "-F", "-O", "^has_journal,^resize_inode", "-E", "lazy_itable_init=1,nodiscard", "-m", "0")
"""no journal (a scratch disk, gone after the attempt), no blocks reserved for root, and no zeroing of
inode tables: the image stays sparse"""
MOUNT_OPTIONS = "noinit_itable"
LOOP_MAJOR = 7
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
MAX_STACKED = 8
"""the most disks `take_off` takes off one folder (a dead sandbox leaves one)"""
EXT4_ROOT_INODE = 2
HOST_MODE_MASK = 0o755
"""modes of what the workspace copy brings back to the host: no set-id bit, nothing group- or world-writable"""


def available() -> str | None:
    """Why this host cannot make workspace disks, or None if it can."""
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control (the loop module is not loaded, or the container has no loop devices)"
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed (`apt-get install -y e2fsprogs`)"
    return None


def make(image: Path, size: int, owner: int) -> tuple[str, int]:
    """A new ext4 filesystem of `size` bytes, its root owned by `owner`, on a loop device that frees
    itself on unmount: the device's path and an open descriptor of it, to close once it is mounted
    (autoclear detaches a device nobody holds). The image file is already unlinked."""
    image.parent.mkdir(parents=True, exist_ok=True)
    image.unlink(missing_ok=True)
    fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        made = subprocess.run(["mkfs.ext4", *MKFS_OPTIONS, "-E", f"root_owner={owner}:{owner}", str(image)],
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise SandboxError(f"mkfs.ext4 failed on a {size}-byte image: {made.stderr.strip()} "
                               "(is Limits.disk_bytes at least 1 MiB?)")
        return _attach(fd)
    finally:
        os.close(fd)
        image.unlink(missing_ok=True)


def _attach(backing: int) -> tuple[str, int]:
    """Attach `backing` to a free loop device with autoclear: its path and an open descriptor."""
    config = _LOOP_CONFIG.pack(backing, 0, 0, 0, 0, 0, 0, 0, 0, 0, LO_FLAGS_AUTOCLEAR, b"", b"", b"", 0, 0)
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(50):  # another process may take the free device between the two calls
            number = fcntl.ioctl(control, LOOP_CTL_GET_FREE)
            device = f"/dev/loop{number}"
            if not os.path.exists(device):  # no udev in a container: make the node ourselves
                os.mknod(device, 0o660 | 0o060000, os.makedev(7, number))
            fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, config)
                return device, fd
            except OSError as error:
                os.close(fd)
                if error.errno != errno.EBUSY:
                    raise
            time.sleep(0.01)
    finally:
        os.close(control)
    raise SandboxError("no free loop device after 50 tries; too many sandboxes at once?")


def mount_over(device: str, folder: Path) -> None:
    """Mount the disk over `folder` (nosuid, nodev: nothing on it runs with privileges or opens devices)."""
    _mount(device, folder, "ext4", MS_NOSUID | MS_NODEV, MOUNT_OPTIONS)


def unmount(folder: Path) -> None:
    """Detach the disk mounted over `folder` (lazily: the sandbox's own namespace may still hold its copy)."""
    _check(_libc.umount2(os.fsencode(str(folder)), MNT_DETACH | UMOUNT_NOFOLLOW), f"umount {folder}")


def detach(root: int) -> bool:
    """Detach the very mount whose root `root` is (lazily), wherever it sits in the stack over its folder;
    False if it was detached already. A path names whatever is mounted on top by the time umount runs: between
    a check and an unmount by path, another process may take this disk off and the next sandbox mount its own
    there, and that would be the one taken off. /proc/self/fd/N resolves to this descriptor's own mount."""
    if _libc.umount2(os.fsencode(f"/proc/self/fd/{root}"), MNT_DETACH) == 0:
        return True
    error = ctypes.get_errno()
    if error == errno.EINVAL:  # not a mount (of this namespace) any more
        return False
    raise OSError(error, f"umount the disk's root: {os.strerror(error)}")


def take_off(workspace: Path, folder: int, images: Path) -> list[str]:
    """Detach every sandbox disk still mounted over `workspace` above `folder` (the workspace's own directory,
    claimed): one whose sandbox died before it could say it had mounted it (its warden got no descriptor of
    its root), or a mount left by an interrupted set-up. Only the holder of the folder's lock may call this: a
    disk over a claimed folder is nobody else's. Any other mount there is left alone; what could not be done."""
    beneath = os.fstat(folder)
    for _ in range(MAX_STACKED):
        try:
            top = hostfs.open_dir(workspace)
        except OSError as error:
            return [f"open {workspace}: {error}"]
        try:
            here = os.fstat(top)
            if (here.st_dev, here.st_ino) == (beneath.st_dev, beneath.st_ino) or not is_sandbox_disk(top, images):
                return []
            detach(top)
        except OSError as error:
            return [f"unmount a disk left over {workspace}: {error}"]
        finally:
            os.close(top)
    return [f"more than {MAX_STACKED} disks mounted over {workspace}"]


def is_sandbox_disk(fd: int, images: Path) -> bool:
    """Whether directory `fd` is the root of a sandbox's workspace disk (an ext4 root on a loop device whose
    image was made under `images`); any other filesystem is the caller's."""
    here = os.fstat(fd)
    if os.major(here.st_dev) != LOOP_MAJOR or here.st_ino != EXT4_ROOT_INODE:
        return False
    backing = Path(f"/sys/block/loop{os.minor(here.st_dev)}/loop/backing_file")
    try:
        return backing.read_text().startswith(f"{images}/")
    except OSError:
        return False


def give_back(workspace: Path, folder: int, root: int, uid: int, gid: int, *,
              unchanged: hostfs.Unchanged | None = None, copy_back: bool = True) -> list[str]:
    """Copy the disk's tree (`root`, closed here) back into the folder beneath it (`folder`, left open) as
    uid:gid, then unmount it from `workspace`; what could not be done. At most the disk's blocks and inodes
    are written: hard links and holes cannot multiply them; what `unchanged` says nobody touched is not
    copied again."""
    problems: list[str] = []
    try:
        if copy_back:
            space = os.fstatvfs(root)
            budget = hostfs.Budget(data_bytes=space.f_blocks * space.f_frsize, entries=space.f_files)
            copied = hostfs.copy_tree(root, folder, uid, gid, mode_mask=HOST_MODE_MASK, budget=budget,
                                      unchanged=unchanged, root_attributes=False)
            problems += [f"workspace: {problem}" for problem in copied.problems]
            os.fchown(folder, uid, gid)  # its mode stays the caller's
    finally:
        try:
            detach(root)  # False: taken off already (by the next sandbox, if its warden was too slow)
        except OSError as error:
            problems.append(f"unmount {workspace}: {error}")
        finally:
            os.close(root)
    return problems

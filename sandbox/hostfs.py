"""File operations the host makes on trees an agent wrote: the one way to walk them.

An agent controls every name, link and depth in its workspace, so a walk over it here (as root):
  - never follows a symlink: directories are opened with O_NOFOLLOW|O_DIRECTORY relative to their
    parent's descriptor, files with O_NOFOLLOW|O_NONBLOCK (a FIFO does not block) and checked to be
    regular files by fstat before a byte is read;
  - has no recursion and no path-length limit: one explicit stack of pending names per level, the
    directories of the first `KEPT_LEVELS` levels held open and deeper ones reached again through ".."
    whose identity (device, inode) is checked against the directory it came from (`_Cursor`); so a tree
    100,000 levels deep costs neither Python frames nor more than 33 descriptors, and a path never grows
    past one name;
  - keeps going past an entry it cannot handle, and returns what it could not do (`Problems`).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
CHUNK = 1 << 20
KEPT_LEVELS = 32


class Problems(list[str]):
    """What a walk could not do, one line per entry (it carried on past each)."""

    def note(self, what: str, error: OSError) -> None:
        if len(self) < 100:
            self.append(f"{what}: {error.strerror or error}")
        elif len(self) == 100:
            self.append("… (more problems not listed)")


def open_dir(path: Path | str, dir_fd: int | None = None) -> int:
    """A descriptor of directory `path` (relative to `dir_fd` if given); a symlink there is refused (ELOOP)."""
    return os.open(path, DIR_FLAGS, dir_fd=dir_fd)


def _entries(fd: int) -> list[tuple[str, bool]]:
    """(name, is a directory) of each entry, in reverse order so that pop() takes them in order."""
    with os.scandir(fd) as listing:
        found = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in listing]
    found.sort(reverse=True)
    return found


class _Cursor:
    """The one directory a walk stands in, and its ancestors to climb back to: the first `KEPT_LEVELS`
    held open (a mount point's ".." would lead onto what is mounted over it), deeper ones by identity,
    reached again through "..", which must lead back to the very directory left."""

    def __init__(self, fd: int):
        self.fd = fd
        self._above: list[tuple[str, tuple[int, int], int | None]] = []

    def down(self, name: str) -> None:
        child = open_dir(name, self.fd)
        here = os.fstat(self.fd)
        keep = len(self._above) < KEPT_LEVELS
        self._above.append((name, (here.st_dev, here.st_ino), self.fd if keep else None))
        if not keep:
            os.close(self.fd)
        self.fd = child

    def up(self) -> str:
        """Back to the parent; the name of the directory left. Raises if the parent is not the one we came
        from (the tree was moved under the walk)."""
        name, identity, kept = self._above.pop()
        if kept is not None:
            os.close(self.fd)
            self.fd = kept
            return name
        parent = open_dir("..", self.fd)
        info = os.fstat(parent)
        if (info.st_dev, info.st_ino) != identity:
            os.close(parent)
            self._above.append((name, identity, None))
            raise OSError(errno.ESTALE, "the tree was moved during the walk")
        os.close(self.fd)
        self.fd = parent
        return name

    def close(self) -> None:
        os.close(self.fd)
        for _, _, kept in self._above:
            if kept is not None:
                os.close(kept)
        self._above.clear()


def empty_dir(fd: int, problems: Problems | None = None) -> Problems:
    """Remove everything inside the directory `fd` (not the directory itself); `fd` stays open and unmoved."""
    problems = Problems() if problems is None else problems
    cursor = _Cursor(os.dup(fd))
    pending = [_entries(cursor.fd)]
    try:
        while pending:
            if not pending[-1]:
                pending.pop()
                if pending:
                    name = cursor.up()
                    _try(problems, f"rmdir {name}", os.rmdir, name, dir_fd=cursor.fd)
                continue
            name, is_dir = pending[-1].pop()
            if is_dir:
                try:
                    cursor.down(name)
                except OSError as error:
                    if error.errno not in (errno.ENOTDIR, errno.ELOOP):  # it was replaced: remove it as a file
                        problems.note(f"open {name}", error)
                        continue
                else:
                    pending.append(_entries(cursor.fd))
                    continue
            _try(problems, f"unlink {name}", os.unlink, name, dir_fd=cursor.fd)
    except OSError as error:  # the walk itself lost its way (a moved tree): stop, say so
        problems.note("walk", error)
    finally:
        cursor.close()
    return problems


def remove_tree(path: Path) -> Problems:
    """Remove `path` and everything under it; a symlink at `path` is removed, never followed. Nothing
    missing is not a problem."""
    problems = Problems()
    try:
        parent = open_dir(path.parent)
    except FileNotFoundError:
        return problems
    try:
        try:
            fd = open_dir(path.name, parent)
        except FileNotFoundError:
            return problems
        except OSError as error:
            if error.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            os.unlink(path.name, dir_fd=parent)
            return problems
        try:
            empty_dir(fd, problems)
        finally:
            os.close(fd)
        _try(problems, f"rmdir {path}", os.rmdir, path.name, dir_fd=parent)
    except OSError as error:
        problems.note(str(path), error)
    finally:
        os.close(parent)
    return problems


def chown_tree(path: Path, uid: int, gid: int) -> Problems:
    """chown `path` and everything under it to uid:gid, links themselves and never their targets."""
    problems = Problems()
    try:
        root = open_dir(path)
    except OSError as error:
        problems.note(f"open {path}", error)
        return problems
    os.fchown(root, uid, gid)
    cursor = _Cursor(root)
    pending = [_entries(cursor.fd)]
    try:
        while pending:
            if not pending[-1]:
                pending.pop()
                if pending:
                    cursor.up()
                continue
            name, is_dir = pending[-1].pop()
            _try(problems, f"chown {name}", os.chown, name, uid, gid, dir_fd=cursor.fd, follow_symlinks=False)
            if is_dir:
                try:
                    cursor.down(name)
                except OSError as error:
                    problems.note(f"open {name}", error)
                else:
                    pending.append(_entries(cursor.fd))
    except OSError as error:
        problems.note("walk", error)
    finally:
        cursor.close()
    return problems


# --- copying ----------------------------------------------------------------------------------


@dataclass
class Budget:
    """The most a copy may write: data bytes (holes are not written), entries, bytes of one file. A tree
    an agent made holds hard links and sparse files; copied naively, one 100 MiB file linked 10,000
    times or a 1 TiB hole would fill the host's disk."""

    data_bytes: int | None = None
    entries: int | None = None
    file_bytes: int | None = None
    copied_bytes: int = 0
    copied_entries: int = 0

    def take_entry(self) -> bool:
        if self.entries is not None and self.copied_entries >= self.entries:
            return False
        self.copied_entries += 1
        return True


@dataclass
class Copied:
    """What `copy_tree` did: its problems, and per copied regular file the source's and the copy's
    identities (st_ino), so that a later copy back can skip files nobody touched."""

    problems: Problems = field(default_factory=Problems)
    files: dict[int, tuple[int, int]] = field(default_factory=dict)
    """destination inode -> (source inode, destination ctime ns) of each copied regular file"""


Unchanged = Callable[[os.stat_result, os.stat_result], bool]
"""(source entry, destination entry already there) -> the destination may stay as it is"""


def copy_tree(source: int, target: int, uid: int, gid: int, *, mode_mask: int = 0o777,
              budget: Budget | None = None, unchanged: Unchanged | None = None, root_attributes: bool = True) -> Copied:
    """Make directory `target` a copy of directory `source` (both descriptors; they stay open): entries
    of target that source lacks are removed, directories, regular files (holes kept) and symlinks are
    copied, owned by uid:gid, with mode & `mode_mask` (set-id bits never survive) and the source's times.
    FIFOs, sockets and devices are left out. A regular file in target for which `unchanged(source,
    target)` holds is kept as it is. Without `root_attributes`, target's own owner, mode and times stay."""
    budget = budget or Budget()
    copied = Copied()
    src, dst = _Cursor(os.dup(source)), _Cursor(os.dup(target))
    pending = [_Level(src.fd, dst.fd, fresh=False, problems=copied.problems)]
    try:
        while pending:
            level = pending[-1]
            if not level.names:
                pending.pop()
                if pending or root_attributes:
                    _finish_dir(src.fd, dst.fd, uid, gid, mode_mask, copied.problems)
                if pending:
                    src.up()
                    dst.up()
                continue
            name, kind = level.names.pop()
            if kind == "other":
                continue
            if kind == "file" and unchanged and not level.fresh and _is_unchanged(name, src.fd, dst.fd, unchanged):
                continue
            if not budget.take_entry():
                copied.problems.append(f"{name}: not copied, past the limit of {budget.entries} entries")
                continue
            try:
                if kind == "dir":
                    made = _make_dir(name, dst.fd, level.fresh)
                    src.down(name)
                    dst.down(name)
                    pending.append(_Level(src.fd, dst.fd, fresh=made, problems=copied.problems))
                elif kind == "link":
                    _copy_link(name, src.fd, dst.fd, uid, gid, level.fresh)
                else:
                    _copy_file(name, src.fd, dst.fd, uid, gid, mode_mask, budget, copied, level.fresh)
            except OSError as error:
                copied.problems.note(f"copy {name}", error)
    except OSError as error:
        copied.problems.note("walk", error)
    finally:
        src.close()
        dst.close()
    return copied


class _Level:
    """The entries of one source directory still to copy, and whether its copy was made empty just now."""

    def __init__(self, src: int, dst: int, fresh: bool, problems: Problems):
        self.fresh = fresh
        self.names = sorted(((entry.name, _kind(entry)) for entry in _scan(src)), reverse=True)
        if not fresh:  # entries of dst that src lacks go first
            wanted = {name for name, _ in self.names}
            for name in os.listdir(dst):
                if name not in wanted:
                    _remove_entry(name, dst, problems)


def _scan(fd: int) -> list[os.DirEntry[str]]:
    with os.scandir(fd) as listing:
        return list(listing)


def _kind(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return "other"


def _remove_entry(name: str, parent: int, problems: Problems) -> None:
    try:
        fd = open_dir(name, parent)
    except OSError as error:
        if error.errno in (errno.ENOTDIR, errno.ELOOP):
            _try(problems, f"unlink {name}", os.unlink, name, dir_fd=parent)
        elif error.errno != errno.ENOENT:
            problems.note(f"open {name}", error)
        return
    try:
        empty_dir(fd, problems)
    finally:
        os.close(fd)
    _try(problems, f"rmdir {name}", os.rmdir, name, dir_fd=parent)


def _is_unchanged(name: str, src: int, dst: int, unchanged: Unchanged) -> bool:
    try:
        info = os.stat(name, dir_fd=src, follow_symlinks=False)
        there = os.stat(name, dir_fd=dst, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and stat.S_ISREG(there.st_mode) and unchanged(info, there)


def _make_dir(name: str, dst: int, fresh: bool) -> bool:
    """Directory `name` in dst; whether it was made (empty) here."""
    if not fresh:
        try:
            there = os.stat(name, dir_fd=dst, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(there.st_mode):
                return False
            os.unlink(name, dir_fd=dst)
    os.mkdir(name, 0o700, dir_fd=dst)
    return True


def _finish_dir(src: int, dst: int, uid: int, gid: int, mode_mask: int, problems: Problems) -> None:
    """A directory's own owner, mode and times, once its entries are in (they change its mtime)."""
    try:
        info = os.fstat(src)
        os.fchown(dst, uid, gid)
        os.fchmod(dst, stat.S_IMODE(info.st_mode) & mode_mask & 0o777)
        os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))
    except OSError as error:
        problems.note("directory attributes", error)


def _replace(name: str, dst: int) -> None:
    """Make room for a new entry `name` in dst."""
    try:
        os.unlink(name, dir_fd=dst)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        problems = Problems()
        _remove_entry(name, dst, problems)
        if problems:
            raise OSError(errno.ENOTEMPTY, problems[0]) from None


def _copy_link(name: str, src: int, dst: int, uid: int, gid: int, fresh: bool) -> None:
    info = os.stat(name, dir_fd=src, follow_symlinks=False)
    target = os.readlink(name, dir_fd=src)
    if not fresh:
        _replace(name, dst)
    os.symlink(target, name, dir_fd=dst)
    os.chown(name, uid, gid, dir_fd=dst, follow_symlinks=False)
    os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)


def _copy_file(name: str, src: int, dst: int, uid: int, gid: int, mode_mask: int, budget: Budget,
               copied: Copied, fresh: bool) -> None:
    fd_in = os.open(name, FILE_FLAGS, dir_fd=src)
    try:
        info = os.fstat(fd_in)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.ESTALE, "replaced while being copied")
        if budget.file_bytes is not None and info.st_size > budget.file_bytes:
            copied.problems.append(f"{name}: not copied, {info.st_size} bytes is past the limit of {budget.file_bytes}")
            return
        if not fresh:
            _replace(name, dst)
        fd_out = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=dst)
        try:
            os.fchown(fd_out, uid, gid)
            try:
                _copy_data(fd_in, fd_out, info, budget)
            except OSError:
                os.unlink(name, dir_fd=dst)  # no half file
                raise
            os.fchmod(fd_out, stat.S_IMODE(info.st_mode) & mode_mask & 0o777)
            os.utime(fd_out, ns=(info.st_atime_ns, info.st_mtime_ns))
            made = os.fstat(fd_out)
            copied.files[made.st_ino] = (info.st_ino, made.st_ctime_ns)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _copy_data(fd_in: int, fd_out: int, info: os.stat_result, budget: Budget) -> None:
    """The data of fd_in into fd_out at the same offsets; the holes of a sparse file stay holes."""
    size = info.st_size
    if info.st_blocks * 512 >= size:  # not sparse: one stream
        _take(budget, size)
        _copy_range(fd_in, fd_out, 0, size)
        return
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd_in, offset, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = min(os.lseek(fd_in, start, os.SEEK_HOLE), size)
        _take(budget, end - start)
        _copy_range(fd_in, fd_out, start, end)
        offset = end
    os.ftruncate(fd_out, size)


def _take(budget: Budget, count: int) -> None:
    if budget.data_bytes is not None and budget.copied_bytes + count > budget.data_bytes:
        raise OSError(errno.EFBIG, f"past the copy's limit of {budget.data_bytes} bytes")
    budget.copied_bytes += count


def _copy_range(fd_in: int, fd_out: int, start: int, end: int) -> None:
    """Bytes start..end of fd_in to the same offsets of fd_out (sendfile: no copy through Python)."""
    if start:
        os.lseek(fd_out, start, os.SEEK_SET)
    position = start
    while position < end:
        done = os.sendfile(fd_out, fd_in, position, min(1 << 30, end - position))
        if done == 0:  # the file shrank under us
            return
        position += done


def _try(problems: Problems, what: str, action: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    try:
        action(*args, **kwargs)
    except FileNotFoundError:
        pass
    except OSError as error:
        problems.note(what, error)

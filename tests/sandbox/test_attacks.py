"""The local sandbox's totals (cgroup, workspace disk) and its host-side file handling, attacked.

Each attack runs through real bubblewrap, a real cgroup and a real loop disk, and must be contained;
afterwards the host is untouched (files outside the workspace, no mount, no cgroup, no process left),
the uid lease is free again, and the next sandbox runs normally.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agentstream.sandbox import cgroups, hostfs
from agentstream.sandbox.contract import Limits, SandboxSpec
from agentstream.sandbox.local import STATE_DIR, LocalSandbox, processes_of
from tests.support.wait import wait_for

SMALL = Limits(command_timeout_s=60, attempt_timeout_s=300, processes=64, memory_bytes=1 << 30,
               disk_bytes=64 << 20)
DEEP = 2500


def open_sandbox(workspace: Path, limits: Limits = SMALL) -> LocalSandbox:
    workspace.mkdir(exist_ok=True)
    box = LocalSandbox(SandboxSpec(workspace, limits=limits))
    assert box._cgroup is not None and box._disk is not None, "this machine has cgroups and loop devices"
    return box


def lease_is_free(uid: int) -> bool:
    fd = os.open(STATE_DIR / "uids" / str(uid), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def host_files(tmp_path: Path):
    """Files outside the workspace an attack aims at; checked unchanged afterwards."""
    secret = tmp_path / "host" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("host secret\n")
    secret.chmod(0o600)
    watched = [secret, secret.parent, Path("/etc/passwd"), Path("/etc"), Path("/usr/bin")]
    before = {path: (os.lstat(path).st_uid, os.lstat(path).st_mode) for path in watched}
    yield secret
    assert {path: (os.lstat(path).st_uid, os.lstat(path).st_mode) for path in watched} == before
    assert secret.read_text() == "host secret\n"


def assert_host_clean(box: LocalSandbox) -> None:
    """After close: nothing of the sandbox is left on the host, and its uid may be leased again."""
    assert box._closed
    assert processes_of(box.uid) == 0
    assert lease_is_free(box.uid)
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f" {box.workspace} " not in mounts, "the disk is unmounted"
    assert box._cgroup is not None and not any(folder.exists() for folder in box._cgroup.dirs.values())
    with open_sandbox(box.workspace.parent / "next") as fresh:
        assert fresh.run("echo fresh > f && cat f").output == "fresh\n"


@pytest.mark.slow  # thousands of nested folders made, copied and removed on the host's disk
def test_a_deep_tree_with_links_to_host_files_goes_back_to_the_host_and_away(tmp_path: Path, host_files: Path):
    workspace = tmp_path / "workspace"
    script = f"""
import os
for depth in range({DEEP}):
    os.mkdir("d")
    os.chdir("d")
    if depth % 500 == 0:
        os.symlink({str(host_files)!r}, "secret-link")
        os.symlink("/etc", "etc-link")
        os.symlink("/", "root-link")
open("bottom.txt", "w").write("bottom")
print("built")
"""
    box = open_sandbox(workspace)
    try:
        (workspace / "make.py").write_text(script)
        assert box.run("python3 make.py").output == "built\n"
    finally:
        box.close()
    try:
        _check_deep_tree(box, workspace, tmp_path, host_files)
    finally:
        hostfs.remove_tree(workspace)  # pytest's own clean-up of tmp_path is recursive


def _check_deep_tree(box: LocalSandbox, workspace: Path, tmp_path: Path, host_files: Path) -> None:
    assert box.close_problems == []
    assert_host_clean(box)
    # the whole tree came back, links as links, owned by the workspace's owner
    fd = hostfs.open_dir(workspace)
    try:
        for depth in range(DEEP):
            child = hostfs.open_dir("d", fd)
            os.close(fd)
            fd = child
            if depth % 500 == 0:
                assert os.readlink("secret-link", dir_fd=fd) == str(host_files)
                assert os.stat("root-link", dir_fd=fd, follow_symlinks=False).st_uid == tmp_path.stat().st_uid
        with os.fdopen(os.open("bottom.txt", os.O_RDONLY, dir_fd=fd)) as bottom:
            assert bottom.read() == "bottom"
    finally:
        os.close(fd)
    # and it goes away without recursion, its links untouched
    with pytest.raises(RecursionError):
        shutil.rmtree(workspace)  # the standard library's walk is recursive
    assert hostfs.remove_tree(workspace) == [] and not workspace.exists()


@pytest.mark.slow  # thousands of nested folders made, copied and removed on the host's disk
def test_host_tree_operations_are_deep_and_follow_no_link(tmp_path: Path, host_files: Path):
    root = tmp_path / "tree"
    root.mkdir()
    fd = hostfs.open_dir(root)
    for _ in range(DEEP * 2):
        os.mkdir("d", dir_fd=fd)
        os.symlink(str(host_files), "secret-link", dir_fd=fd)
        os.symlink(str(host_files.parent), "dir-link", dir_fd=fd)
        child = hostfs.open_dir("d", fd)
        os.close(fd)
        fd = child
    os.mkfifo("fifo", dir_fd=fd)  # opened by nobody: a walk that opened it would block forever
    os.close(fd)
    assert hostfs.chown_tree(root, 600_123, 600_123) == []
    copy = tmp_path / "copy"
    copy.mkdir()
    source, target = hostfs.open_dir(root), hostfs.open_dir(copy)
    try:
        copied = hostfs.copy_tree(source, target, 0, 0)
    finally:
        os.close(source)
        os.close(target)
    assert copied.problems == [] and len(copied.files) == 0, "links and a FIFO: no regular file copied"
    assert copy.stat().st_uid == 0 and os.readlink(copy / "d" / "secret-link") == str(host_files)
    assert hostfs.remove_tree(root) == [] and hostfs.remove_tree(copy) == []
    assert not root.exists() and not copy.exists()
    assert hostfs.remove_tree(root) == [], "nothing there is not a problem"


def test_blocks_are_bounded_not_only_file_sizes(tmp_path: Path, host_files: Path):
    """fallocate --keep-size (size 0, blocks taken), sparse files, and a hard-link bomb."""
    workspace = tmp_path / "workspace"
    box = open_sandbox(workspace)
    try:
        keep = box.run("touch reserved; fallocate --keep-size -l 1G reserved")
        assert keep.limit == "disk" and "No space left on device" in keep.output, keep
        size, blocks = map(int, box.run("stat -c '%s %b' reserved").output.split())
        assert size == 0 and 0 < blocks * 512 <= SMALL.disk_bytes, "what it got is the disk's, no more"
        assert box.run("rm reserved && touch reserved && fallocate --keep-size -l 32M reserved").ok, "within the disk: allowed"
        assert "1G" not in box.run("df -h /workspace").output
        sparse = box.run("truncate -s 200M sparse && rm reserved && head -c 8M /dev/urandom > data && "
                         "for n in $(seq 1 40); do ln data link$n; done && echo ok")
        assert sparse.ok, sparse
        huge = box.run("truncate -s 100G huge")
        assert huge.limit == "file_size", "apparent size: RLIMIT_FSIZE"
    finally:
        box.close()
    assert (workspace / "sparse").stat().st_size == 200 << 20 and (workspace / "sparse").stat().st_blocks == 0
    written = sum(entry.stat().st_blocks * 512 for entry in workspace.iterdir() if entry.is_file())
    assert written <= SMALL.disk_bytes, "41 links of 8 MiB would be 328 MiB: the copy back stops at the disk's size"
    assert any("past the copy's limit" in problem for problem in box.close_problems), box.close_problems
    assert_host_clean(box)


def test_inode_exhaustion_stays_on_the_disk(tmp_path: Path, host_files: Path):
    workspace = tmp_path / "workspace"
    box = open_sandbox(workspace)
    try:
        flood = box.run("python3 -c \"\nimport os\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'w').close()\n"
                        "        n += 1\nexcept OSError as error:\n    print(n, error, flush=True)\n    raise\"")
        assert flood.limit == "disk" and "No space left on device" in flood.output, flood.output[-300:]
        made = int(flood.output.split()[0])
        assert 1000 < made < 100_000
        assert box.run("rm -f f*; echo x > after").ok, "space comes back"
    finally:
        box.close()
    assert sorted(os.listdir(workspace)) == ["after"]
    assert_host_clean(box)


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_a_fork_bomb_meets_the_pids_cgroup(tmp_path: Path, host_files: Path):
    limits = Limits(processes=40, command_timeout_s=3, disk_bytes=64 << 20)
    box = open_sandbox(tmp_path / "workspace", limits)
    try:
        assert box._cgroup is not None
        bomb = box.run("python3 -c \"\nimport os, threading, time\nwhile True:\n    try:\n        os.fork()\n"
                       "    except OSError:\n        threading.Event().wait()\"")
        assert bomb.limit == "processes", bomb
        assert box._cgroup.fork_refusals() > 0
        peak = (box._cgroup.dirs["pids"] / "pids.peak").read_text()
        assert int(peak) <= 40
        assert processes_of(box.uid) == 0 and box._cgroup.pids() == set()
        assert box.run("echo next").output == "next\n"
    finally:
        box.close()
    assert_host_clean(box)


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_memory_is_counted_across_processes_and_tmpfs(tmp_path: Path, host_files: Path):
    limits = Limits(memory_bytes=200 << 20, tmp_bytes=1 << 30, disk_bytes=1 << 30, file_size_bytes=1 << 30,
                    command_timeout_s=60)
    box = open_sandbox(tmp_path / "workspace", limits)
    try:
        assert box._cgroup is not None
        # each of 4 processes stays under RLIMIT_AS; together they do not fit
        spread = box.run("for n in 1 2 3 4; do python3 -c 'x = bytearray(90 << 20); import time; time.sleep(3)' & "
                         "done; wait")
        assert spread.limit == "memory", spread
        tmpfs = box.run("head -c 400M /dev/zero > /tmp/fill; echo wrote")
        assert tmpfs.limit == "memory", tmpfs  # /tmp's pages are the sandbox's memory
        cache = box.run("head -c 400M /dev/zero > big && sync && echo wrote")
        assert cache.ok, cache  # page cache is reclaimed, not an error
        assert box._cgroup.peak_memory() <= limits.memory_bytes + (1 << 20)
        assert box.run("rm big; echo next").output == "next\n"
    finally:
        box.close()
    assert_host_clean(box)


def test_nothing_of_a_command_runs_after_it(tmp_path: Path, host_files: Path):
    box = open_sandbox(tmp_path / "workspace")
    try:
        left = box.run("(setsid nohup sleep 300 >/dev/null 2>&1 &); nohup sleep 301 >/dev/null 2>&1 & disown; "
                       "python3 -c 'import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(300)'; echo started")
        assert left.ok and left.output == "started\n"
        assert processes_of(box.uid) == 0 and box._cgroup is not None and box._cgroup.pids() == set()
    finally:
        box.close()
    assert_host_clean(box)


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_cpu_hogs_share_the_quota(tmp_path: Path, host_files: Path):
    limits = Limits(cpus=0.25, disk_bytes=64 << 20, command_timeout_s=60)
    hog = ("import os, time\nbegan = time.time()\nwhile time.time() - began < 2: pass\n"
           "print(sum(os.times()[:2]))")
    box = open_sandbox(tmp_path / "workspace", limits)
    try:
        (box.workspace / "hog.py").write_text(hog)
        two = box.run("python3 hog.py & python3 hog.py & wait")
        used = sum(float(line) for line in two.output.split())
        assert two.ok and used < 2 * 0.25 * 1.6, f"2 s of two hogs at 0.25 cpus used {used} s of CPU"
    finally:
        box.close()
    assert_host_clean(box)


def test_the_workspace_round_trips(tmp_path: Path):
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    (workspace / "src" / "kept.py").write_text("kept\n")
    (workspace / "src" / "edited.py").write_text("old\n")
    (workspace / "gone.txt").write_text("gone\n")
    (workspace / "run.sh").write_text("#!/bin/sh\n")
    (workspace / "run.sh").chmod(0o755)
    (workspace / "link").symlink_to("src/kept.py")
    kept_inode = (workspace / "src" / "kept.py").stat().st_ino
    workspace.chmod(0o700)  # as mkdtemp makes it
    box = open_sandbox(workspace)
    try:
        script = ("echo new >> src/edited.py && rm gone.txt && mkdir -p a/b && echo x > a/b/new.txt && "
                  "touch -d 2001-01-01 a/b/new.txt && cp /bin/true setuid && chmod 4777 setuid && "
                  "chmod 777 a . && cat link")
        assert box.run(script).output == "kept\n"
        (workspace / "from-host.txt").write_text("live\n")  # the caller's writes are seen inside at once
        assert box.run("cat from-host.txt && cat src/kept.py").output == "live\nkept\n"
        assert (workspace / "a" / "b" / "new.txt").read_text() == "x\n", "and the sandbox's seen on the host"
    finally:
        box.close()
    assert box.close_problems == []
    assert (workspace / "src" / "edited.py").read_text() == "old\nnew\n"
    assert not (workspace / "gone.txt").exists()
    assert (workspace / "src" / "kept.py").stat().st_ino == kept_inode, "untouched files are not copied again"
    assert os.readlink(workspace / "link") == "src/kept.py"
    assert (workspace / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (workspace / "a" / "b" / "new.txt").stat().st_mtime < 1e9
    assert stat.S_IMODE((workspace / "setuid").stat().st_mode) == 0o755, "no set-id bit, nothing world-writable"
    assert stat.S_IMODE((workspace / "a").stat().st_mode) == 0o755
    assert stat.S_IMODE(workspace.stat().st_mode) == 0o700, "the caller's folder keeps its own mode"
    owner = tmp_path.stat().st_uid
    assert all(path.lstat().st_uid == owner for path in workspace.rglob("*"))
    assert_host_clean(box)


def test_close_meets_a_failure_and_still_frees_everything(tmp_path: Path):
    workspace = tmp_path / "workspace"
    (workspace / "locked").mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(workspace / "locked")], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        box = open_sandbox(workspace)
        try:
            assert box.run("echo agent > locked/new.txt && echo more > other.txt").ok
        finally:
            box.close()
        assert any("locked" in problem or "new.txt" in problem for problem in box.close_problems), box.close_problems
        assert (workspace / "other.txt").read_text() == "more\n", "the rest came back"
        assert_host_clean(box)
    finally:
        subprocess.run(["chattr", "-i", str(workspace / "locked")], check=True)


def test_a_crashed_sandboxs_writes_are_given_back_and_its_disk_taken_off(tmp_path: Path):
    """Its warden (sandbox.warden) does what close would have; tests/sandbox/test_dead_holder.py has the rest."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "base.txt").write_text("base\n")
    parent = subprocess.Popen([sys.executable, "-c", f"""
from pathlib import Path
from agentstream.sandbox.contract import SandboxSpec, Limits
from agentstream.sandbox.local import LocalSandbox
box = LocalSandbox(SandboxSpec(Path({str(workspace)!r}), Limits(disk_bytes=64 << 20)))
box.run("echo lost > lost.txt")
print(box.uid, flush=True)
box.run("sleep 300")
"""], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    uid = int(parent.stdout.readline())
    wait_for(lambda: processes_of(uid) >= 3, timeout=20, what="the sandboxed sleep")
    parent.kill()
    parent.wait()
    parent.stdout.close()
    wait_for(lambda: processes_of(uid) == 0, timeout=10, what="the sandbox to die with its parent")
    with open_sandbox(workspace) as box:
        assert box.run("ls").output == "base.txt\nlost.txt\n", "the crashed sandbox's writes are the folder's"
    assert sorted(os.listdir(workspace)) == ["base.txt", "lost.txt"]
    assert f" {workspace} " not in Path("/proc/self/mountinfo").read_text()
    assert str(uid) not in cgroups.leftovers(), "the crashed sandbox's cgroup is removed by the next sandbox"


@pytest.mark.slow  # thousands of nested folders made, copied and removed on the host's disk
def test_on_a_host_without_loop_devices_or_cgroups_a_deep_tree_still_closes(tmp_path: Path, host_files: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """The fallback (the workspace bound directly, chowned to the uid and back) walks the agent's tree on
    the host: as deep as the agent likes, with links to host files in it."""
    from agentstream.sandbox import disk

    monkeypatch.setattr(disk, "available", lambda: "switched off for this test")
    monkeypatch.setattr(cgroups, "create", lambda name, limits: None)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    box = LocalSandbox(SandboxSpec(workspace, limits=SMALL))
    try:
        assert box._disk is None and box._cgroup is None
        made = box.run(f"python3 -c \"\nimport os\nfor _ in range({DEEP}):\n    os.mkdir('d'); os.chdir('d')\n"
                       f"    os.symlink({str(host_files)!r}, 's')\nprint('built')\"")
        assert made.output == "built\n", made.output[-300:]
    finally:
        box.close()
    try:
        assert box.close_problems == [] and lease_is_free(box.uid)
        owner = tmp_path.stat().st_uid
        fd = hostfs.open_dir(workspace)
        for _ in range(DEEP):
            child = hostfs.open_dir("d", fd)
            os.close(fd)
            fd = child
        assert os.stat("s", dir_fd=fd, follow_symlinks=False).st_uid == owner
        os.close(fd)
    finally:
        assert hostfs.remove_tree(workspace) == []


def test_commands_run_at_once_do_not_end_each_other(tmp_path: Path):
    """After a command, what is left in the cgroup is killed, but not while another command runs."""
    import threading

    box = open_sandbox(tmp_path / "workspace")
    try:
        results = {}
        slow = threading.Thread(target=lambda: results.update(slow=box.run("sleep 1.5; echo slow")))
        slow.start()
        wait_for(lambda: processes_of(box.uid) >= 3, timeout=20, what="the slow command")
        assert box.run("echo quick").output == "quick\n"
        slow.join()
        assert results["slow"].ok and results["slow"].output == "slow\n", results["slow"]
        assert processes_of(box.uid) == 0
    finally:
        box.close()
    assert_host_clean(box)

"""A process holding open sandboxes dies (kill -9, or a SIGTERM it does not handle): nothing of them is left.

Real bubblewrap, real loop disks mounted over real folders, as root. After the death: no mount over the
workspaces in the host's mount table, no loop device on the dead sandboxes' (deleted) images, no cgroup,
no uid lease held; what the dead sandboxes wrote is in their folders; the next sandbox on such a folder
works and keeps its own writes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentstream.sandbox import cgroups
from agentstream.sandbox.contract import SandboxError, SandboxSpec
from agentstream.sandbox.local import DISKS, LocalSandbox, UidLease, claim_workspace, processes_of
from tests.support.sandbox_host import alive, loop_images, mounted
from tests.support.wait import wait_for

REPO = Path(__file__).parents[2]

HOLDER = """
import json, os, sys, threading
from pathlib import Path
from agentstream.sandbox.contract import SandboxSpec
from agentstream.sandbox.local import LocalSandbox
def warden_pid():  # our child running the warden
    for entry in os.scandir("/proc"):
        try:
            ppid = int(open(f"/proc/{entry.name}/stat").read().rsplit(") ", 1)[1].split()[1])
            command = open(f"/proc/{entry.name}/cmdline", "rb").read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"agentstream.sandbox.warden" in command:
            return int(entry.name)
boxes = [LocalSandbox(SandboxSpec(Path(folder))) for folder in sys.argv[1:]]
for box in boxes:
    assert box.run("echo dead-write > dead.txt && ln -s /etc planted").ok
for box in boxes[:-1]:
    threading.Thread(target=box.run, args=("sleep 300",), daemon=True).start()
print(json.dumps({"uids": [box.uid for box in boxes], "warden": warden_pid()}), flush=True)
boxes[-1].run("sleep 300")
"""


def hold(workspaces: list[Path]) -> tuple[subprocess.Popen[str], dict]:
    """A process holding an open sandbox on each of `workspaces`, each running a command: it and what it said."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, workspaces)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    said = json.loads(holder.stdout.readline())
    for uid in said["uids"]:
        wait_for(lambda uid=uid: processes_of(uid) >= 3, timeout=20, what="the sandboxed sleeps")
    return holder, said


def folders(tmp_path: Path, count: int) -> list[Path]:
    made = []
    for n in range(count):
        folder = tmp_path / f"workspace-{n}"
        folder.mkdir()
        (folder / "before.txt").write_text("before\n")
        made.append(folder)
    return made


def assert_nothing_left(workspaces: list[Path], uids: list[int]) -> None:
    for folder in workspaces:
        assert not mounted(folder), f"a disk is still mounted over {folder}"
    images = [f"{DISKS}/{uid}.img" for uid in uids]
    wait_for(lambda: not [i for i in loop_images().values() if i.startswith(tuple(images))], timeout=20,
             what="the dead sandboxes' loop devices to detach")
    assert not set(map(str, uids)) & set(cgroups.leftovers()), "a dead sandbox's cgroup is left"
    for uid in uids:
        lease = UidLease.hold_if_free(uid)
        assert lease is not None, f"uid {uid} is still leased"
        lease.release()
        wait_for(lambda uid=uid: processes_of(uid) == 0, timeout=10, what="the dead sandboxes' processes to be reaped")


@pytest.mark.slow  # two sandboxes opened, killed and cleaned up, a third opened after: seconds
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_dead_holder_leaves_no_mount_loop_device_cgroup_or_lease_and_keeps_its_writes(tmp_path: Path, sig):
    workspaces = folders(tmp_path, 2)
    holder, said = hold(workspaces)
    assert all(mounted(folder) for folder in workspaces), "the disks are mounted over the folders while open"
    holder.send_signal(sig)
    assert holder.wait(20) == -sig
    holder.stdout.close()
    # at once: the next sandbox on a folder waits for the warden's clean-up (it holds the folder's lock)
    with LocalSandbox(SandboxSpec(workspaces[0])) as box:
        seen = box.run("cat before.txt dead.txt && echo next > next.txt")
        assert seen.ok and seen.output == "before\ndead-write\n", "the dead sandbox's writes are kept"
    assert (workspaces[0] / "next.txt").read_text() == "next\n" and not mounted(workspaces[0])
    wait_for(lambda: not alive(said["warden"]), timeout=30, what="the warden to clean up and exit")
    assert_nothing_left(workspaces, said["uids"])
    for folder in workspaces:  # the dead sandboxes' writes are the folder's, given back to its owner
        assert (folder / "dead.txt").read_text() == "dead-write\n"
        assert (folder / "dead.txt").stat().st_uid == folder.parent.stat().st_uid
        assert (folder / "planted").is_symlink(), "a link the agent planted is copied as a link, never followed"


@pytest.mark.slow  # a sandbox opened, its host and warden killed, the next one opened: seconds
def test_a_disk_left_by_a_holder_and_warden_killed_together_is_taken_off_by_the_next_sandbox(tmp_path: Path):
    [workspace] = folders(tmp_path, 1)
    holder, said = hold([workspace])
    os.kill(said["warden"], signal.SIGKILL)  # e.g. a kill of everything at once: nothing undoes the mount
    holder.kill()
    holder.wait()
    holder.stdout.close()
    wait_for(lambda: processes_of(said["uids"][0]) == 0, timeout=10, what="the sandbox to die with its parent")
    assert mounted(workspace), "nothing took the disk off"
    with LocalSandbox(SandboxSpec(workspace)) as box:  # finds the disk's lock free: a dead one's, taken off
        done = box.run("cat before.txt && test ! -e dead.txt && echo next > next.txt")
        assert done.ok, done.output
    assert not mounted(workspace) and (workspace / "next.txt").read_text() == "next\n"
    assert_nothing_left([workspace], said["uids"])  # its cgroup went at the next sandbox's start


def test_one_sandbox_per_workspace_a_second_waits_and_is_refused_with_the_reason(tmp_path: Path):
    [workspace] = folders(tmp_path, 1)
    with LocalSandbox(SandboxSpec(workspace)):
        with pytest.raises(SandboxError, match="in use by another sandbox"):
            claim_workspace(workspace, wait_s=0.2)
    os.close(claim_workspace(workspace, wait_s=0))  # free once the first is closed


@pytest.mark.slow  # sandboxes opened and killed: seconds
def test_a_holder_killed_the_moment_it_wrote_is_cleaned_up_by_a_warden_still_starting(tmp_path: Path):
    """The warden may not yet watch its host when it dies (Python takes a while to start on a loaded machine):
    what the sandbox told it waits in the socket, its descriptors (and so its locks) with it."""
    workspaces = folders(tmp_path, 3)
    for folder in workspaces:
        subprocess.run([sys.executable, "-c", f"""
import os, signal
from pathlib import Path
from agentstream.sandbox.contract import SandboxSpec
from agentstream.sandbox.local import LocalSandbox
box = LocalSandbox(SandboxSpec(Path({str(folder)!r})))
assert box.run("echo early > early.txt").ok
os.kill(os.getpid(), signal.SIGKILL)
"""], cwd=REPO, check=False)
    for folder in workspaces:
        with LocalSandbox(SandboxSpec(folder)) as box:
            assert box.run("cat early.txt").output == "early\n", "the dead sandbox's write is kept"
        assert not mounted(folder)


@pytest.mark.slow  # a sandbox opened and killed, its warden's clean-up waited for: seconds
def test_a_disk_mounted_just_before_its_holder_died_is_taken_off_by_the_warden(tmp_path: Path):
    """Killed between mounting the disk over the folder and handing the warden the disk's root: the warden has
    the folder (and its lock) but no word of the disk. Nothing else comes to that folder after, so what the
    warden leaves there stays on the host."""
    [workspace] = folders(tmp_path, 1)
    holder = subprocess.run([sys.executable, "-c", f"""
import json, os, signal
from pathlib import Path
from agentstream.sandbox import disk
from agentstream.sandbox.contract import SandboxSpec
from agentstream.sandbox.local import LocalSandbox
from tests.support.sandbox_host import wardens
mount_over = disk.mount_over
def mount_and_die(device, folder):
    mount_over(device, folder)
    [warden] = [pid for pid, holder in wardens().items() if holder == os.getpid()]
    image = Path(f"/sys/block/{{Path(device).name}}/loop/backing_file").read_text().strip()
    print(json.dumps({{"warden": warden, "device": Path(device).name, "image": image}}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
disk.mount_over = mount_and_die
LocalSandbox(SandboxSpec(Path({str(workspace)!r})))
"""], cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
    assert holder.returncode == -signal.SIGKILL, holder
    said = json.loads(holder.stdout)
    wait_for(lambda: not alive(said["warden"]), timeout=30, what="the warden to clean up and exit")
    assert not mounted(workspace), "the disk stays mounted over the folder"
    wait_for(lambda: loop_images().get(said["device"]) != said["image"], timeout=20,
             what="the dead sandbox's loop device to detach")
    with LocalSandbox(SandboxSpec(workspace)) as box:
        assert box.run("cat before.txt").output == "before\n"
    assert not mounted(workspace)

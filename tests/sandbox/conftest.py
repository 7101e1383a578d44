"""After every sandbox test, nothing of its sandboxes is left on the host: once the wardens of the host
processes it killed have exited, no disk is mounted under the session's temporary folders and no loop device
it attached is still bound to a sandbox's image whose uid nobody leases. A leftover mount is a defect however
it came (chaos and sandbox attacks are checked from outside): this fails the test that left it, and takes
such mounts off, so that a failed test (one stopped before its next sandbox took a dead one's disk off) leaves
none on the host for later runs to trip over."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentstream.sandbox import disk
from tests.support.sandbox_host import alive, loop_images, mount_points, unleased_disks, wardens
from tests.support.wait import wait_for

WARDENS_EXIT_S = 60.0
"""a warden of a dead host cleans up (copies a disk back) and exits: seconds, more on a loaded machine"""
LOOP_DETACH_S = 30.0
"""a closed sandbox's namespace goes in a thread of its own, and its disk's loop device with it"""


@pytest.fixture(autouse=True)
def nothing_of_the_sandboxes_left(tmp_path_factory):
    wardens_before, loops_before = set(wardens()), loop_images()
    yield
    ours = f"{tmp_path_factory.getbasetemp()}/"
    try:
        wait_for(lambda: not {pid for pid, holder in wardens().items()
                              if pid not in wardens_before and not alive(holder)},
                 timeout=WARDENS_EXIT_S, what="the wardens of the test's dead host processes to clean up and exit")
    finally:
        left = [point for point in mount_points() if point.startswith(ours)]
        for point in reversed(left):  # the last mounted first; reported below
            disk.unmount(Path(point))
    assert not left, f"mounts left under the test's folders: {left}"
    wait_for(lambda: not unleased_disks({device: image for device, image in loop_images().items()
                                          if loops_before.get(device) != image}),
             timeout=LOOP_DETACH_S, what="the loop devices of the test's closed sandboxes to detach")

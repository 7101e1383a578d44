"""Files that survive a crash whole or not at all: written beside, flushed, renamed into place.

Manifests, replay positions, archive and dataset parts, and the trainer's checkpoints all rest on
this: after a kill -9 or a power cut a reader finds the old file or the new one, never a part.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` writes the file at a temporary name beside `path`; it is flushed to disk and
    renamed over `path`, and the rename made durable."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    fsync(tmp)
    os.replace(tmp, path)
    fsync(path.parent)


def fsync(path: Path) -> None:
    """Flush a file, or a folder's entries (a rename in it), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

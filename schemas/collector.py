"""Python's garbage collector, out of the way of code that decodes events by the thousand.

Decoding an event makes dozens of containers (its lists of token ids, its request's dicts), and the
default threshold (700 allocations) ran a young-generation collection every few events: in the
streams worker and in a rebuild, a fifth of the time went to collections that found no cycles.
`relax` raises the thresholds and freezes what exists (modules, the app): collections still run,
less often, over the objects made since. `paused` turns it off for the length of a Kafka scan.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

THRESHOLD = (20_000, 20, 20)
"""allocations between young-generation collections; young collections between older ones"""


def relax() -> tuple[int, int, int]:
    """For the rest of the process (a service's main); returns the thresholds it replaced."""
    previous = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*THRESHOLD)
    return previous


@contextlib.contextmanager
def relaxed() -> Iterator[None]:
    """For the duration of a job within a process that goes on after it (a rebuild in the CLI or a bench).

    A process that froze its objects itself (a service's main) keeps its settings as they are: undoing
    them here would unfreeze what it froze.
    """
    if gc.get_freeze_count():
        yield
        return
    previous = relax()
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


_pausing = 0


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The cycle collector off while a scan from Kafka runs (and on again after the last of several
    at once): librdkafka's messages are objects it tracks, tens of thousands alive at a time while their
    fetches decode, and its full passes over them cost ~1.5 µs of CPU per call event (of ~17, measured
    with it on and off in turn). Nothing a scan makes holds a cycle; reference counting frees it."""
    global _pausing
    if _pausing == 0 and not gc.isenabled():  # off already (by the program): leave it so
        yield
        return
    _pausing += 1
    gc.disable()
    try:
        yield
    finally:
        _pausing -= 1
        if _pausing == 0:
            gc.enable()

"""Python's garbage collector, out of the way of code that decodes events by the thousand.

Decoding an event makes dozens of containers (its lists of token ids, its request's dicts), and the
default threshold (700 allocations) ran a young-generation collection every few events: in the
streams worker and in a rebuild, a fifth of the time went to collections that found no cycles.
`relax` raises the thresholds and freezes what exists (modules, the app): collections still run,
less often, over the objects made since. `paused` turns it off for the length of a Kafka scan.
`Survivors` keeps a live worker's held events, and a rebuild's settled attempts, out of the collector's passes.
A rebuild folds `paused` as well: even with its survivors frozen, the young passes over each batch's
decoded events took 8 % of a rebuild worker's CPU, and its garbage cycles wait for the full pass.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

THRESHOLD = (20_000, 20, 20)
"""allocations between young-generation collections; young collections between older ones"""


_relaxed = False
"""whether `relax` ran (gc.get_freeze_count() walks every frozen object: ~25 ms in a worker)"""


def relax() -> tuple[int, int, int]:
    """For the rest of the process (a service's main); returns the thresholds it replaced."""
    global _relaxed
    _relaxed = True
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
    global _relaxed
    previous = relax()
    try:
        yield
    finally:
        _relaxed = False
        gc.set_threshold(*previous)
        gc.unfreeze()


_pausing = 0


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The cycle collector off while a scan from Kafka or a rebuild runs (and on again after the last of several
    at once): librdkafka's messages are objects it tracks, tens of thousands alive at a time while their
    fetches decode, and its full passes would walk them all again and again, a share of a scan's CPU for
    nothing: nothing a scan makes holds a cycle; reference counting frees it."""
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


class Survivors:
    """Freeze what is alive at the end of each batch of a live worker (or each fetched round of a rebuild,
    whose settled attempts stay in memory for the range), and collect everything now and then.

    A live streams worker holds each event it reads, decoded, until its attempt settles (`--settle-s`
    later): thousands of objects with lists of token ids. Every young-generation pass met them alive,
    traversed them and moved them on, and the older passes traversed them again: at 5,000 events/s
    ~4 young passes a second of 10-70 ms and an older one of ~100 ms every five seconds, ~10 % of the
    worker's wall time, and they collected nothing (no cycles: reference counting frees the events).
    Frozen, they are left out of every pass and still freed when their last reference goes
    (`gc.freeze` is a list splice, O(1)). What a freeze would keep from the collector is garbage in
    cycles made before it: every `full_pass_s` everything is unfrozen and collected once, then frozen
    again, so such garbage lives at most that long. A process that did not `relax` (froze nothing) is
    left as it is.
    """

    def __init__(self, full_pass_s: float = 600.0):
        self.full_pass_s = full_pass_s
        self.last_full_pass = time.monotonic()

    def batch_ended(self) -> None:
        if not _relaxed:
            return
        now = time.monotonic()
        if now - self.last_full_pass >= self.full_pass_s:
            self.last_full_pass = now
            gc.unfreeze()
            gc.collect()
        gc.freeze()

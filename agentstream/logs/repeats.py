"""Dropping repeats by id: how every reader of the log sees each event once.

Writers may repeat an event, always with the same id: the streams worker re-emits the trajectories
(and computed rewards, deadletters) it published but had not recorded as settled when it was killed,
and a rebalance may repeat a pool update. Rather than make those writes transactional, every reader
this project ships keeps the first copy of an id: the trainer (trainer/ledger.py), replay and its
exports, SQL and top (here); a dashboard over SQL gets it from there.
"""

from __future__ import annotations

from collections import deque

import polars as pl

WINDOW = 200_000
"""ids remembered by a `Repeats`: a repeat follows its first copy closely (a restarted worker re-emits
what it settled just before it died), so the latest 200,000 ids of a reader are plenty"""


class Repeats:
    """The latest `window` event ids a reader has seen."""

    def __init__(self, window: int = WINDOW):
        self._seen: set[str] = set()
        self._order: deque[str] = deque()
        self.window = window
        self.dropped = 0

    def first(self, event_id: str | None) -> bool:
        """Whether this is the first copy of `event_id` (then it is remembered); an event without an id
        is never a repeat."""
        if event_id is None:
            return True
        if event_id in self._seen:
            self.dropped += 1
            return False
        self._seen.add(event_id)
        self._order.append(event_id)
        if len(self._order) > self.window:
            self._seen.discard(self._order.popleft())
        return True


def drop_repeats(frame: pl.DataFrame) -> pl.DataFrame:
    """The rows of a topic's table, each id once (the first copy, in log order)."""
    if frame.is_empty() or "id" not in frame.columns:
        return frame
    first = frame["id"].is_first_distinct()
    # usually there is no repeat: then the frame as it is (filtering copies every column, token lists too)
    return frame if first.all() else frame.filter(first)

"""Exactly-once accounting of the records a trainer reads.

Every record of the source is either *held* (its sample waits in the batcher) or *settled* (trained
on, or dropped for a counted reason). A partition's watermark is the offset of its oldest held
record, or the offset after the last record seen: everything below it is settled. Above it, some
records may be settled already (a later group completed before an older one); the ledger keeps
their offsets.

Each checkpoint stores the ledger (`LedgerState`): watermarks, the settled offsets above them, and
the ids of recently settled trajectories. Consumer offsets are committed to the watermarks only
after that checkpoint is durable and its weights event acknowledged. A restarted trainer loads the
newest checkpoint, seeks each partition to its watermark, and skips the settled offsets above it:
no sample is trained twice, none is skipped, whether it died before or after the commit. The
recent ids catch re-deliveries of a trajectory (the same id at another offset) within
`dedupe_window` trajectories.

A session's conversation may be published again, as a revision with the reward of later feedback
(`Trajectory.revision_of`). One conversation is one sample: the ledger keeps the conversations
recently trained on (within `dedupe_window` of them), so a revision of one already trained is
dropped, and the checkpoint keeps them across restarts.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from pydantic import BaseModel, Field


class SourceState(BaseModel):
    watermarks: dict[int, int] = Field(default_factory=dict)
    settled: dict[int, list[int]] = Field(default_factory=dict, description="settled offsets above the watermark")


class LedgerState(BaseModel):
    sources: dict[str, SourceState] = Field(default_factory=dict, description="by source name")
    recent_ids: list[str] = Field(default_factory=list, description="recently settled trajectory ids, oldest first")
    trained_conversations: list[str] = Field(default_factory=list, description="sessions' conversations recently "
                                             "trained on (the first trajectory id of each), oldest first")


class Ledger:
    def __init__(self, source: str, state: LedgerState | None = None, window: int = 100_000):
        self.source = source
        self.state = state or LedgerState()
        resumed = self.state.sources.get(source, SourceState())
        self.floor = dict(resumed.watermarks)  # below these, a previous run settled everything
        self.next = dict(resumed.watermarks)
        self.settled: dict[int, set[int]] = defaultdict(set, {p: set(o) for p, o in resumed.settled.items()})
        self.held: dict[int, dict[int, str]] = defaultdict(dict)
        self.held_ids: set[str] = set()
        self.window = window
        self.recent: OrderedDict[str, None] = OrderedDict.fromkeys(self.state.recent_ids[-window:] if window else [])
        self.trained: OrderedDict[str, None] = OrderedDict.fromkeys(
            self.state.trained_conversations[-window:] if window else [])

    def settled_before(self, partition: int, offset: int) -> bool:
        """True for a record a previous run (or this one) has already settled: skip it silently."""
        return offset < self.floor.get(partition, 0) or offset in self.settled[partition]

    def is_duplicate(self, event_id: str) -> bool:
        return event_id in self.recent or event_id in self.held_ids

    def hold(self, partition: int, offset: int, event_id: str) -> None:
        self._see(partition, offset)
        self.held[partition][offset] = event_id
        self.held_ids.add(event_id)

    def settle(self, partition: int, offset: int, event_id: str | None) -> None:
        """Account for a record: trained on, or dropped (duplicate, stale, undecodable, …)."""
        self._see(partition, offset)
        held = self.held[partition].pop(offset, None)
        if held is not None:
            self.held_ids.discard(held)
        self.settled[partition].add(offset)
        if event_id and self.window:
            self.recent[event_id] = None
            self.recent.move_to_end(event_id)
            while len(self.recent) > self.window:
                self.recent.popitem(last=False)

    def was_trained(self, conversation: str) -> bool:
        return conversation in self.trained

    def trained_on(self, conversation: str) -> None:
        """A session's conversation was trained on: none of its revisions is, from now on."""
        if self.window:
            self.trained[conversation] = None
            self.trained.move_to_end(conversation)
            while len(self.trained) > self.window:
                self.trained.popitem(last=False)

    def release(self, partitions: set[int]) -> None:
        """Let go of the held records of partitions this trainer lost: whoever reads the partition next
        (a new owner, or this trainer once it is assigned again) reads them again from the watermark."""
        marks = self.watermarks()
        for partition in partitions:
            if partition in marks:
                self.next[partition] = marks[partition]
            for event_id in self.held.pop(partition, {}).values():
                self.held_ids.discard(event_id)

    def watermarks(self) -> dict[int, int]:
        marks = {}
        for partition, after_last in self.next.items():
            held = self.held[partition]
            marks[partition] = min(held) if held else after_last
        return marks

    def snapshot(self) -> LedgerState:
        """The state a checkpoint stores; prunes settled offsets below the watermarks."""
        marks = self.watermarks()
        for partition, mark in marks.items():
            self.settled[partition] = {o for o in self.settled[partition] if o >= mark}
        sources = dict(self.state.sources)
        sources[self.source] = SourceState(
            watermarks=marks, settled={p: sorted(o) for p, o in self.settled.items() if o})
        self.state = LedgerState(sources=sources, recent_ids=list(self.recent),
                                 trained_conversations=list(self.trained))
        return self.state

    def _see(self, partition: int, offset: int) -> None:
        self.next[partition] = max(self.next.get(partition, 0), offset + 1)

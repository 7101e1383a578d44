"""Sessions in the fold: which conversation (segment) of a session an event belongs to, and when it is due.

A session's events carry its rollout id and no attempt (`schemas.sessions`). The fold numbers its
conversations `segment-0`, `segment-1`, … and decides from event times alone, so a replay splits and
settles them as the live worker did. An event read is held (`held`: [id, time, topic rank], and a call's offset
in the calls topic where it is known) until the
watermark (every source topic read up to that time) is `settle_ms` past its time; then the held events are
folded in (time, topic, id) order, each before any settling due at or after its time (`Assembly.release`).
Whatever order the rollouts, calls and rewards topics were read in (a worker catching up fetches them side
by side), or written in within `settle_ms` (an end ahead of its calls), the fold sees one order, a rebuild's:

- a call joins the latest segment unless it comes after that segment's boundary: the explicit end's
  time + `settle_ms` (calls in flight at the end still join), else its last call + `session_idle_ms`;
  after the boundary it opens the next segment;
- an explicit end applies to the latest segment; calls of that segment timed after its new boundary
  (read before the end, as a worker catching up reads topics side by side) move to the next one;
- feedback about a call joins that call's segment; feedback about the session (or about a call not read
  yet) joins the latest segment begun at or before its time, and moves with the calls it follows;
- a segment settles at its boundary once feedback came (+ `settle_ms` after the first), or
  `feedback_window_ms` after its end without any (its trajectory then says `reward_missing`);
- feedback after that is kept pending and scored `settle_ms` after its time (a `reward` event naming
  the trajectory); a settled segment is forgotten `session_retention_ms` after it settled.

The state of a segment is an attempt's (`ids`, `last`, `end`, `reward_at`, ...) plus `session` (its
id), `first` (its first call's time), `calls` ([id, time, offset] in the order folded: the offset in the
calls topic, where the worker read it, so that a settled conversation keeps that reference and not the call,
`call_offsets`), `call_last` and `fb` ([id, time, call id or None] of its feedback). The rules below still take events in any order (a call
written later than `settle_ms` after its time is folded after what came before it).
"""

from __future__ import annotations

from typing import Any, Protocol

from agentstream.schemas.events import CallEvent, Event, FeedbackEvent, SessionEndedEvent
from agentstream.schemas.sessions import segment_attempt_id

SOURCES = ("rollouts", "calls", "rewards")
"""the topics a session's events come from, in the order that breaks ties between events of the same time"""
FOREVER_MS = 1 << 62
"""the due time of a session whose segments were all forgotten: kept for its numbering, never due"""


class SessionTiming(Protocol):
    @property
    def settle_ms(self) -> int: ...
    @property
    def session_idle_ms(self) -> int: ...
    @property
    def feedback_window_ms(self) -> int: ...
    @property
    def session_retention_ms(self) -> int: ...


def new_state(partition: int) -> dict[str, Any]:
    return {"partition": partition, "latest": None, "attempts": {}, "segments": 0}


def new_segment(state: dict[str, Any], session_id: str, time: int) -> str:
    attempt_id = segment_attempt_id(state["segments"])
    state["segments"] += 1
    state["attempts"][attempt_id] = {"ids": [], "managed": False, "awaits_reward": True, "last": time, "end": None,
                                     "reward_at": None, "session": session_id, "first": time, "calls": [],
                                     "call_last": None, "fb": []}
    state["latest"] = attempt_id
    return attempt_id


def held_entry(event: Event, offset: int | None = None) -> list[Any]:
    """A session's event read and not folded yet: [id, time, its topic's rank in `SOURCES`], and the offset it
    was read at where known (a call's: its reference once its conversation settled)."""
    entry = [event.id, event.time, SOURCES.index(event.topic)]
    return entry if offset is None else [*entry, offset]


def held_offset(entry: list[Any]) -> int | None:
    return int(entry[3]) if len(entry) > 3 else None


def call_offsets(attempt: dict[str, Any]) -> dict[str, int]:
    """Call id → its offset in the calls topic, of the conversation's calls whose offset is known."""
    return {entry[0]: int(entry[2]) for entry in attempt["calls"] if len(entry) > 2}


def held_order(entry: list[Any]) -> tuple[int, int, str]:
    """The order held events are folded in: time, then topic (as a rebuild merges them), then id."""
    return entry[1], entry[2], entry[0]


def held_due(held: list[list[Any]], attempts_due: int, timing: SessionTiming) -> int:
    """When a session with held events is next due: its first held event is folded `settle_ms` after its time,
    and what its conversations have due at or after that time waits for it."""
    first = min(entry[1] for entry in held)
    return first + timing.settle_ms if first <= attempts_due else attempts_due


def ended_at(attempt: dict[str, Any], timing: SessionTiming) -> int:
    """When the conversation ended: its explicit end, else idle after its last call."""
    end = attempt["end"]
    if end is not None:
        return int(end["time"])
    last = attempt["call_last"] if attempt["call_last"] is not None else attempt["last"]
    return int(last) + timing.session_idle_ms


def boundary(attempt: dict[str, Any], timing: SessionTiming) -> int:
    """The latest event time of a call that still joins this conversation."""
    end = attempt["end"]
    return int(end["time"]) + timing.settle_ms if end is not None else ended_at(attempt, timing)


def settle_at(attempt: dict[str, Any], timing: SessionTiming) -> int:
    """When an open conversation settles into its trajectory (`finalize_at` of a session's attempt)."""
    ended, bound = ended_at(attempt, timing), boundary(attempt, timing)
    first_feedback = attempt["reward_at"]
    if first_feedback is not None and first_feedback <= ended + timing.feedback_window_ms:
        return max(bound, int(first_feedback) + timing.settle_ms)
    return max(bound, ended + max(timing.feedback_window_ms, timing.settle_ms))


def pending(attempt: dict[str, Any]) -> list[list[Any]]:
    """A settled conversation's feedback not scored yet ([id, time])."""
    scored = {entry[0] for entry in attempt["settled"].get("feedback", ())}
    return [entry for entry in attempt["fb"] if entry[0] not in scored]


def settled_due(attempt: dict[str, Any], timing: SessionTiming) -> int:
    """A settled conversation: due when pending feedback is to be scored, else when it is forgotten."""
    waiting = pending(attempt)
    if waiting:
        return min(int(entry[1]) for entry in waiting) + timing.settle_ms
    return int(attempt["settled"]["time"]) + timing.session_retention_ms


def route(state: dict[str, Any], event: Event, session_id: str, timing: SessionTiming) -> str | None:
    """The segment this event belongs to (opening one where it starts a conversation); None for an end
    that ends nothing (a repeat, or one after the conversation's idle end)."""
    latest = state["attempts"].get(state["latest"]) if state["latest"] else None
    kind = type(event)
    if kind is CallEvent:
        if latest is None or event.time > boundary(latest, timing):
            previous = latest
            attempt_id = new_segment(state, session_id, event.time)
            if previous is not None and not previous.get("settled"):  # what it read ahead of this call follows it
                _move(previous, state["attempts"][attempt_id],
                      [entry for entry in previous["fb"] if entry[2] is None and entry[1] >= event.time])
            return attempt_id
        return str(state["latest"])
    if latest is None:
        return new_segment(state, session_id, event.time)
    if kind is SessionEndedEvent:
        if latest["end"] is not None or latest.get("settled") or event.time > boundary(latest, timing):
            return None
        return str(state["latest"])
    if type(event) is FeedbackEvent and event.data.call_id is not None:
        call_id = event.data.call_id
        for attempt_id, attempt in state["attempts"].items():
            if any(entry[0] == call_id for entry in attempt["calls"]):
                return str(attempt_id)
    begun = [attempt_id for attempt_id, attempt in state["attempts"].items() if attempt["first"] <= event.time]
    return str(begun[-1] if begun else next(iter(state["attempts"])))


def joined(state: dict[str, Any], attempt: dict[str, Any], call: list[Any]) -> None:
    """A call joined `attempt`: feedback about it read before it, in another open segment, comes along."""
    attempt["first"] = min(attempt["first"], call[1])
    for other in state["attempts"].values():
        if other is not attempt and not other.get("settled"):
            _move(other, attempt, [entry for entry in other["fb"] if entry[2] == call[0]])


def _move(source: dict[str, Any], target: dict[str, Any], feedback: list[list[Any]]) -> None:
    """Move feedback entries (and their ids) from one open segment to another."""
    if not feedback:
        return
    gone = {entry[0] for entry in feedback}
    source["fb"] = [entry for entry in source["fb"] if entry[0] not in gone]
    source["ids"] = [event_id for event_id in source["ids"] if event_id not in gone]
    source["reward_at"] = min((entry[1] for entry in source["fb"]), default=None)
    target["fb"] += feedback
    target["ids"] += [entry[0] for entry in feedback]
    target["last"] = max(target["last"], *(entry[1] for entry in feedback))
    target["reward_at"] = min(entry[1] for entry in target["fb"])


def split_after_end(state: dict[str, Any], attempt: dict[str, Any], session_id: str, timing: SessionTiming) -> None:
    """Move the calls timed after the ended segment's boundary (and the feedback that follows them: about
    them, or about the session and not before them) to the next segment."""
    bound = boundary(attempt, timing)
    moved = [entry for entry in attempt["calls"] if entry[1] > bound]
    if not moved:
        return
    begins = min(entry[1] for entry in moved)
    target = state["attempts"][new_segment(state, session_id, begins)]
    moved_ids = {entry[0] for entry in moved}
    attempt["calls"] = [entry for entry in attempt["calls"] if entry[0] not in moved_ids]
    attempt["ids"] = [event_id for event_id in attempt["ids"] if event_id not in moved_ids]
    attempt["call_last"] = max((entry[1] for entry in attempt["calls"]), default=None)
    target["calls"], target["ids"] = moved, [entry[0] for entry in moved]
    target["call_last"] = target["last"] = max(entry[1] for entry in moved)
    _move(attempt, target, [entry for entry in attempt["fb"]
                            if entry[2] in moved_ids or (entry[2] is None and entry[1] >= begins)])

"""Sessions: production traffic (model calls made outside any rollout) as rollout-keyed events.

A session is the calls that share a session id: the `x-agentstream-session-id` header, or else the
caller's key's default (`default_session_id`). Its events travel on the rollout-scoped topics under
a rollout id derived from the session id (`session_rollout_id`), so one session's calls, end and
feedback share a partition, in order, like a rollout's, and the streams worker assembles them with
the same fold. Their envelopes name no attempt: the worker splits a session into conversations
(segments) by its ends (an explicit `session.ended`, or `--session-idle-s` without calls), and each
segment is an attempt of the session's rollout, `segment_attempt_id(n)` for the n-th (0-based), with
its own trajectory, `trajectory_id(rollout_id, attempt_id)`.

    session "chat-42" ─▶ rollout "session-<uuid5 of chat-42>" ─▶ attempts "segment-0", "segment-1", …

What the trainer reads of a session: its trajectory (`Trajectory.session_id` set), published once per
segment, after the segment ended and its first feedback came (or `--feedback-window-s` passed without
any: `reward_missing`, counted, never guessed). Its `reward`/`rewards` are the reward policy's
(`reward_fn` names the policy), per-turn ones on `Turn.reward` (a feedback that names a call), with
each turn's token span from `Turn.completion_start`. Feedback that comes after the trajectory was
published becomes a `reward` event of the segment (`rollout_id`, `attempt_id`) with
`Reward.trajectory_id` set: the policy's reward over all the segment's feedback so far, the latest
superseding the ones before.

Session ids are one namespace for operator keys (they act for everything); an app key's session ids are
its own (`app_session_id`: its identity before the id it names), so two apps that both name "chat-1" have two
sessions and neither can end or rate the other's. Pick unique ones anyway (a UUID per conversation).
"""

from __future__ import annotations

import hashlib

from agentstream.schemas.ids import derived_id

SESSION_PREFIX = "session-"
"""rollout ids of sessions start with it (controllers' rollout ids are UUIDs or task-derived names)"""
SEGMENT_PREFIX = "segment-"
MAX_SESSION_ID = 256
"""characters of a session id the gateway takes (header or path)"""


def session_rollout_id(session_id: str) -> str:
    """The rollout id a session's events are keyed by (the same for every gateway replica and replay)."""
    return SESSION_PREFIX + derived_id("session", session_id)


def is_session_rollout(rollout_id: str | None) -> bool:
    return bool(rollout_id) and rollout_id.startswith(SESSION_PREFIX)  # type: ignore[union-attr]


def segment_attempt_id(index: int) -> str:
    """The attempt id of a session's `index`-th conversation (0-based), as the fold numbers them."""
    return f"{SEGMENT_PREFIX}{index}"


def feedback_id(sender: str, session_id: str, client_id: str) -> str:
    """The id of a feedback event its sender named `client_id`: sent twice, it is one event; another sender's
    same `client_id` is another event (it cannot pre-empt this one)."""
    return derived_id("feedback", sender, session_id, client_id)


def key_identity(key: str) -> str:
    """A gateway key's name in events (who sent feedback, whose default session): not the key itself."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def app_session_id(identity: str, session_id: str) -> str:
    """The session an app key's `session_id` names: in that key's namespace, `key:<hash>:<session_id>` (what
    events and answers name; an operator names it so)."""
    return f"{identity}:{session_id}"


def default_session_id(sender: str) -> str:
    """The session of calls that name none: one per key, split into conversations by idleness."""
    return f"default:{sender}"

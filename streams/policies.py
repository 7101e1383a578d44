"""Reward policies: how a session's feedback becomes its reward (`--reward-policy module:function`).

Production traffic has no task and no grader: what says how a session went is the feedback people
send about it (`feedback` events: a score, a label or thumbs, about the session or one call of it),
possibly long after it ended. A reward policy is a function over one conversation of a session and
its feedback so far, returning a `Reward` (its `turns` name calls: per-turn rewards), a float, or
None (nothing it can score: no reward, never a guess). The worker runs it when the conversation's
trajectory is built and again whenever later feedback comes; its results are `reward` events
naming the policy. Feedback is kept raw in the log, so `agentstream replay rebuild --reward-policy`
rewards history again under another rule, with the same sequences.

    def resolved(session: SessionFeedback) -> float | None:      # --reward-policy mymodule:resolved
        labels = [f.data.label for f in session.feedback if f.data.label]
        return float(labels[-1] == "resolved") if labels else None
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from agentstream.schemas.events import REWARD_MAX, Event, Feedback, FeedbackEvent, Reward, RewardEvent, TurnReward
from agentstream.streams.rewards import RewardError, load

DEFAULT_POLICY = "streams.policies:latest"


@dataclass(frozen=True)
class SessionFeedback:
    """One conversation (segment) of a session, and the feedback about it so far, in time order."""

    session_id: str
    rollout_id: str
    attempt_id: str
    turns: list[str]
    """the call ids of the trajectory's turns, in order"""
    feedback: Sequence[FeedbackEvent]

    def about_session(self) -> list[Feedback]:
        return [event.data for event in self.feedback if event.data.call_id is None]

    def about_calls(self) -> dict[str, Feedback]:
        """call id → the latest feedback about that call (of the trajectory's turns)"""
        turns = set(self.turns)
        return {event.data.call_id: event.data for event in self.feedback
                if event.data.call_id is not None and event.data.call_id in turns}


def score(name: str, session: SessionFeedback) -> Reward | None:
    """Run the named policy; a float becomes a Reward naming it. Any failure is a RewardError."""
    policy = load(name)
    try:
        result = policy(session)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward policy {name} failed: {type(exc).__name__}: {exc}") from exc
    if result is None:
        return None
    if isinstance(result, Reward):
        reward = result.model_copy(update={"reward_fn": name})
    elif isinstance(result, (int, float)) and not isinstance(result, bool):
        reward = Reward(value=float(result), reward_fn=name)
    else:
        raise RewardError(f"reward policy {name} returned {type(result).__name__}; return a float, a Reward or None")
    if not all(_trainable(value) for value in (reward.value, *(turn.value for turn in reward.turns))):
        # (feedback written to Kafka past the gateway's range check: deadlettered, never in a trajectory)
        raise RewardError(f"reward policy {name} returned a value that is not a finite number within "
                          f"±{REWARD_MAX:.4g} (the trainer's float32 would make it inf, and its batch NaN)")
    return reward


def _trainable(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= REWARD_MAX


def untrainable(event: Event) -> str | None:
    """Why a reward or feedback event carries a number no trajectory may hold (not finite, or beyond a
    float32: the trainer's reward tensors would hold inf, and every advantage of its batch NaN); else None.
    The gateway refuses such numbers; this keeps one written to Kafka past it out of the fold."""
    if type(event) is RewardEvent:
        values = [event.data.value, *(turn.value for turn in event.data.turns)]
    elif type(event) is FeedbackEvent and event.data.score is not None:
        values = [event.data.score]
    else:
        return None
    if all(_trainable(value) for value in values):
        return None
    return (f"a {event.type} whose number is not finite or beyond ±{REWARD_MAX:.4g} (a float32: the trainer's "
            "rewards would be inf, its batch's advantages NaN)")


# --- policies --------------------------------------------------------------------------------


def value_of(feedback: Feedback, down: float = 0.0) -> float | None:
    """A feedback's number: its score, else thumbs up 1 / down `down`; a label alone has none."""
    if feedback.score is not None:
        return feedback.score
    if feedback.thumbs is not None:
        return 1.0 if feedback.thumbs == "up" else down
    return None


def _policy(session: SessionFeedback, down: float) -> Reward | None:
    per_call = {call_id: value for call_id, f in session.about_calls().items()
                if (value := value_of(f, down)) is not None}
    overall = [value for f in session.about_session() if (value := value_of(f, down)) is not None]
    if overall:
        value = overall[-1]
    elif per_call:
        value = sum(per_call.values()) / len(per_call)
    else:
        return None
    turns = [TurnReward(call_id=call_id, value=v) for call_id, v in per_call.items()]
    return Reward(value=value, turns=turns, details={"feedback": len(session.feedback)})


def latest(session: SessionFeedback) -> Reward | None:
    """The latest feedback about the whole session (its score; thumbs up 1, down 0), else the mean of the
    calls' latest; each call's latest feedback is that turn's reward. Labels alone score nothing."""
    return _policy(session, down=0.0)


def signed_thumbs(session: SessionFeedback) -> Reward | None:
    """As `latest`, with thumbs down -1: a dislike is a penalty, not merely no reward."""
    return _policy(session, down=-1.0)

"""One attempt's events in, its trajectory out: a pure function, shared by the live worker and replay.

Turns are the attempt's successful calls that carry token ids, in the order they were made. Turns
merge into one token sequence when each call's prompt extends the previous prompt plus completion
token for token (what a chat template does when the agent appends the model's answer and a tool
result); the tokens between are the environment's (mask 0), the completions the model's (mask 1).
A turn whose prompt does not extend the sequence starts a new one and counts as a mismatch (the
agent rewrote its history, or a template re-rendered earlier turns differently).

A retry is not a turn. When an agent's answer is lost (a 5xx, a reset connection, a gateway that
restarted after recording the call), its SDK sends the same request again, and the prompt repeats
an earlier call's token for token. The earlier answer is then superseded, counted in `superseded`
and kept in the lineage only, when the evidence says the agent never had it: nothing later extends
it, and either the repeat says it is a retry (`Call.retry_count`, from the SDK's headers) or a
later prompt extends the repeat's answer. An agent that asks the same twice on purpose and uses
both answers keeps both turns.

The trajectory is put together as `model_construct` would, not validated again: every part comes
from events that were validated when decoded, or is computed here from them (lists of their ints
and floats, counts), so validation would only copy the token lists. `tests/streams/test_assembly.py`
checks that validating a built trajectory gives it back unchanged, byte for byte. (`_made` does what
`model_construct` does for these models, without its general checks: a rebuild makes several models per
trajectory.)
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeVar

from pydantic import BaseModel

from agentstream.schemas.events import (
    Call,
    CallEvent,
    Event,
    RewardEvent,
    RewardRecord,
    RolloutDiffEvent,
    RolloutFailedEvent,
    RolloutQueued,
    RolloutQueuedEvent,
    RolloutTimedOutEvent,
    Sequence,
    Trajectory,
    TrajectoryEvent,
    Turn,
    token_versions,
)
from agentstream.schemas.ids import derived_id

M = TypeVar("M", bound=BaseModel)
_set = object.__setattr__
_REQUIRED = object()
"""in a model's template, where a value must be given"""
Shape = tuple[dict[str, Any], tuple[tuple[str, Callable[..., Any]], ...]]
"""a model's fields in order with their plain defaults, and the fields whose default a factory makes (called
with no arguments: pydantic's factories that take the validated data are not used by these models)"""
_SHAPES: dict[type, Shape] = {}


def _made(cls: type[M], **values: Any) -> M:
    """`cls.model_construct(**values)` for a model without aliases, extras or post-init: the given values in
    the fields' order, defaults for the others, the given ones as the fields set."""
    shape = _SHAPES.get(cls) or _shape(cls)
    fields = {**shape[0], **values}  # (the template's keys first: the fields' order)
    for name, factory in shape[1]:
        if name not in values:
            fields[name] = factory()
    model = cls.__new__(cls)
    _set(model, "__dict__", fields)
    _set(model, "__pydantic_fields_set__", set(values))
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


def _shape(cls: type[BaseModel]) -> Shape:
    fields = cls.__pydantic_fields__
    assert not cls.__pydantic_post_init__ and cls.model_config.get("extra") != "allow" and not any(
        f.alias or f.validation_alias for f in fields.values()), cls
    template = {name: _REQUIRED if f.is_required() or f.default_factory else f.get_default()
                for name, f in fields.items()}
    assert all(type(value) in (type(None), bool, int, float, str) or value is _REQUIRED
               for value in template.values()), cls  # shared by every model made: immutable only
    factories = tuple((name, f.default_factory) for name, f in fields.items() if f.default_factory)
    shape = _SHAPES[cls] = template, factories
    return shape


STATUS_OF = {"rollout.finished": "finished", "rollout.failed": "failed", "rollout.timed_out": "timed_out"}


def trajectory_id(rollout_id: str, attempt_id: str) -> str:
    return derived_id("trajectory", rollout_id, attempt_id)


@dataclass(frozen=True)
class Ending:
    """How the attempt ended, as the assembler decided it."""

    status: str
    """finished, failed, timed_out or abandoned"""
    finished_at: int
    """UTC ms: the terminal event's time, or when an abandoned attempt was given up on"""
    reward_expected: bool = False
    reason: str | None = None
    """why it ended, where the assembler knows better than the events (a session's conversation)"""


def build(rollout_id: str, attempt_id: str, events: Seq[Event], ending: Ending, source: str,
          session_id: str | None = None) -> TrajectoryEvent:
    """The trajectory of one attempt from its events, in whatever order they arrived.

    Events are taken once each, in the order of their time (then id): a worker reads the rollouts,
    calls and rewards topics side by side, so arrival order differs between runs, and the same
    events must always make the same trajectory.
    """
    events = sorted({e.id: e for e in events}.values(), key=_in_time)
    queued: RolloutQueued | None = None
    calls: list[CallEvent] = []
    for event in events:  # (one pass, by exact type: `isinstance` on a model class costs more)
        if type(event) is CallEvent:
            calls.append(event)
        elif type(event) is RolloutQueuedEvent and queued is None:
            queued = event.data
    calls.sort(key=_in_call_order)
    answered = [call for call in calls if _is_turn(call.data)]
    turns = [_turn(call.id, call.data) for call in answered]
    lost = superseded(turns, [call.data.retry_count or 0 for call in answered]) if len(turns) > 1 else set()
    if lost:
        turns = [turn for index, turn in enumerate(turns) if index not in lost]
    sequences, mismatches = merge(turns)
    data = _made(Trajectory,
        model=(queued.model if queued else None) or (calls[0].data.model if calls else None),
        status=ending.status,
        end_reason=end_reason(events, ending),
        turns=turns,
        sequences=sequences,
        merged=len(sequences) == 1,
        merge_mismatches=mismatches,
        superseded=len(lost),
        finished_at=ending.finished_at,
        **_rewarded(events, turns, ending),
        **(_task_fields(queued) if queued else {}),
        **({"session_id": session_id} if session_id is not None else {}),
        tenant=_tenant(calls),
    )
    return _made(TrajectoryEvent, id=trajectory_id(rollout_id, attempt_id), time=ending.finished_at,
                                           source=source, rollout_id=rollout_id, attempt_id=attempt_id, data=data)


def _tenant(calls: list[CallEvent]) -> str | None:
    """The tenant whose adapter the trajectory trains: its calls' (an operator's call in a tenant's conversation
    names none and joins it), the first's in call order if two tenants' calls ever met in one attempt (only an
    operator's rollout could mix them); None for calls of no tenant."""
    return next((call.data.tenant for call in calls if call.data.tenant is not None), None)


def with_reward(trajectory: TrajectoryEvent, events: Seq[Event], reward: RewardEvent,
                ending: Ending) -> TrajectoryEvent:
    """What `build` makes of `[*events, reward]`, from the trajectory it made of `events` (whose turns it
    takes over): a reward changes only the fields `_rewarded` fills, so the turns and sequences are not
    made again (an attempt scored by a reward function, every one in a rescoring rebuild)."""
    events = sorted({e.id: e for e in [*events, reward]}.values(), key=_in_time)
    data = trajectory.data
    for turn in data.turns:
        turn.reward = None  # as `_turn` makes them: `_rewarded` applies every reward again, in order
    fields = {name: value for name, value in data.__dict__.items() if name in data.__pydantic_fields_set__}
    fields.update(_rewarded(events, data.turns, ending))
    envelope = {name: value for name, value in trajectory.__dict__.items()
                if name in trajectory.__pydantic_fields_set__}  # (the fields `build` set, as it set them)
    return _made(TrajectoryEvent, **{**envelope, "data": _made(Trajectory, **fields)})


def revision_id(trajectory_id: str, reward_id: str) -> str:
    """A revision's id: the conversation's first trajectory and the reward that changed it."""
    return derived_id("trajectory.revision", trajectory_id, reward_id)


def revised(trajectory: TrajectoryEvent, events: Seq[Event], reward: RewardEvent, ending: Ending) -> TrajectoryEvent:
    """The trajectory `build` made of `events`, published again with `reward` (feedback later than it): a new id
    derived from both, the time of the reward, and `revision_of` naming the trajectory it replaces."""
    rewarded = with_reward(trajectory, events, reward, ending)
    fields = {name: value for name, value in rewarded.data.__dict__.items()
              if name in rewarded.data.__pydantic_fields_set__}
    envelope = {name: value for name, value in rewarded.__dict__.items() if name in rewarded.__pydantic_fields_set__}
    return _made(TrajectoryEvent, **{**envelope, "id": revision_id(trajectory.id, reward.id), "time": reward.time,
                                     "data": _made(Trajectory, **fields, revision_of=trajectory.id)})


def _rewarded(events: list[Event], turns: list[Turn], ending: Ending) -> dict[str, Any]:
    """The trajectory's fields that reward events change: its rewards (final and per turn) and lineage,
    and its start (a reward may come first), from the events in time order."""
    rewards = [_reward_record(e) for e in events if type(e) is RewardEvent]
    if rewards:
        _apply_turn_rewards(turns, rewards)
    reward = rewards[-1].value if rewards else None
    started_at = events[0].time if events else None
    return dict(reward=reward, reward_missing=reward is None and ending.reward_expected, rewards=rewards,
                started_at=started_at, lineage=[e.id for e in events],
                duration_ms=ending.finished_at - started_at if started_at is not None else None)


_in_time = attrgetter("time", "id")


def _in_call_order(call: CallEvent) -> tuple[int, str]:
    return call.data.started_at, call.id


def end_reason(events: Seq[Event], ending: Ending) -> str | None:
    """Why the attempt ended: a timeout, a failure's error (with the last line the agent wrote to stderr,
    where a crash's exception is), the outcome a coding agent reported with its diff, or abandonment."""
    if ending.reason is not None:
        return ending.reason
    for event in reversed(events):  # (by exact type, as in `build`)
        if type(event) is RolloutTimedOutEvent:
            return f"timed out after {event.data.timeout_s:g} s"
        if type(event) is RolloutFailedEvent:
            last = next((line for line in reversed(event.data.stderr_tail.splitlines()) if line.strip()), "")
            return f"{event.data.error}: {last.strip()[:300]}" if last else event.data.error
        if type(event) is RolloutDiffEvent and ending.status == "finished":
            return event.data.outcome
    return "abandoned: no ending was recorded" if ending.status == "abandoned" else None


def _task_fields(queued: RolloutQueued) -> dict[str, Any]:
    return dict(task_id=queued.task.id, group_id=queued.group_id, split=queued.split, epoch=queued.epoch,
                sample_index=queued.sample_index, attempt_number=queued.attempt_number,
                weight_version_launch=queued.weight_version)


def _is_turn(call: Call) -> bool:
    return call.status == 200 and bool(call.completion_token_ids) and call.prompt_token_ids is not None


def _turn(call_id: str, call: Call) -> Turn:
    ids = call.completion_token_ids or []
    recorded = call.logprobs is not None and len(call.logprobs) == len(ids)
    # placeholders where none were recorded, marked: read as logprobs they would say probability 1
    missing = {} if recorded else {"logprobs_missing": True}
    temperature = call.request.get("temperature")
    sampled = {"temperature": float(temperature)} if isinstance(temperature, (int, float)) \
        and not isinstance(temperature, bool) else {}
    segments = {"weight_segments": call.weight_segments} if call.weight_segments else {}
    return _made(Turn, call_id=call_id, sequence=0, prompt_token_ids=call.prompt_token_ids or [],
                                completion_token_ids=ids, logprobs=call.logprobs if recorded else [0.0] * len(ids),
                                weight_version=call.weight_version, finish_reason=call.finish_reason,
                                latency_ms=call.latency_ms, **missing, **sampled, **segments)


def superseded(turns: list[Turn], retry_counts: list[int]) -> set[int]:
    """Indices of the turns whose answer the agent lost and asked again for (see the module's docstring)."""
    by_prompt: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for index, turn in enumerate(turns):  # same length and tail first: full comparisons only for likely repeats
        by_prompt.setdefault((len(turn.prompt_token_ids), tuple(turn.prompt_token_ids[-16:])), []).append(index)
    lost: set[int] = set()
    for indices in by_prompt.values():
        kept: list[int] = []
        for index in indices:
            earlier = next((j for j in reversed(kept) if turns[j].prompt_token_ids == turns[index].prompt_token_ids),
                           None)
            if earlier is not None and not _used(turns, earlier) and (
                    retry_counts[index] > 0 or _used(turns, index)):
                lost.add(earlier)
                kept.remove(earlier)
            kept.append(index)
    return lost


def _used(turns: list[Turn], index: int) -> bool:
    """Whether a later turn's prompt extends this turn's prompt and answer, token for token."""
    answer = turns[index].prompt_token_ids + turns[index].completion_token_ids
    return any(later.prompt_token_ids[: len(answer)] == answer for later in turns[index + 1:])


def merge(turns: list[Turn]) -> tuple[list[Sequence], int]:
    """Token sequences for training, and how many turns did not extend the sequence before them."""
    built: list[dict[str, list[Any]]] = []  # each sequence's lists, made into a `Sequence` once complete
    prompt_lengths: list[int] = []
    mismatches = 0
    for index, turn in enumerate(turns):
        current = built[-1] if built else None
        prompt = turn.prompt_token_ids
        if current is not None and prompt[: len(current["token_ids"])] == current["token_ids"]:
            added = prompt[len(current["token_ids"]):]
        else:
            mismatches += current is not None
            current = {"token_ids": [], "mask": [], "logprobs": [], "weight_versions": [], "turns": []}
            built.append(current)
            prompt_lengths.append(len(prompt))
            added = prompt
        completion, between = turn.completion_token_ids, len(added)
        current["token_ids"] += added
        turn.completion_start = len(current["token_ids"])
        current["token_ids"] += completion
        current["mask"] += [0] * between
        current["mask"] += [1] * len(completion)
        current["logprobs"] += [0.0] * between
        current["logprobs"] += turn.logprobs
        current["weight_versions"] += [None] * between
        current["weight_versions"] += token_versions(turn.weight_version, turn.weight_segments, len(completion))
        current["turns"].append(index)
        turn.sequence = len(built) - 1
    sequences = [_made(Sequence, prompt_length=length, **lists) for lists, length in zip(built, prompt_lengths)]
    return sequences, mismatches


def _reward_record(event: RewardEvent) -> RewardRecord:
    return _made(RewardRecord, event_id=event.id, value=event.data.value, reward_fn=event.data.reward_fn,
                                        turns=event.data.turns)


def _apply_turn_rewards(turns: list[Turn], rewards: list[RewardRecord]) -> None:
    """Per-turn rewards, named by call id or position; a later reward overrides an earlier one."""
    by_call = {turn.call_id: turn for turn in turns}
    for record in rewards:
        for given in record.turns:
            turn = by_call.get(given.call_id) if given.call_id else None
            if turn is None and given.turn is not None and 0 <= given.turn < len(turns):
                turn = turns[given.turn]
            if turn is not None:
                turn.reward = given.value

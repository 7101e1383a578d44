"""Reward functions: a task names one (`module:function`), the assembler scores the trajectory with it.

A reward function takes a `Sample` (the task, the trajectory, its calls, and the final answer as
text) and returns a float, or a `Reward` for per-turn rewards and details. Its result is published
as a `reward` event naming the function, so it is in the log like any other reward: replay can
recompute history with another function without rerunning an agent. Adding one is a few lines:

    def contains_answer(sample: Sample) -> float:
        return float(str(sample.task.metadata["answer"]) in sample.answer)

Only finished attempts are scored; failed, timed-out and abandoned ones get no computed reward.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from agentstream.schemas.errors import ConfigurationError
from agentstream.schemas.events import Call, Event, Reward, RolloutDiff, RolloutDiffEvent, Task, Trajectory


@dataclass(frozen=True)
class Sample:
    task: Task
    trajectory: Trajectory
    """the attempt's trajectory as built so far (read it, do not change it: the scored one is made from it)"""
    calls: list[Call]
    """the calls of the trajectory's turns (successful, with tokens), in the order they were made"""
    events: Sequence[Event] = ()
    """every event of the attempt (lifecycle, calls, rewards, its diff), as the assembly recorded them"""

    @property
    def diff(self) -> RolloutDiff | None:
        """The attempt's final diff (coding agents post one as a `rollout.diff` event), the last if several."""
        diffs = [e.data for e in sorted(self.events, key=lambda e: (e.time, e.id)) if isinstance(e, RolloutDiffEvent)]
        return diffs[-1] if diffs else None

    @property
    def answer(self) -> str:
        """The text of the model's last answer (any of the four APIs)."""
        return answer_text(self.calls[-1]) if self.calls else ""

    def expected(self, key: str = "answer") -> Any:
        if key not in self.task.metadata:
            raise RewardError(f"task {self.task.id!r} has no metadata[{key!r}] to compare with")
        return self.task.metadata[key]


class RewardError(ConfigurationError):
    """The reward function cannot score this sample (bad name, missing metadata, bad result)."""


Loaded = Callable[..., object]
"""a function loaded by name: what it takes and returns is checked when it runs (`score`)"""


@cache
def load(name: str) -> Loaded:
    """The function `module:function` names (a reward function, or a reward policy); RewardError says what is
    wrong with the name."""
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise RewardError(f"reward function {name!r}: write it as module:function (e.g. streams.rewards:exact_match)")
    try:
        module = importlib.import_module(_installed_name(module_name))
    except ImportError as exc:
        raise RewardError(f"reward function {name!r}: cannot import {module_name!r} ({exc})") from None
    function: object = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(f"reward function {name!r}: {module_name} has no function {function_name!r}")
    return function


# The built-in functions' names as events and tasks carry them: they predate the one `agentstream` package
# and stay valid (a name is part of a reward's id, so it cannot change).
_BUILTIN_PACKAGES = frozenset({"streams", "recipes"})


def _installed_name(module_name: str) -> str:
    """`streams.rewards` is `agentstream.streams.rewards`; any other module is imported as named."""
    top = module_name.partition(".")[0]
    return f"agentstream.{module_name}" if top in _BUILTIN_PACKAGES else module_name


def score(name: str, sample: Sample) -> Reward:
    """Run the named function; a float becomes a Reward. Any failure is a RewardError naming the function."""
    function = load(name)
    try:
        result = function(sample)
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(f"reward function {name} failed: {type(exc).__name__}: {exc}") from exc
    # a function's own Reward is copied to name it (the function may hand out one it keeps); a float is made one
    reward = result.model_copy(update={"reward_fn": name}) if isinstance(result, Reward) else _as_reward(name, result)
    if not math.isfinite(reward.value):
        raise RewardError(f"reward function {name} returned {reward.value}, not a finite number")
    return reward


def _as_reward(name: str, value: object) -> Reward:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"reward function {name} returned {type(value).__name__}; return a float or a Reward")
    return Reward(value=float(value), reward_fn=name)


def answer_text(call: Call) -> str:
    """The text a response carried: chat and completions choices, Responses output, Messages content."""
    response = call.response or {}
    choices = response.get("choices")
    if choices:
        first = choices[0]
        return (first.get("message") or {}).get("content") or first.get("text") or ""
    if isinstance(response.get("output"), list):  # OpenAI Responses
        return "".join(part.get("text", "") for item in response["output"] if item.get("type") == "message"
                       for part in item.get("content") or [] if part.get("type") == "output_text")
    if isinstance(response.get("content"), list):  # Anthropic Messages
        return "".join(block.get("text", "") for block in response["content"] if block.get("type") == "text")
    return ""


# --- general reward functions ---------------------------------------------------------------


def exact_match(sample: Sample) -> float:
    """1 if the answer equals metadata["answer"] (surrounding whitespace and case ignored), else 0."""
    return float(sample.answer.strip().casefold() == str(sample.expected()).strip().casefold())


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def numeric_answer(sample: Sample) -> float:
    """1 if the last number in the answer equals metadata["answer"] (within metadata["tolerance"], default 1e-6)."""
    numbers = _NUMBER.findall(sample.answer)
    if not numbers:
        return 0.0
    expected = float(str(sample.expected()).replace(",", ""))
    tolerance = float(sample.task.metadata.get("tolerance", 1e-6))
    return float(abs(float(numbers[-1].replace(",", "")) - expected) <= tolerance)


def regex_match(sample: Sample) -> float:
    """1 if metadata["pattern"] (a regular expression) matches somewhere in the answer, else 0."""
    try:
        pattern = re.compile(str(sample.expected("pattern")))
    except re.error as exc:
        raise RewardError(f"task {sample.task.id!r}: metadata['pattern'] is not a regular expression: {exc}") from None
    return float(pattern.search(sample.answer) is not None)


def character_share(sample: Sample) -> float:
    """The share of the answer's characters that are in metadata["characters"] (0 for an empty answer).

    A dense reward that a tiny model can climb in minutes: the demo asks for digits.
    """
    allowed = set(str(sample.expected("characters")))
    answer = sample.answer
    return sum(ch in allowed for ch in answer) / len(answer) if answer else 0.0


_WORD = re.compile(r"[^\W_]+(?:['’-][^\W_]+)*")


def word_count(sample: Sample) -> float:
    """1 if the answer has exactly metadata["words"] words (default 1; punctuation around them is
    allowed), else 0. The SmolLM2 demo: an instruct model that likes whole sentences learns to
    answer a question in one word."""
    expected = int(sample.task.metadata.get("words", 1))
    return float(len(_WORD.findall(sample.answer)) == expected)

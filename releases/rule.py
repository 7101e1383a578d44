"""The canary rule: guards on errors and latency, then an always-valid test on mean reward per session.

Deterministic: the same numbers give the same decision. The test is a confidence sequence on the canary's
lift in mean reward (`releases/sequential.py`): bounds that hold at every look at once with chance
1 - alpha, however often the judge looks. The lower bound above 0 promotes; the upper bound below
`min_lift` rolls back (the canary is known not to be that much better; at 0, known worse).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from agentstream.releases.sequential import Bounds, Lift, Moments, p_value
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.events import ArmNumbers


@dataclass
class Arm:
    """What one version did in a canary: a reward per session, and its calls."""

    version: int
    rewards: dict[str, float] = field(default_factory=dict)
    """session id -> its reward (the mean over its conversations'); change it by `rate`, which keeps the sums"""
    calls: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    _shift: float = field(default=0.0, init=False, repr=False)
    """the sums are of reward - the first reward: no cancellation when rewards are large and alike"""
    _sum: float = field(default=0.0, init=False, repr=False)
    _squares: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rewards:
            self._shift = next(iter(self.rewards.values()))
        for value in self.rewards.values():
            self._add(value, 1)

    def rate(self, session: str, reward: float) -> None:
        """Set a session's reward (a later one replaces its earlier)."""
        if not self.rewards:
            self._shift = reward
        if session in self.rewards:
            self._add(self.rewards[session], -1)
        self.rewards[session] = reward
        self._add(reward, 1)

    def _add(self, value: float, sign: int) -> None:
        self._sum += sign * (value - self._shift)
        self._squares += sign * (value - self._shift) ** 2

    def moments(self) -> Moments:
        n = len(self.rewards)
        if not n:
            return Moments(0, 0.0, 0.0)
        return Moments(n, self._shift + self._sum / n, max(self._squares - self._sum ** 2 / n, 0.0))

    def numbers(self) -> ArmNumbers:
        moments = self.moments()
        return ArmNumbers(version=self.version, sessions=moments.n, mean_reward=moments.mean if moments.n else None,
                          reward_std=math.sqrt(moments.squares / (moments.n - 1)) if moments.n > 1 else None,
                          calls=self.calls, errors=self.errors, p95_latency_ms=p95(self.latencies_ms))

    @property
    def error_rate(self) -> float:
        return self.errors / self.calls if self.calls else 0.0


@dataclass(frozen=True)
class Verdict:
    action: Literal["promote", "rollback"] | None
    """None: keep measuring"""
    reason: str
    p_value: float | None = None
    numbers: dict[str, float] = field(default_factory=dict)


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def decide(stable: Arm, canary: Arm, settings: ReleasesSettings) -> Verdict:
    numbers: dict[str, float] = {"alpha": settings.alpha, "min_sessions": settings.min_sessions,
                                 "detectable_lift": settings.lift, "min_lift": settings.min_lift,
                                 "max_error_rate_increase": settings.max_error_rate_increase,
                                 "max_latency_ratio": settings.max_latency_ratio}
    guard = guards(stable, canary, settings, numbers)
    if guard is not None:
        return guard
    n = min(len(stable.rewards), len(canary.rewards))
    if n < settings.min_sessions:
        return Verdict(None, f"waiting for {settings.min_sessions} sessions with a reward per arm (have {n})",
                       numbers=numbers)
    lift = Lift.of(stable.moments(), canary.moments())
    bounds = Bounds.of(lift, settings.lift, settings.alpha)
    p = p_value(lift.difference * lift.information, lift.information, settings.lift)
    numbers.update(lift=lift.difference, lift_lower=bounds.lower, lift_upper=bounds.upper, power=bounds.power)
    interval = f"lift {lift.difference:+.3f}, in [{bounds.lower:+.3f}, {bounds.upper:+.3f}] (each bound valid at every look)"
    if bounds.lower > 0:
        return Verdict("promote", f"mean reward higher: {interval} (always-valid p={p:.3g})", p, numbers)
    if bounds.upper < settings.min_lift:
        known = "lower" if settings.min_lift == 0 else f"not {settings.min_lift:g} higher"
        return Verdict("rollback", f"mean reward {known}: {interval}", p, numbers)
    if settings.max_sessions and n >= settings.max_sessions:
        return Verdict("rollback", f"not better after {n} sessions per arm: {interval}", p, numbers)
    return Verdict(None, f"no decision yet: {interval}; power {bounds.power:.0%} at a lift of {settings.lift:g}",
                   p, numbers)


def guards(stable: Arm, canary: Arm, settings: ReleasesSettings, numbers: dict[str, float]) -> Verdict | None:
    """A rollback for errors or latency, once each arm has `min_calls` calls."""
    if min(stable.calls, canary.calls) < settings.min_calls:
        return None
    increase = canary.error_rate - stable.error_rate
    numbers["error_rate_increase"] = increase
    if increase > settings.max_error_rate_increase:
        return Verdict("rollback", f"error rate {canary.error_rate:.1%} against {stable.error_rate:.1%}: "
                       f"above the allowed increase of {settings.max_error_rate_increase:.1%}", numbers=numbers)
    slow, fast = p95(canary.latencies_ms), p95(stable.latencies_ms)
    if slow is not None and fast:
        numbers["latency_ratio"] = slow / fast
        if slow > fast * settings.max_latency_ratio:
            return Verdict("rollback", f"p95 latency {slow:.0f} ms against {fast:.0f} ms: above "
                           f"{settings.max_latency_ratio}x", numbers=numbers)
    return None

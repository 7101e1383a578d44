"""The canary rule: guards on errors and latency, then a one-sided test on mean reward per session.

Deterministic: the same numbers give the same decision. The test is Welch's, with the normal
approximation (each arm has at least `min_sessions` sessions): z = (mean_canary - mean_stable) /
sqrt(var_canary/n_canary + var_stable/n_stable); p = P(Z >= z), the chance of a lead this large if the
canary were no better. p < alpha promotes; the mirror test (the canary worse at the same level) rolls back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import fmean, stdev
from typing import Literal

from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.events import ArmNumbers


@dataclass
class Arm:
    """What one version did in a canary: a reward per session, and its calls."""

    version: int
    rewards: dict[str, float] = field(default_factory=dict)
    """session id -> its reward (the mean over its conversations')"""
    calls: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def numbers(self) -> ArmNumbers:
        values = list(self.rewards.values())
        return ArmNumbers(version=self.version, sessions=len(values), mean_reward=fmean(values) if values else None,
                          reward_std=stdev(values) if len(values) > 1 else None, calls=self.calls,
                          errors=self.errors, p95_latency_ms=p95(self.latencies_ms))

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


def one_sided_p(canary: list[float], stable: list[float]) -> tuple[float, float]:
    """(z, P(Z >= z)): the canary's lead in mean, in standard errors, and how likely it is by chance."""
    difference = fmean(canary) - fmean(stable)
    error = math.sqrt(_variance(canary) / len(canary) + _variance(stable) / len(stable))
    if error == 0:  # every reward the same within each arm: the means differ or they do not
        return (math.copysign(math.inf, difference) if difference else 0.0), (0.0 if difference > 0 else
                                                                              1.0 if difference < 0 else 0.5)
    z = difference / error
    return z, upper_tail(z)


def upper_tail(z: float) -> float:
    """P(Z >= z) for a standard normal Z, by erfc: exact far in the tail, where 1 - cdf(z) rounds to 0."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def _variance(values: list[float]) -> float:
    return stdev(values) ** 2 if len(values) > 1 else 0.0


def decide(stable: Arm, canary: Arm, settings: ReleasesSettings) -> Verdict:
    numbers: dict[str, float] = {"alpha": settings.alpha, "min_sessions": settings.min_sessions,
                                 "max_error_rate_increase": settings.max_error_rate_increase,
                                 "max_latency_ratio": settings.max_latency_ratio}
    if min(stable.calls, canary.calls) >= settings.min_calls:
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
    n = min(len(stable.rewards), len(canary.rewards))
    if n < settings.min_sessions:
        return Verdict(None, f"waiting for {settings.min_sessions} sessions with a reward per arm (have {n})",
                       numbers=numbers)
    z, p = one_sided_p(list(canary.rewards.values()), list(stable.rewards.values()))
    if math.isfinite(z):
        numbers["z"] = z
    if p < settings.alpha:
        return Verdict("promote", f"mean reward higher (one-sided p={p:.4g} < {settings.alpha})", p, numbers)
    worse = upper_tail(-z)
    if worse < settings.alpha:
        return Verdict("rollback", f"mean reward lower (one-sided p={worse:.4g} < {settings.alpha})", p, numbers)
    if settings.max_sessions and n >= settings.max_sessions:
        return Verdict("rollback", f"not better after {n} sessions per arm (p={p:.4g})", p, numbers)
    return Verdict(None, f"no decision yet (p={p:.4g})", p, numbers)

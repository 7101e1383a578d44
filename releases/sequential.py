"""An always-valid test of a canary's lift: a normal-mixture confidence sequence on the difference of mean rewards.

The judge looks at the same canary every few seconds, as often as its numbers change, and stops at the first
look that decides. A fixed-horizon test (a z-test at alpha per look) is then wrong far more often than alpha.
This test is valid at every look at once (Robbins' normal mixture; Howard, Ramdas, McAuliffe & Sekhon,
"Time-uniform, nonparametric, nonasymptotic confidence sequences", 2021, with the variance estimated as in
Waudby-Smith, Arbour, Sinha, Kennedy & Ramdas, "Time-uniform central limit theory and asymptotic confidence
sequences", 2024):

    D = mean_canary - mean_stable,   I = 1 / (var_c / n_c + var_s / n_s)   (the information about the lift δ),
    S = (D - δ0) · I,   which drifts like (δ - δ0) · I and, for Gaussian rewards, is a Brownian motion in I
    (the difference of means has the "canonical joint distribution" at any split of the sessions).

Averaging the likelihood ratio exp(θ S - θ² I / 2) over a half-normal prior θ ~ |N(0, scale²)| gives

    Λ(S, I) = 2 / sqrt(1 + scale² I) · exp(scale² S² / (2 (1 + scale² I))) · Φ(scale S / sqrt(1 + scale² I)),

a nonnegative supermartingale when δ <= δ0, so by Ville's inequality Λ reaches 1/alpha at some look with
chance at most alpha, however many looks there are. 1/Λ is an always-valid p-value. `scale` is the lift the
test is tuned to find; the variances are the data's (asymptotically valid for any rewards with a variance,
bounded or binary included), each arm's at least the pooled one: a small arm whose few rewards happen to be
all alike does not look certain (the fixed-horizon test's zero-variance blow-up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True)
class Moments:
    """One arm's rewards, summed: all the test needs."""

    n: int
    mean: float
    squares: float
    """sum of squared deviations from the mean"""


@dataclass(frozen=True)
class Lift:
    """What the two arms say about the canary's lift in mean reward."""

    difference: float
    """mean canary - mean stable"""
    information: float
    """1 / the variance of `difference`"""

    @classmethod
    def of(cls, stable: Moments, canary: Moments) -> Lift:
        pooled = (stable.squares + canary.squares) / max(stable.n + canary.n - 2, 1)
        variance = sum(max(arm.squares / (arm.n - 1) if arm.n > 1 else 0.0, pooled) / arm.n for arm in (stable, canary))
        # rewards all equal in both arms: no noise, the means differ or they do not (a variance, not a division by 0)
        return cls(canary.mean - stable.mean, 1 / max(variance, 1e-300))


def log_evidence(s: float, information: float, scale: float) -> float:
    """log Λ(S, I): the evidence that the lift is above δ0 when S = (D - δ0) I (module docstring)."""
    spread = 1 + scale * scale * information
    x = scale * s / math.sqrt(spread)
    return math.log(2) - 0.5 * math.log(spread) + x * x / 2 + _log_normal_cdf(x)


def _log_normal_cdf(x: float) -> float:
    if x > -30:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2)))
    return -x * x / 2 - math.log(-x) - LOG_SQRT_2PI  # Φ(x) ~ φ(x)/|x| where erfc underflows


def p_value(s: float, information: float, scale: float) -> float:
    """1/Λ, at most 1: below alpha at some look with chance at most alpha when the lift is at most δ0."""
    return min(1.0, math.exp(-log_evidence(s, information, scale)))


def threshold(information: float, scale: float, alpha: float) -> float:
    """The S at which Λ reaches 1/alpha: the bound on (D - δ0) I of a one-sided level-alpha test at this look.

    Newton from the two-sided mixture's closed form, which lies above it: log Λ is convex and increasing in S."""
    spread = 1 + scale * scale * information
    target = math.log(1 / alpha)
    s = math.sqrt(spread * (2 * target + math.log(spread))) / scale
    for _ in range(50):
        excess = log_evidence(s, information, scale) - target
        if excess < 1e-9:
            break
        x = scale * s / math.sqrt(spread)
        mills = math.exp(-x * x / 2 - LOG_SQRT_2PI - _log_normal_cdf(x))
        s -= excess / (scale / math.sqrt(spread) * (x + mills))
    return s


@dataclass(frozen=True)
class Bounds:
    """The confidence sequence at this look: each bound holds at every look at once with chance 1 - alpha."""

    lower: float
    upper: float
    power: float
    """the chance these numbers would clear the lower bound above 0 if the lift were `scale` (at this look alone:
    the chance to have promoted by now is at least that)"""

    @classmethod
    def of(cls, lift: Lift, scale: float, alpha: float) -> Bounds:
        margin = threshold(lift.information, scale, alpha) / lift.information
        root = math.sqrt(lift.information)
        power = 0.5 * math.erfc(-(scale - margin) * root / math.sqrt(2))
        return cls(lift.difference - margin, lift.difference + margin, power)

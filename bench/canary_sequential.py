"""How often the canary rule decides wrong at the judge's real cadence: thousands of simulated canaries, each
replayed through the shipped `releases.rule.decide`, against the fixed-horizon Welch rule it replaced.

    uv run python -m bench.canary_sequential [--canaries 2000] [--sessions 3000] [--every 10] [--share 0.1]

A canary's sessions arrive one by one; each is on the canary with chance `--share` (as the hash buckets put it)
and has a reward drawn from its arm's distribution. The judge looks every `--every` sessions (its `interval_s`,
whenever numbers changed) and the canary ends at the first decision, or undecided after `--sessions`. Per
setting: A/A (both arms alike: every promotion is false, and so is a rollback, which says "worse") and A/B (the
canary 10 points better: promotions are the power, rollbacks false). The rules run at their defaults
(`ReleasesSettings()`: alpha 0.05, 30 sessions per arm first, no maximum). The intervals are Wilson's, 95 %.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from agentstream.releases.rule import Arm, Verdict, decide
from agentstream.releases.settings import ReleasesSettings
from bench.report import RESULTS

Draw = Callable[[random.Random], float]
Rule = Callable[[Arm, Arm, ReleasesSettings], Verdict]


def bernoulli(p: float) -> Draw:
    return lambda rng: float(rng.random() < p)


def beta(mean: float, concentration: float = 2.0) -> Draw:
    """Bounded, not binary: a user's score in [0, 1], spread wide (sd 0.28 at mean 0.6)."""
    return lambda rng: rng.betavariate(mean * concentration, (1 - mean) * concentration)


SETTINGS: dict[str, tuple[Callable[[float], Draw], float, float]] = {
    # name: (distribution of a mean, stable mean, canary mean)
    "binary 0.6, A/A": (bernoulli, 0.6, 0.6),
    "binary 0.6 → 0.7": (bernoulli, 0.6, 0.7),
    "binary 0.6 → 0.65": (bernoulli, 0.6, 0.65),
    "bounded 0.6, A/A": (beta, 0.6, 0.6),
    "bounded 0.6 → 0.7": (beta, 0.6, 0.7),
    "thumbs 0.9, A/A": (bernoulli, 0.9, 0.9),
    "thumbs 0.8 → 0.9": (bernoulli, 0.8, 0.9),
}


def welch(stable: Arm, canary: Arm, settings: ReleasesSettings) -> Verdict:
    """The rule before #44 (releases/rule.py at ec826ef), its test part: a one-sided z-test at alpha at every look,
    each arm's own variance, the mirror test for a rollback."""
    n = min(len(stable.rewards), len(canary.rewards))
    if n < settings.min_sessions:
        return Verdict(None, "waiting")
    c, s = canary.moments(), stable.moments()
    difference = c.mean - s.mean
    error = math.sqrt(c.squares / (c.n - 1) / c.n + s.squares / (s.n - 1) / s.n)
    z = (math.copysign(math.inf, difference) if difference else 0.0) if error == 0 else difference / error
    if 0.5 * math.erfc(z / math.sqrt(2)) < settings.alpha:
        return Verdict("promote", "higher")
    if 0.5 * math.erfc(-z / math.sqrt(2)) < settings.alpha:
        return Verdict("rollback", "lower")
    return Verdict(None, "no decision yet")


RULES: dict[str, Rule] = {"sequential (shipped)": decide, "Welch per look (before)": welch}


@dataclass(frozen=True)
class Run:
    setting: str
    rule: str
    seed: int
    sessions: int
    every: int
    share: float


def canary(run: Run) -> tuple[str | None, int]:
    """One simulated canary: its decision (None: undecided) and the sessions it took."""
    family, stable_mean, canary_mean = SETTINGS[run.setting]
    draws = {False: family(stable_mean), True: family(canary_mean)}
    rng = random.Random(run.seed)
    settings = ReleasesSettings()
    rule = RULES[run.rule]
    arms = {False: Arm(1), True: Arm(2)}
    for session in range(1, run.sessions + 1):
        on_canary = rng.random() < run.share
        arms[on_canary].rate(f"s{session}", draws[on_canary](rng))
        if session % run.every == 0:
            verdict = rule(arms[False], arms[True], settings)
            if verdict.action is not None:
                return verdict.action, session
    return None, run.sessions


def batch(runs: list[Run]) -> list[tuple[str | None, int]]:
    return [canary(run) for run in runs]


def wilson(hits: int, n: int) -> tuple[float, float]:
    if not n:
        return 0.0, 1.0
    z, share = 1.96, hits / n
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--canaries", type=int, default=2000, help="simulated canaries per setting and rule")
    parser.add_argument("--sessions", type=int, default=3000, help="sessions of a canary at most (both arms)")
    parser.add_argument("--every", type=int, default=10, help="sessions between two looks of the judge")
    parser.add_argument("--share", type=float, default=0.1, help="the canary's share of the sessions")
    parser.add_argument("--workers", type=int, default=2, help="processes")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    chunk = 100
    table = Table(title="bench: canary_sequential", caption=(
        f"{args.canaries} canaries per row, {args.share:.0%} canary share, a look every {args.every} sessions, up to "
        f"{args.sessions}; A/A: every decision is wrong; A/B: promoted is the power; 95 % Wilson intervals"))
    for column in ("setting", "rule", "promoted", "rolled back", "decided", "median sessions to a decision"):
        table.add_column(column)
    rows = []
    with ProcessPoolExecutor(args.workers) as pool:
        jobs = {(setting, rule): [pool.submit(batch, [Run(setting, rule, seed, args.sessions, args.every, args.share)
                                                       for seed in range(first, min(first + chunk, args.canaries))])
                                  for first in range(0, args.canaries, chunk)]
                for setting in SETTINGS for rule in RULES}
        for (setting, rule), futures in jobs.items():
            row = summarise([outcome for future in futures for outcome in future.result()])
            rows.append({"setting": setting, "rule": rule, **row})
            table.add_row(setting, rule, *(f"{row[key]:.1%} [{row[key + '_low']:.1%}, {row[key + '_high']:.1%}]"
                                           for key in ("promoted", "rolled_back")),
                          f"{row['decided']:.0%}", str(row.get("median_sessions", "")))
    Console(width=160).print(table)
    print(f"{time.perf_counter() - started:.0f} s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "canary_sequential.json").write_text(json.dumps({"arguments": vars(args), "rows": rows}, indent=1))


def summarise(outcomes: list[tuple[str | None, int]]) -> dict[str, float]:
    n = len(outcomes)
    row: dict[str, float] = {"canaries": n}
    for action, key in (("promote", "promoted"), ("rollback", "rolled_back")):
        hits = sum(1 for decision, _ in outcomes if decision == action)
        row[key] = hits / n
        row[key + "_low"], row[key + "_high"] = wilson(hits, n)
    decided = sorted(sessions for decision, sessions in outcomes if decision is not None)
    row["decided"] = len(decided) / n
    if decided:
        row["median_sessions"] = decided[len(decided) // 2]
    return row


if __name__ == "__main__":
    main()

"""Windowed analytics, as mergeable aggregates: counts, sums and latency histograms.

An aggregate is a plain dict of numbers, so it can live in a table (`windows.py`), travel in a `metrics`
event, and be merged with others: the worker keeps one per (window, model, weight version,
partition), and whoever reads them (the web view, `agentstream top`, SQL over the metrics topic)
sums the partitions. Percentiles come from the merged histogram, so they are exact to a bucket
(buckets grow by a quarter: an estimate is within 25 % of the true latency).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from agentstream.schemas.events import Call, Trajectory

BUCKET_BASE_MS = 0.5
BUCKET_GROWTH = 1.25
BUCKETS = 80
"""0.5 ms × 1.25^79 ≈ 20 minutes: anything slower lands in the last bucket"""
COUNTS = ("calls", "errors", "tokens_in", "tokens_out", "trajectories", "rewarded", "reward_sum", "reward_missing",
          "sessions", "sessions_unrewarded")
HISTOGRAMS = ("latency", "ttft")

Aggregate = dict[str, float]


def bucket_of(ms: float) -> int:
    if ms <= BUCKET_BASE_MS:
        return 0
    return min(BUCKETS - 1, math.ceil(math.log(ms / BUCKET_BASE_MS, BUCKET_GROWTH)))


def bucket_upper_ms(index: int) -> float:
    return BUCKET_BASE_MS * BUCKET_GROWTH ** index


def _observe(aggregate: Aggregate, histogram: str, ms: float | None) -> None:
    if ms is not None:
        key = f"{histogram}_b{bucket_of(ms)}"
        aggregate[key] = aggregate.get(key, 0) + 1


def add_call(aggregate: Aggregate, call: Call) -> Aggregate:
    out = dict(aggregate)
    out["calls"] = out.get("calls", 0) + 1
    out["errors"] = out.get("errors", 0) + (call.status >= 400)
    if call.usage is not None:
        out["tokens_in"] = out.get("tokens_in", 0) + call.usage.prompt_tokens
        out["tokens_out"] = out.get("tokens_out", 0) + call.usage.completion_tokens
    _observe(out, "latency", call.latency_ms)
    _observe(out, "ttft", call.ttft_ms)
    return out


def add_trajectory(aggregate: Aggregate, trajectory: Trajectory) -> Aggregate:
    out = dict(aggregate)
    if trajectory.revision_of is not None:  # a conversation counted when first published, its reward since revised
        out["revisions"] = out.get("revisions", 0) + 1
        return out
    out["trajectories"] = out.get("trajectories", 0) + 1
    if trajectory.reward is not None:
        out["rewarded"] = out.get("rewarded", 0) + 1
        out["reward_sum"] = out.get("reward_sum", 0) + trajectory.reward
    out["reward_missing"] = out.get("reward_missing", 0) + trajectory.reward_missing
    if trajectory.session_id is not None:  # production traffic: its conversations, and those nobody rated in time
        out["sessions"] = out.get("sessions", 0) + 1
        out["sessions_unrewarded"] = out.get("sessions_unrewarded", 0) + trajectory.reward_missing
    return out


def merge(aggregates: Iterable[Mapping[str, float]]) -> Aggregate:
    out: Aggregate = {}
    for aggregate in aggregates:
        for key, value in aggregate.items():
            out[key] = out.get(key, 0) + value
    return out


def percentile(aggregate: Mapping[str, float], histogram: str, q: float) -> float | None:
    counts = sorted((int(key.rpartition("_b")[2]), n) for key, n in aggregate.items()
                    if key.startswith(f"{histogram}_b"))
    total = sum(n for _, n in counts)
    if not total:
        return None
    rank, seen = q * total, 0.0
    for index, n in counts:
        seen += n
        if seen >= rank:
            return round(bucket_upper_ms(index), 3)
    return round(bucket_upper_ms(counts[-1][0]), 3)


def summary(aggregate: Mapping[str, float]) -> dict[str, float | None]:
    """What a person reads: counts, rates, means and latency percentiles."""
    calls = aggregate.get("calls", 0)
    rewarded = aggregate.get("rewarded", 0)
    out: dict[str, float | None] = {key: aggregate.get(key, 0) for key in COUNTS if key != "reward_sum"}
    out["error_rate"] = aggregate.get("errors", 0) / calls if calls else None
    out["reward_mean"] = aggregate.get("reward_sum", 0) / rewarded if rewarded else None
    for histogram in HISTOGRAMS:
        for q in (0.5, 0.9, 0.99):
            out[f"{histogram}_p{round(q * 100)}_ms"] = percentile(aggregate, histogram, q)
    return out

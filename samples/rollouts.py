"""Rollouts of a typical shape for the benchmarks and tests that need many: queued, two calls of
byte-level token ids (the second's prompt extends the first turn), a reward, finished."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import agentstream.schemas as s

PROMPT, COMPLETION, FOLLOW_UP = 300, 120, 40
"""tokens: the first prompt, each completion, the user's turn added before the second call"""
EVENTS_PER_ROLLOUT = 5


def call_event(ids: dict, time_ms: int, prompt: list[int], completion: list[int], rng: random.Random) -> s.CallEvent:
    text = "".join(chr(97 + t % 26) for t in completion)
    return s.CallEvent(**ids, time=time_ms, data=s.Call(
        api="chat.completions", model="tiny", upstream="http://127.0.0.1:8000", weight_version=0, status=200,
        started_at=time_ms - 800, latency_ms=800.0,
        request={"model": "tiny", "max_tokens": 256, "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 8},
            {"role": "user", "content": "".join(chr(97 + t % 26) for t in prompt)}]},
        response={"id": f"chatcmpl-{rng.getrandbits(64):x}", "object": "chat.completion", "model": "tiny",
                  "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}},
        prompt_token_ids=prompt, completion_token_ids=completion,
        logprobs=[round(-rng.random() * 3, 6) for _ in completion], finish_reason="stop",
        usage=s.Usage(prompt_tokens=len(prompt), completion_tokens=len(completion),
                      total_tokens=len(prompt) + len(completion))))


def rollout_events(rollout_id: str, rng: random.Random, clock: Callable[[], int]) -> Iterator[s.Event]:
    """queued, two calls (the second's prompt extends the first turn), reward, finished.

    Lazily: each event takes its time from `clock()` when it is built (live rollouts build each
    event just before publishing it).
    """
    ids = dict(source="bench", rollout_id=rollout_id, attempt_id=f"{rollout_id}-a1")
    task = s.Task(id=f"task-{rollout_id}", input={"prompt": "Add the numbers and explain each step."})
    yield s.RolloutQueuedEvent(**ids, time=clock(), data=s.RolloutQueued(
        task=task, group_id=f"g-{rollout_id}", weight_version=0, model="tiny", managed=True))
    prompt = [rng.randrange(256) for _ in range(PROMPT)]
    first = [rng.randrange(256) for _ in range(COMPLETION)]
    yield call_event(ids, clock(), prompt, first, rng)
    second_prompt = prompt + first + [rng.randrange(256) for _ in range(FOLLOW_UP)]
    yield call_event(ids, clock(), second_prompt, [rng.randrange(256) for _ in range(COMPLETION)], rng)
    yield s.RewardEvent(**ids, time=clock(), data=s.Reward(value=rng.random()))
    yield s.RolloutFinishedEvent(**ids, time=clock(), data=s.RolloutFinished(by="controller", exit_code=0))


def history(count: int, prefix: str) -> list[s.Event]:
    """`count` rollouts whose events were written an hour ago, 50 ms apart, 10 ms between events."""
    rng = random.Random(0)
    start = s.now_ms() - 3_600_000
    events = []
    for i in range(count):
        times = iter(range(start + 50 * i, start + 50 * i + 10 * EVENTS_PER_ROLLOUT, 10))
        events += rollout_events(f"{prefix}{i}", rng, times.__next__)
    return events

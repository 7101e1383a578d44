"""A known set of events for the dashboard: rollouts over three weight versions, their calls, rewards,
trajectories (with token sequences), the weights that trained on them and the pool's swaps.
"""

from __future__ import annotations

import math

import schemas as s

UPSTREAMS = ("http://127.0.0.1:9101", "http://127.0.0.1:9102")
VERSIONS = (0, 1, 2)
TASKS = ("add-2-3", "mul-4-5", "sub-9-1")


def prompt(task: str) -> list[dict]:
    return [{"role": "system", "content": "Answer in digits."}, {"role": "user", "content": f"What is {task}?"}]


def rollout(index: int, version: int, task: str, split: str, reward: float | None, turns: int,
            status: str = "finished", base_ms: int = 0) -> list[s.Event]:
    """One attempt: queued, started, `turns` calls, an ending, a reward, and its trajectory."""
    rid, aid = f"r-{version}-{task}-{index}", f"a-{version}-{task}-{index}"
    ids = dict(source="test", rollout_id=rid, attempt_id=aid)
    t0 = base_ms + index * 10
    queued = s.RolloutQueuedEvent(**ids, time=t0, data=s.RolloutQueued(
        task=s.Task(id=task, input={"question": task}), group_id=f"g-{version}-{task}", sample_index=index,
        split=split, weight_version=version, model="tiny"))
    started = s.RolloutStartedEvent(**ids, time=t0 + 1, data=s.RolloutStarted(launcher="local", worker=str(1000 + index)))
    events: list[s.Event] = [queued, started]
    messages = prompt(task)
    token_ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int | None] = []
    turn_records = []
    prompt_ids = [1, 2, 3, 4, 5]
    for turn in range(turns):
        completion = [40 + turn, 41 + turn, 42 + turn] + ([43] if turn % 2 else [])
        lps = [math.log(0.9), math.log(0.5), math.log(0.1), math.log(0.99)][:len(completion)]
        answer = f"answer {turn} to {task}"
        call = s.CallEvent(**ids, time=t0 + 2 + turn, data=s.Call(
            api="chat.completions", model="tiny", upstream=UPSTREAMS[(index + turn) % 2], weight_version=version,
            request={"messages": list(messages)},
            response={"choices": [{"message": {"role": "assistant", "content": answer}}]},
            prompt_token_ids=list(prompt_ids), completion_token_ids=completion, logprobs=lps, finish_reason="stop",
            usage=s.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(completion),
                          total_tokens=len(prompt_ids) + len(completion)),
            status=200, started_at=t0 + 2 + turn, latency_ms=10.0 * (turn + 1) + index % 7))
        events.append(call)
        new_prompt = prompt_ids[len(token_ids):] if token_ids else prompt_ids
        token_ids += new_prompt + completion
        mask += [0] * len(new_prompt) + [1] * len(completion)
        logprobs += [0.0] * len(new_prompt) + lps
        versions += [None] * len(new_prompt) + [version] * len(completion)
        turn_records.append(s.Turn(call_id=call.id, sequence=0, prompt_token_ids=list(prompt_ids),
                                   completion_token_ids=completion, logprobs=lps, weight_version=version,
                                   finish_reason="stop", latency_ms=call.data.latency_ms))
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"tool result {turn}"}]
        prompt_ids = token_ids + [7, 8]
    end = t0 + 2 + turns
    if status == "finished":
        events.append(s.RolloutFinishedEvent(**ids, time=end, data=s.RolloutFinished(
            by="controller", exit_code=0, duration_ms=end - t0, stdout_tail=f"done {task}\n")))
    else:
        events.append(s.RolloutFailedEvent(**ids, time=end, data=s.RolloutFailed(
            exit_code=1, duration_ms=end - t0, error="exit code 1", stderr_tail="Traceback: boom\n")))
    rewards = []
    if reward is not None:
        event = s.RewardEvent(**ids, time=end + 1, data=s.Reward(
            value=reward, reward_fn="recipes.swe:grade",
            details={"tests_run": 4, "tests_passed": round(4 * reward), "stripped_edits": ["tests/test_x.py"]}))
        events.append(event)
        rewards.append(s.RewardRecord(event_id=event.id, value=reward, reward_fn="recipes.swe:grade"))
    sequence = s.Sequence(token_ids=token_ids, mask=mask, logprobs=logprobs, weight_versions=versions,
                          prompt_length=5, turns=list(range(turns)))
    events.append(s.TrajectoryEvent(**ids, time=end + 2, data=s.Trajectory(
        model="tiny", task_id=task, group_id=f"g-{version}-{task}", split=split, sample_index=index,
        status=status, reward=reward, reward_missing=reward is None and status == "finished", rewards=rewards,
        turns=turn_records, sequences=[sequence], merged=True, weight_version_launch=version,
        started_at=t0, finished_at=end + 2, duration_ms=end + 2 - t0, lineage=[e.id for e in events])))
    return events


def generated_tokens(trajectory: s.TrajectoryEvent) -> int:
    return sum(sum(seq.mask) for seq in trajectory.data.sequences)


def known_events(now_ms: int) -> list[s.Event]:
    """24 attempts (3 versions × 3 tasks, train and validation), 2 versions trained, 4 swaps."""
    events: list[s.Event] = []
    base = now_ms - 60_000
    index = 0
    for version in VERSIONS:
        for task in TASKS:
            for split, reward in (("train", 0.25 * version), ("train", 1.0 if version == 2 else 0.0),
                                  ("validation", 0.5)):
                events += rollout(index, version, task, split, reward, turns=1 + index % 3, base_ms=base)
                index += 1
    events += rollout(index, 2, "add-2-3", "train", None, turns=2, status="failed", base_ms=base)
    trajectories = [e for e in events if isinstance(e, s.TrajectoryEvent)]
    for version in (1, 2):
        trained = [t.id for t in trajectories if t.data.weight_version_launch == version - 1 and t.data.split == "train"]
        events.append(s.WeightsEvent(source="trainer", time=base + 1000 * version, data=s.Weights(
            model="tiny", version=version, uri=f"/ckpt/v{version}", step=version, base_version=version - 1,
            lineage=trained)))
        for n, server in enumerate(UPSTREAMS):
            events.append(s.PoolUpdateEvent(source="gateway", time=base + 1000 * version + 100 + n, data=s.PoolUpdate(
                model="tiny", version=version, server=server, status="ok", pause_ms=40.0 * version + n,
                load_ms=30.0, held_ms=45.0, applied_by="gw-test")))
    return events

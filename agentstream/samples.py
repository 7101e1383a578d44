"""Events of a known shape, for tests and benchmarks alike (benchmarks import no test code).

- trainer: trajectories of the tiny byte-level model's token ids (`chat_prompt`, `trajectory`);
- dashboard: one rollout attempt with every event it makes (`rollout`), over fixed upstreams and tasks.
"""

from __future__ import annotations

import math

import agentstream.schemas as s

# --- trainer: trajectories of the tiny model -------------------------------------------------

IM_START, IM_END = 257, 258  # the tiny model's chat specials; IM_END is its eos


def ids(text: str) -> list[int]:
    return list(text.encode())


def chat_prompt(user: str) -> list[int]:
    """The tiny model's chat template, as token ids."""
    return [IM_START, *ids(f"user\n{user}"), IM_END, *ids("\n"), IM_START, *ids("assistant\n")]


def trajectory(prompt: list[int], completion: list[int], reward: float | None, group: str, index: int,
               logprobs: list[float] | None = None, version: int | None = None, attempt: int = 1,
               model: str | None = "tiny", split: str = "train") -> s.TrajectoryEvent:
    rollout, attempt_id = f"r-{group}-{index}", f"a{attempt}"
    logprobs = logprobs if logprobs is not None else [-1.0] * len(completion)
    sequence = s.Sequence(
        token_ids=prompt + completion, mask=[0] * len(prompt) + [1] * len(completion),
        logprobs=[0.0] * len(prompt) + logprobs, weight_versions=[None] * len(prompt) + [version] * len(completion),
        prompt_length=len(prompt), turns=[0])
    turn = s.Turn(call_id=f"c-{rollout}", sequence=0, prompt_token_ids=prompt, completion_token_ids=completion,
                  logprobs=logprobs, weight_version=version)
    return s.TrajectoryEvent(
        id=s.derived_id("trajectory", rollout, attempt_id), source="test", rollout_id=rollout, attempt_id=attempt_id,
        data=s.Trajectory(model=model, task_id=f"task-{group}", group_id=group, sample_index=index,
                          attempt_number=attempt, split=split, status="finished", reward=reward, turns=[turn],
                          sequences=[sequence], merged=True, finished_at=s.now_ms(), lineage=[f"c-{rollout}"]))


# --- dashboard: one attempt's events ----------------------------------------------------------

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
        flagged = index % 3 == 0  # the grader's shape: a refused test edit, the tests' grade beside the paid one
        event = s.RewardEvent(**ids, time=end + 1, data=s.Reward(
            value=reward, reward_fn="recipes.swe.grader",
            details={"tests_run": 4, "tests_passed": round(4 * reward), "graded_reward": reward, "flagged": flagged,
                     "flags": ["refused:test-file"] if flagged else [], "penalized_by": [],
                     "refused": [{"path": "tests/test_x.py", "rule": "test-file"}] if flagged else []}))
        events.append(event)
        rewards.append(s.RewardRecord(event_id=event.id, value=reward, reward_fn="recipes.swe.grader"))
    sequence = s.Sequence(token_ids=token_ids, mask=mask, logprobs=logprobs, weight_versions=versions,
                          prompt_length=5, turns=list(range(turns)))
    events.append(s.TrajectoryEvent(**ids, time=end + 2, data=s.Trajectory(
        model="tiny", task_id=task, group_id=f"g-{version}-{task}", split=split, sample_index=index,
        status=status, reward=reward, reward_missing=reward is None and status == "finished", rewards=rewards,
        turns=turn_records, sequences=[sequence], merged=True, weight_version_launch=version,
        started_at=t0, finished_at=end + 2, duration_ms=end + 2 - t0, lineage=[e.id for e in events])))
    return events

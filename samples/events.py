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


def sample_events() -> list[s.Event]:
    rollout = dict(source="test", rollout_id="r-1", attempt_id="a-1")
    task = s.Task(id="t-1", input={"question": "2+2?"}, reward_fn="streams.rewards:exact_match",
                  metadata={"answer": "4"})
    call = s.Call(
        api="chat.completions", model="tiny", upstream="http://127.0.0.1:1", weight_version=3, streamed=True,
        request={"messages": [{"role": "user", "content": "2+2?"}]},
        response={"choices": [{"message": {"role": "assistant", "content": "4"}}]},
        prompt_token_ids=[1, 2, 3], completion_token_ids=[52, 258], logprobs=[-0.5, -0.1], finish_reason="stop",
        extra_choices=[s.ChoiceTokens(index=1, completion_token_ids=[53], logprobs=[-2.0])],
        usage=s.Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
        status=200, started_at=1_700_000_000_000, latency_ms=12.5, ttft_ms=3.0,
    )
    turn = s.Turn(call_id="c-1", sequence=0, prompt_token_ids=[1, 2, 3], completion_token_ids=[52, 258],
                  logprobs=[-0.5, -0.1], weight_version=3, finish_reason="stop", latency_ms=12.5)
    sequence = s.Sequence(token_ids=[1, 2, 3, 52, 258], mask=[0, 0, 0, 1, 1], logprobs=[0, 0, 0, -0.5, -0.1],
                          weight_versions=[None, None, None, 3, 3], prompt_length=3, turns=[0])
    return [
        s.RolloutQueuedEvent(**rollout, data=s.RolloutQueued(task=task, group_id="g-1", weight_version=3)),
        s.RolloutStartedEvent(**rollout, data=s.RolloutStarted(launcher="local", worker="1234")),
        s.RolloutHeartbeatEvent(**rollout, data=s.RolloutHeartbeat(elapsed_ms=1000)),
        s.RolloutFinishedEvent(**rollout, data=s.RolloutFinished(by="controller", exit_code=0, duration_ms=900)),
        s.RolloutFailedEvent(**rollout, data=s.RolloutFailed(exit_code=1, error="exit code 1", will_retry=True)),
        s.RolloutTimedOutEvent(**rollout, data=s.RolloutTimedOut(timeout_s=5, duration_ms=5000)),
        s.RolloutDiffEvent(source="gateway", rollout_id="r-1", attempt_id="a-1", data=s.RolloutDiff(
            instance_id="pkg__1", base_commit="abc", diff="--- a/x\n+++ b/x\n", size=18, outcome="submitted")),
        s.SessionEndedEvent(source="gateway", rollout_id="session-1", data=s.SessionEnded(
            session_id="chat-1", sender="key:0123456789abcdef")),
        s.CallEvent(**rollout, data=call),
        s.FeedbackEvent(source="gateway", rollout_id="session-1", data=s.Feedback(
            session_id="chat-1", call_id="c-1", thumbs="up", sender="key:0123456789abcdef", user="u-7",
            client_id="fb-1")),
        s.RewardEvent(**rollout, data=s.Reward(value=1.0, turns=[s.TurnReward(turn=0, value=1.0)])),
        s.TrajectoryEvent(**rollout, data=s.Trajectory(
            status="finished", reward=1.0, turns=[turn], sequences=[sequence], merged=True,
            finished_at=1_700_000_000_900, lineage=["e-1", "e-2"])),
        s.WeightsEvent(source="trainer", data=s.Weights(model="tiny", version=4, uri="/ckpt/v4", step=4,
                                                        metrics={"loss": 0.1}, lineage=["tr-1"])),
        s.PoolUpdateEvent(source="gateway", data=s.PoolUpdate(model="tiny", version=4, server="http://x",
                                                              status="ok", pause_ms=150.0, applied_by="gw-1")),
        s.PoolHeldEvent(source="gateway", data=s.PoolHeld(model="tiny", version=4, cause="0190e7a0-weights",
                                                          replica="gw-2")),
        s.ReleaseEvent(source="releases", data=s.Release(
            model="tiny", action="promote", version=5, uri="/ckpt/v5", stable_version=4, stable_uri="/ckpt/v4",
            share_bp=1000, servers=["http://y"], started_at=1, decided_by="rule", reason="mean reward higher",
            arms=[s.ArmNumbers(version=4, sessions=30, mean_reward=0.4, reward_std=0.1, calls=90, p95_latency_ms=80.0),
                  s.ArmNumbers(version=5, sessions=31, mean_reward=0.6, reward_std=0.1, calls=95, errors=1)],
            p_value=0.001, numbers={"alpha": 0.05, "z": 3.1})),
        s.DeadletterEvent(source="streams", data=s.Deadletter(topic="calls", partition=0, offset=7, value="{",
                                                              reason="not JSON", consumer="streams")),
        s.MetricsEvent(source="streams", data=s.Metrics(window_s=10, window_start=0, values={"calls": 3.0})),
        s.EvalEvent(source="eval", data=s.Eval(model="tiny", weight_version=2, served_versions=[2], run_id="eval-1",
                                               tasks=2, k=2, samples=4, pass_at_1=0.25, pass_at_k=0.5, solved_tasks=1,
                                               unscored={"failed": 1}, per_task={"t1": [1.0, 0.0], "t2": [0.0, None]})),
    ]

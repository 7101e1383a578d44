"""One valid example of every event type, for round-trip and consumer tests."""

from __future__ import annotations

import agentstream.schemas as s


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

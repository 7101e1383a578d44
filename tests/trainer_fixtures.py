"""Trajectories for the trainer's tests and benchmark: real token ids of the tiny byte-level model,
with the logprobs the model itself gives them (as if it had sampled them at that weight version)."""

from __future__ import annotations

from pathlib import Path

import torch

import schemas as s

IM_START, IM_END = 257, 258  # the tiny model's chat specials; IM_END is its eos


def ids(text: str) -> list[int]:
    return list(text.encode())


def chat_prompt(user: str) -> list[int]:
    """The tiny model's chat template, as token ids."""
    return [IM_START, *ids(f"user\n{user}"), IM_END, *ids("\n"), IM_START, *ids("assistant\n")]


def policy_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion token | everything before it) under `model`."""
    tokens = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return logprobs[len(prompt) - 1:].tolist()


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


def arithmetic_groups(model_dir: Path, groups: int, group_size: int, version: int | None = None,
                      prefix: str = "g") -> list[s.TrajectoryEvent]:
    """Groups of 'a+b=' prompts where half the samples answer right (reward 1) and half wrong (0),
    with on-policy logprobs from the model in `model_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    events = []
    for g in range(groups):
        a, b = g % 10, (g * 3) % 10
        prompt = chat_prompt(f"{a}+{b}=")
        for i in range(group_size):
            right = i % 2 == 0
            completion = ids(str(a + b if right else a + b + 1)) + [IM_END]
            events.append(trajectory(prompt, completion, 1.0 if right else 0.0, f"{prefix}{g}", i,
                                     policy_logprobs(model, prompt, completion), version))
    return events

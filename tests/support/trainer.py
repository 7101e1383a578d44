"""Trajectories for the trainer's tests and benchmark: real token ids of the tiny byte-level model,
with the logprobs the model itself gives them (as if it had sampled them at that weight version); the
trainer's settings for a test's topics, and its input and output topics written and read back."""

from __future__ import annotations

from pathlib import Path

import torch

import agentstream.schemas as s
from agentstream.schemas.kafka import KafkaSettings, Publisher, make_consumer, make_producer, partitions_of
from agentstream.trainer.grpo import Policy, to_tensors, token_logprobs
from agentstream.trainer.settings import TrainerSettings
from samples.events import IM_END, IM_START, chat_prompt, ids, trajectory  # noqa: F401 (the tests' names)


def policy_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion token | everything before it) under `model`."""
    tokens = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, :-1]
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return logprobs[len(prompt) - 1:].tolist()


def samples_of(events: list[s.TrajectoryEvent]):
    """The trainer's samples of these trajectories, in their order."""
    from agentstream.trainer.batcher import Sample, group_of

    return [Sample(e.id, 0, i, e.data, group_of(e.id, e.data)) for i, e in enumerate(events)]


def first_pass_drift(policy, samples) -> tuple[float, float]:
    """How far the batch's logprobs are from the policy's, as the update's first forward pass computes them
    (same weights, mode, compute dtype and padded batch, so the same kernels on any machine): the mean over
    generated tokens of (sampled - policy's), which is verl's kl of a one-micro-batch step, and of its size."""
    from agentstream.trainer.grpo import autocast, to_tensors, token_logprobs

    batch = to_tensors(samples, policy.settings.max_seq_len)
    policy.model.train()
    with autocast(policy.settings):
        logprobs, _ = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, entropy_grad=False)
    drift = (batch.old_logprobs - logprobs.detach()) * batch.loss_mask
    tokens = batch.loss_mask.sum()
    return float(drift.sum() / tokens), float(drift.abs().sum() / tokens)


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


def sequence_logprobs(policy: Policy, samples: list) -> torch.Tensor:
    batch = to_tensors(samples, 2048)
    with torch.no_grad():
        logprobs, _ = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, entropy_grad=False)
    return (logprobs * batch.loss_mask).sum(-1)


def trainer_settings(kafka: KafkaSettings, checkpoints: Path, base: Path, **overrides) -> TrainerSettings:
    return TrainerSettings(**{
        "bootstrap_servers": kafka.bootstrap_servers, "topic_prefix": kafka.topic_prefix,
        "partitions": kafka.partitions, "base_model": base, "checkpoint_dir": checkpoints, "group_size": 4,
        "groups_per_batch": 2, "lr": 1e-3, "consumer_group": f"{kafka.topic_prefix}trainer", **overrides})


def write_jsonl(path: Path, events: list[s.Event]) -> Path:
    path.write_bytes(b"".join(s.encode(e) + b"\n" for e in events))
    return path


async def publish(kafka: KafkaSettings, events: list[s.Event], raw: list[bytes] = ()) -> list:
    producer = make_producer(kafka)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka.topics)
        written = [await publisher.publish(event) for event in events]
        for value in raw:
            await producer.send_and_wait(kafka.topics.trajectories, value, key=b"garbage")
        return written
    finally:
        await producer.stop()


async def read_all(kafka: KafkaSettings, topic: str) -> list[s.Event]:
    """Every event on `topic` now."""
    tps = await partitions_of(kafka, topic)
    consumer = make_consumer(kafka, group_id=None)
    await consumer.start()
    try:
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        events = []
        for tp in tps:
            while await consumer.position(tp) < ends[tp]:
                for record in (await consumer.getmany(tp, timeout_ms=5000)).get(tp, []):
                    events.append(s.decode(record.value))
        return events
    finally:
        await consumer.stop()


async def committed_and_end(kafka: KafkaSettings, group: str) -> tuple[dict[int, int | None], dict[int, int]]:
    tps = await partitions_of(kafka, kafka.topics.trajectories)
    consumer = make_consumer(kafka, group_id=group)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(tps)
        return ({tp.partition: await consumer.committed(tp) for tp in tps},
                {tp.partition: ends[tp] for tp in tps})
    finally:
        await consumer.stop()

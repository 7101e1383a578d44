"""Trainer samples per second on the tiny model, per batch shape.

Three figures per shape, measured in the same run:
- baseline: a plain supervised step on the same tensors (forward, cross-entropy on the generated
  tokens, backward, AdamW): what any trainer pays;
- update: `Policy.update` (verl's GRPO advantages and PPO-clip loss, clipping, AdamW);
- service: the whole trainer against a real broker, in steady state (between its first and its last
  weights event, so start-up and the group join are left out): decode, dedupe, batch, update,
  checkpoint (fsynced), publish, commit; and the share of that time spent in the update (measured
  in the same versions, so load from other processes cancels out).

    uv run python -m bench.trainer_throughput [--repeats 15] [--versions 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from agentstream.models.tiny_model import build_tiny_model
from agentstream.schemas.kafka import KafkaSettings, Publisher, ensure_topics, make_producer
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import free_port
from agentstream.trainer.batcher import Sample, group_of
from agentstream.trainer.grpo import Policy, to_tensors
from agentstream.trainer.settings import TrainerSettings
from samples.events import IM_END, chat_prompt, trajectory

SHAPES = [  # (groups, group size, completion tokens)
    (4, 8, 16),
    (4, 8, 128),
    (8, 8, 64),
]


def make_events(groups: int, group_size: int, completion: int, seed: int, prefix: str):
    rng = random.Random(seed)
    events = []
    for g in range(groups):
        prompt = chat_prompt(f"{g}+{g}= and some context to read first")
        for i in range(group_size):
            tokens = [rng.randrange(32, 127) for _ in range(completion - 1)] + [IM_END]
            logprobs = [-rng.uniform(4, 6) for _ in tokens]
            events.append(trajectory(prompt, tokens, float(rng.random() < 0.5), f"{prefix}{g}", i, logprobs))
    return events


def supervised_step(model, optimizer, batch) -> None:
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
    ((losses * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def timed(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds per step of each, interleaved so that load from elsewhere hits them alike."""
    times = {name: [] for name in steps}
    for round_ in range(repeats + 1):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            if round_:  # round 0 warms up
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


async def service_rate(bootstrap: str, model_dir: Path, shape, versions: int, workdir: Path) -> tuple[float, float]:
    """Samples per second of the running trainer, and the share of its time spent in `Policy.update`."""
    from agentstream.trainer.service import Trainer

    groups, group_size, completion = shape
    kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench{groups}x{group_size}x{completion}.")
    await ensure_topics(kafka)
    events = make_events(groups * versions, group_size, completion, seed=1, prefix="s")
    producer = make_producer(kafka)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka.topics)
        await publisher.publish_all(events)
    finally:
        await producer.stop()
    settings = TrainerSettings(
        bootstrap_servers=bootstrap, topic_prefix=kafka.topic_prefix, base_model=model_dir,
        checkpoint_dir=workdir / kafka.topic_prefix, group_size=group_size, groups_per_batch=groups,
        max_versions=versions, lr=1e-3, max_staleness=1000)
    published = await Trainer(settings).run()
    assert len(published) == versions
    steady = published[1:]  # each version's time runs from the previous weights event to its own
    wall = (published[-1].time - published[0].time) / 1000
    trained = sum(len(event.data.lineage) for event in steady)
    return trained / wall, sum(event.data.metrics["train_s"] for event in steady) / wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per shape (median reported)")
    parser.add_argument("--versions", type=int, default=8, help="versions the service run trains per shape")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "tiny", seed=0)
        broker = LocalKafka(workdir / "kafka")
        bootstrap = broker.start(port=free_port()).url
        try:
            print(f"torch threads: {torch.get_num_threads()}; tiny model (hidden 128, 2 layers, vocab 259)")
            print(f"{'batch (groups×size, tokens/seq)':<34}{'baseline':>12}{'update':>12}{'service':>12}"
                  f"{'update/base':>13}{'update share of service':>25}")
            for shape in SHAPES:
                groups, group_size, completion = shape
                samples = [Sample(e.id, 0, i, e.data, group_of(e.id, e.data))
                           for i, e in enumerate(make_events(groups, group_size, completion, seed=0, prefix="g"))]
                batch = to_tensors(samples, 2048)
                settings = TrainerSettings(group_size=group_size, lr=1e-3)
                torch.manual_seed(0)
                policy = Policy.load(model_dir, settings)
                seconds = timed({"baseline": partial(supervised_step, policy.model, policy.optimizer, batch),
                                 "update": partial(policy.update, samples)}, args.repeats)
                baseline, update = len(samples) / seconds["baseline"], len(samples) / seconds["update"]
                service, share = asyncio.run(service_rate(bootstrap, model_dir, shape, args.versions, workdir))
                label = f"{groups}×{group_size} = {len(samples)} seqs, {batch.input_ids.shape[1]} tokens"
                print(f"{label:<34}{baseline:>10.0f}/s{update:>10.0f}/s{service:>10.0f}/s"
                      f"{update / baseline:>13.2f}{share:>25.2f}", flush=True)
        finally:
            broker.stop()


if __name__ == "__main__":
    main()

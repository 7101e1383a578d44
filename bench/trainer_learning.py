"""How fast the trainer's update teaches the tiny model a toy task (no Kafka, no vLLM).

The loop of the demo without its plumbing: sample 4 groups × 8 completions of ≤ 8 bytes from the
current policy (transformers' `generate`, temperature 1), score them (reward = share of the 8 bytes
that are digits; a random-init model starts near 10/259), and run one `Policy.update` per version.
Reports the reward per version against the starting policy's, for each learning rate.

    uv run python -m bench.trainer_learning [--versions 40] [--lr 1e-3 3e-3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from agentstream.models.tiny_model import build_tiny_model
from agentstream.trainer.batcher import Sample, group_of
from agentstream.trainer.grpo import Policy
from agentstream.trainer.settings import TrainerSettings
from samples.events import IM_END, chat_prompt, trajectory

GROUPS, GROUP_SIZE, MAX_TOKENS = 4, 8, 8
PAD = 256


def digit_share(tokens: list[int]) -> float:
    return sum(48 <= t < 58 for t in tokens) / MAX_TOKENS


def sample(model: torch.nn.Module, prompt: list[int], n: int, max_tokens: int = MAX_TOKENS
           ) -> list[tuple[list[int], list[float]]]:
    """`n` completions of ≤ `max_tokens` from `model` at temperature 1, each cut after its IM_END, with the
    logprob it sampled each token with (as vLLM records them)."""
    model.eval()
    ids = torch.tensor([prompt] * n)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_tokens, eos_token_id=IM_END, pad_token_id=PAD)
        completions = out[:, len(prompt):]
        logits = model(input_ids=out).logits[:, len(prompt) - 1:-1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, completions[..., None])[..., 0]
    cut = []
    for row, tokens in enumerate(completions.tolist()):
        n_kept = tokens.index(IM_END) + 1 if IM_END in tokens else len(tokens)
        cut.append((tokens[:n_kept], logprobs[row, :n_kept].tolist()))
    return cut


def sample_batch(policy: Policy, prompt: list[int], version: int) -> tuple[list[Sample], float]:
    samples, rewards = [], []
    for row, (tokens, logprobs) in enumerate(sample(policy.model, prompt, GROUPS * GROUP_SIZE)):
        reward = digit_share(tokens)
        event = trajectory(prompt, tokens, reward, f"v{version}g{row // GROUP_SIZE}", row % GROUP_SIZE, logprobs,
                           version)
        samples.append(Sample(event.id, 0, row, event.data, group_of(event.id, event.data)))
        rewards.append(reward)
    return samples, sum(rewards) / len(rewards)


def learn(model_dir: Path, lr: float, versions: int) -> list[tuple[float, float]]:
    settings = TrainerSettings(lr=lr, group_size=GROUP_SIZE, seed=0)
    torch.manual_seed(0)
    policy = Policy.load(model_dir, settings)
    prompt = chat_prompt("Write digits.")
    curve, started = [], time.perf_counter()
    for version in range(versions):
        samples, reward = sample_batch(policy, prompt, version)
        policy.update(samples)
        curve.append((reward, time.perf_counter() - started))
    return curve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-3])
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        print(f"toy task: share of digits in ≤{MAX_TOKENS} bytes; {GROUPS}×{GROUP_SIZE} samples per version")
        for lr in args.lr:
            curve = learn(model_dir, lr, args.versions)
            start = curve[0][0]
            marks = ", ".join(f"v{v}: {curve[v][0]:.2f}" for v in range(0, args.versions, 5))
            reached = next((v for v, (r, _) in enumerate(curve) if r >= 0.9), None)
            print(f"lr {lr:g}: starting policy {start:.3f}; {marks}; last {curve[-1][0]:.2f} "
                  f"({curve[-1][0] / max(start, 1e-9):.0f}× the start); reward ≥ 0.9 at version "
                  f"{reached if reached is not None else '-'}; {curve[-1][1]:.1f} s for {args.versions} versions",
                  flush=True)


if __name__ == "__main__":
    main()

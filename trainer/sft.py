"""Supervised fine-tuning on the log's good trajectories (rejection-sampling fine-tuning), top to bottom.

    samples ─▶ keep reward ≥ --sft-min-reward ─▶ padded tensors ─▶ micro-batches by token budget
        ─▶ −log p(generated token), token mean, backward ─▶ AdamW step

A warm start for a model that rarely succeeds: the attempts that did succeed (graded by the same
reward as any rollout) are imitated, token by token, on exactly the tokens the model generated
(`loss_mask`, as in GRPO: prompts, tool outputs and the harness's text are never trained on). Nothing
else of GRPO applies: no groups, no advantages, no old logprobs. A sample below the threshold is not
trained on (the service drops it on arrival, counted as `below_sft_threshold`; an update handed one
skips it). Versions are published like GRPO's: same checkpoints, swap and lineage (`--loss sft`).
"""

from __future__ import annotations

import time

import torch

from agentstream.trainer.batcher import Sample
from agentstream.trainer.grpo import Policy, Tensors, autocast, chunks, micro_batches, to_tensors, token_logprobs


def eligible(sample: Sample, min_reward: float) -> bool:
    """Whether a sample is imitated: its reward (shaping included) reaches the threshold."""
    return sample.reward >= min_reward


class SFTPolicy(Policy):
    """`Policy` with a supervised loss: load, save and the optimizer are GRPO's."""

    def update(self, samples: list[Sample]) -> dict[str, float]:
        started = time.perf_counter()
        s = self.settings
        kept = [sample for sample in samples if eligible(sample, s.sft_min_reward)]
        if not kept:
            raise ValueError(f"no sample of the batch has a reward ≥ {s.sft_min_reward} (--sft-min-reward)")
        batch = to_tensors(kept, s.max_seq_len).to(s.device)
        self.model.train()
        history = []
        for _epoch in range(s.epochs):
            for mini in chunks(batch.rows, s.mini_batch_size):
                history.append(self._sft_step(batch, mini))
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {name: sum(step[name] for step in history) / len(history) for name in history[0]}
        metrics["nonfinite_grad_steps"] = sum(step["nonfinite_grad_steps"] for step in history)
        metrics["optimizer_steps"] = float(len(history))
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        rewards = torch.tensor([sample.reward for sample in kept], dtype=torch.float64)
        metrics.update(samples=float(len(kept)), sft_skipped=float(len(samples) - len(kept)),
                       sequences=float(batch.rows), tokens=batch.loss_mask.sum().item(),
                       groups=float(len({sample.group for sample in kept})), reward_mean=rewards.mean().item(),
                       reward_min=rewards.min().item(), reward_max=rewards.max().item(),
                       train_s=time.perf_counter() - started)
        return metrics

    def _sft_step(self, batch: Tensors, mini: slice) -> dict[str, float]:
        """One optimizer step: the mean negative logprob over the mini-batch's generated tokens, its
        micro-batches' gradients adding up to the mini-batch's."""
        s = self.settings
        tokens = batch.loss_mask[mini].sum().item()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for rows in micro_batches(batch, mini, s):
            width = int(batch.attention_mask[rows].sum(-1).max())
            mask = batch.loss_mask[rows, : width - 1]
            with autocast(s):
                logprobs, _ = token_logprobs(self.model, batch.input_ids[rows, :width],
                                             batch.attention_mask[rows, :width], entropy_grad=False)
            loss = -(logprobs * mask * batch.weights[rows, : width - 1]).sum() / max(tokens, 1)
            loss.backward()
            total += loss.item()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, s.max_grad_norm)
        finite = bool(torch.isfinite(grad_norm))
        if finite:  # one bad batch must not poison the weights
            self.optimizer.step()
        return {"loss": total, "grad_norm": grad_norm.item() if finite else 0.0,
                "nonfinite_grad_steps": 0.0 if finite else 1.0}

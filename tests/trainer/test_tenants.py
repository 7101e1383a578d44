"""Tenants' adapters (#48 item 3) against a real broker: each tenant's trajectories train its own LoRA adapter over
the frozen base, published as a PEFT folder with `tenant` set; a restart resumes each adapter and its optimizer and
trains no sample twice; trajectories of no tenant are not trained here."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import agentstream.schemas as s
from agentstream.trainer.adapters import ADAPTER_FILES, TenantAdapters
from agentstream.trainer.batcher import Sample, group_of
from agentstream.trainer.settings import TrainerSettings
from agentstream.trainer.tenant_trainer import TenantTrainer
from tests.support.trainer import arithmetic_groups, committed_and_end, publish, read_all, trainer_settings

pytestmark = pytest.mark.slow


def of(tenant: str | None, events: list[s.TrajectoryEvent]) -> list[s.TrajectoryEvent]:
    for event in events:
        event.data.tenant = tenant
    return events


def lora_weights(adapters: TenantAdapters, tenant: str) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in adapters.model.named_parameters() if f".{tenant}." in name}


def test_a_tenants_batch_trains_its_adapter_and_leaves_the_others_and_the_base_alone(tiny_model_dirs):
    base = tiny_model_dirs[0]
    adapters = TenantAdapters(base, TrainerSettings(lora_rank=4, lr=1e-2, group_size=4, groups_per_batch=1))
    adapters.add("agent-a")
    adapters.add("agent-b")
    events = arithmetic_groups(base, groups=1, group_size=4)
    samples = [Sample(e.id, 0, i, e.data, group_of(e.id, e.data)) for i, e in enumerate(events)]
    before = {t: lora_weights(adapters, t) for t in ("agent-a", "agent-b")}
    frozen = {n: p.detach().clone() for n, p in adapters.model.named_parameters() if "lora_" not in n}
    adapters.update("agent-a", samples)
    after = {t: lora_weights(adapters, t) for t in ("agent-a", "agent-b")}
    assert before["agent-a"] and any(not torch.equal(before["agent-a"][n], w) for n, w in after["agent-a"].items())
    assert all(torch.equal(before["agent-b"][n], w) for n, w in after["agent-b"].items())
    assert all(torch.equal(frozen[n], p) for n, p in adapters.model.named_parameters() if "lora_" not in n)


async def test_each_tenant_gets_its_own_adapter_versions_and_a_restart_trains_no_sample_twice(
        kafka, tiny_model_dirs, tmp_path):
    base = tiny_model_dirs[0]
    first = {"agent-a": of("agent-a", arithmetic_groups(base, groups=2, group_size=4, prefix="a")),
             "agent-b": of("agent-b", arithmetic_groups(base, groups=2, group_size=4, prefix="b"))}
    shared = of(None, arithmetic_groups(base, groups=2, group_size=4, prefix="shared"))
    escaping = of("../../escaped", arithmetic_groups(base, groups=1, group_size=4, prefix="escaping"))  # by hand
    await publish(kafka, [*shared, *escaping, *first["agent-a"], *first["agent-b"]])
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, tenant_adapters=True, lora_rank=4, max_versions=2)
    events = await TenantTrainer(settings).run()

    assert sorted((e.data.tenant, e.data.version, e.data.base_version) for e in events) == [
        ("agent-a", 1, 0), ("agent-b", 1, 0)]
    for event in events:
        w = event.data
        assert w.tenant is not None and sorted(w.lineage) == sorted(e.id for e in first[w.tenant])
        folder = tmp_path.joinpath("ckpt", "tenants", w.tenant, "v000001").resolve()
        assert w.uri == str(folder) and all((folder / name).is_file() for name in ADAPTER_FILES)
        assert not (folder / "model.safetensors").exists()  # an adapter, not the base again
        # what vLLM and peft load: the adapter's tensors under peft's names, its B trained away from zero
        tensors = load_file(folder / "adapter_model.safetensors")
        assert tensors and all(".lora_" in name and w.tenant not in name for name in tensors)
        assert any(name.endswith("lora_B.weight") and tensor.abs().sum() > 0 for name, tensor in tensors.items())
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
    assert sum(e.data.metrics.get("no_tenant_dropped", 0) for e in events) == len(shared)
    assert sum(e.data.metrics.get("invalid_tenant_dropped", 0) for e in events) == len(escaping)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing written beside the checkpoints
    assert sorted(await read_all(kafka, kafka.topics.weights), key=lambda e: e.id) == sorted(events, key=lambda e: e.id)
    committed, ends = await committed_and_end(kafka, settings.consumer_group)
    assert {p: committed[p] for p in ends if ends[p]} == {p: e for p, e in ends.items() if e}

    # a restart: the first samples delivered again (same ids) are not trained again; agent-a's new ones train its
    # adapter from version 1 with its optimizer restored
    later = of("agent-a", arithmetic_groups(base, groups=2, group_size=4, prefix="a-later"))
    await publish(kafka, [*first["agent-a"][:3], *first["agent-b"][:2], *later])
    (again,) = await TenantTrainer(trainer_settings(kafka, tmp_path / "ckpt", base, tenant_adapters=True,
                                                    lora_rank=4, max_versions=1)).run()
    assert (again.data.tenant, again.data.version, again.data.base_version) == ("agent-a", 2, 1)
    assert sorted(again.data.lineage) == sorted(e.id for e in later)
    optimizer = torch.load(tmp_path / "ckpt" / "tenants" / "agent-a" / "v000002" / "training_state" / "optimizer.pt",
                           weights_only=True)
    assert {int(state["step"]) for state in optimizer["state"].values()} == {2}


def test_tenant_adapters_need_a_lora_rank():
    with pytest.raises(ValueError, match="--lora-rank"):
        TrainerSettings(tenant_adapters=True)

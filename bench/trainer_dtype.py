"""Whether bfloat16 autocast speeds the trainer's forward and backward on this CPU: the trainer's own
`token_logprobs` and a backward pass over one sequence, in float32 and under the bfloat16 autocast that
`--dtype bfloat16` (and `auto` on a CPU with AVX512-BF16 or AMX) uses, interleaved in one run.

    uv run python -m bench.trainer_dtype [--model DIR] [--tokens 1000] [--repeats 3] [--lora-rank 0]

The default model is the tiny one; `--model` takes a real folder (`agentstream model qwen-coder-0.5b DIR`).
Weights stay float32 either way, as the trainer keeps them: autocast casts them for each matmul.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agentstream.models.tiny_model import build_tiny_model
from agentstream.trainer.grpo import token_logprobs, with_lora
from agentstream.trainer.settings import TrainerSettings
from bench.trainer_throughput import timed

RESULTS = Path(__file__).parent / "results" / "trainer_dtype.json"


def step(model: torch.nn.Module, ids: torch.Tensor, bfloat16: bool) -> None:
    context = torch.autocast("cpu", dtype=torch.bfloat16) if bfloat16 else contextlib.nullcontext()
    with context:
        logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), entropy_grad=False)
    (-logprobs.mean()).backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: the tiny model)")
    parser.add_argument("--tokens", type=int, default=1000, help="the sequence's length")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each (median reported)")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank, as the trainer does")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "tiny", seed=0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        if args.lora_rank:
            model = with_lora(model, TrainerSettings(lora_rank=args.lora_rank))
        model.train()
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        seconds = timed({"float32": lambda: step(model, ids, False), "bfloat16": lambda: step(model, ids, True)},
                        args.repeats)
    native = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()}
    print(f"model {args.model or 'tiny'}, {args.tokens} tokens, LoRA rank {args.lora_rank}; CPU {native}")
    print(f"{'compute dtype':<16}{'s per forward+backward':>24}{'vs float32':>12}")
    for name, value in seconds.items():
        print(f"{name:<16}{value:>24.2f}{value / seconds['float32']:>12.2f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"model": str(args.model or "tiny"), "tokens": args.tokens, "cpu": native,
                                   **{f"{name}_s": value for name, value in seconds.items()},
                                   "bfloat16_vs_float32": seconds["bfloat16"] / seconds["float32"]}, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The trainer's memory estimate (trainer/memory.py) against its measured peak: each configuration trains one
SFT update in a fresh process (`SFTPolicy.load` and `update`, as the trainer does after its memory check) on
rows of exactly --max-seq-len tokens, one micro-batch, and reports its peak RSS (VmHWM) beside the estimate.

    uv run python -m bench.trainer_memory [--models tiny,smollm2] [--lengths 512,2048] [--rows 2]

The ratio estimate / measured should stay at or above 1 (a fit that is no fit is the failure that matters)
and not far above it (a needless refusal). SmolLM2 is built once from its PyPI wheel (`agentstream model`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "trainer_memory.json"


def model_folder(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from agentstream.models.tiny_model import build_tiny_model

        return build_tiny_model(tmp / "tiny", seed=0)
    from agentstream.models.smollm2 import build_smollm2, default_folder

    return build_smollm2(default_folder())


def child(folder: Path, length: int, rows: int, checkpointing: bool, lora_rank: int) -> dict[str, float]:
    """One update in this process; the estimate and the peak RSS, in GiB."""
    import random

    from transformers.utils import logging as hf_logging

    from agentstream.trainer.batcher import Sample, group_of
    from agentstream.trainer.grpo import compute_dtype
    from agentstream.trainer.memory import GIB, Shape, estimate, peak_rss
    from agentstream.trainer.settings import TrainerSettings
    from agentstream.trainer.sft import SFTPolicy
    from samples.events import trajectory

    hf_logging.set_verbosity_error()
    settings = TrainerSettings(loss="sft", max_seq_len=length, group_size=rows, groups_per_batch=1,
                               micro_batch_size=rows, gradient_checkpointing=checkpointing, lora_rank=lora_rank,
                               lr=1e-5)
    shape = Shape.of(folder)
    rng = random.Random(0)
    prompt = [rng.randrange(3, min(shape.vocab, 250)) for _ in range(8)]
    events = [trajectory(prompt, [rng.randrange(3, min(shape.vocab, 250)) for _ in range(length - len(prompt))],
                         1.0, "g", i, model="tiny") for i in range(rows)]
    samples = [Sample(e.id, 0, i, e.data, group_of(e.id, e.data)) for i, e in enumerate(events)]
    import torch

    needed = estimate(shape, settings, bfloat16=compute_dtype(settings) == torch.bfloat16)
    policy = SFTPolicy.load(folder, settings)
    policy.update(samples)
    policy.update(samples)  # the second step has AdamW's moments beside the gradients and activations
    return {"estimate_gib": needed.total / GIB, "peak_gib": peak_rss() / GIB,
            **{f"{name}_gib": getattr(needed, name) / GIB for name in
               ("weights", "gradients", "optimizer", "activations", "logits", "runtime")}}


def measure(folder: Path, length: int, rows: int, checkpointing: bool, lora_rank: int) -> dict[str, float]:
    args = json.dumps([str(folder), length, rows, checkpointing, lora_rank])
    done = subprocess.run([sys.executable, "-m", "bench.trainer_memory", "--child", args],
                          capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--rows", type=int, default=2, help="rows of the one micro-batch")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        folder, length, rows, checkpointing, lora_rank = json.loads(args.child)
        print(json.dumps(child(Path(folder), length, rows, checkpointing, lora_rank)))
        return
    results = []
    print(f"{'model':<9}{'tokens':>7}{'ckpt':>6}{'estimate GiB':>14}{'peak RSS GiB':>14}{'estimate/peak':>15}"
          f"   estimate's terms (weights, grads, AdamW, activations, logits, runtime)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = model_folder(name, Path(tmp))
            for length in [int(n) for n in args.lengths.split(",")]:
                for checkpointing in (False, True):
                    row = {"model": name, "tokens": length, "rows": args.rows, "checkpointing": checkpointing,
                           "lora_rank": args.lora_rank,
                           **measure(folder, length, args.rows, checkpointing, args.lora_rank)}
                    results.append(row)
                    terms = ", ".join(f"{row[f'{t}_gib']:.2f}" for t in
                                      ("weights", "gradients", "optimizer", "activations", "logits", "runtime"))
                    print(f"{name:<9}{length:>7}{'on' if checkpointing else 'off':>6}{row['estimate_gib']:>14.2f}"
                          f"{row['peak_gib']:>14.2f}{row['estimate_gib'] / row['peak_gib']:>15.2f}   {terms}",
                          flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

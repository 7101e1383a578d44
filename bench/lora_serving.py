"""Tenants' LoRA adapters on one vLLM-CPU server (#48): what a tenant's new version costs against a full weight
reload of the same model, in the same run, on the same server; memory per resident adapter; throughput with 1, 4
and 16 resident adapters against the base alone.

- swap: a new adapter loaded at run time (`/v1/load_lora_adapter`, as `gateway/lora.py` does) against a full
  reload (pause(keep) → reload_weights → reset prefix cache → weight version → resume, as pool sync does), each
  while another stream is generating: the operation's time, and the longest gap between that stream's chunks
  while it ran (what a tenant that is not updated sees: the pause);
- memory: the server's resident memory (its processes' VmRSS added up) with 0 and with 16 adapters loaded and
  used, per adapter, beside the adapter folder's size;
- throughput: completion tokens per second of `--concurrency` clients, each request for the base, or for one of
  1, 4 or 16 adapters in turn; the four runs alternate for `--rounds` rounds and each reports its median, so a
  change of the machine's load during the bench weighs on all four alike.

    uv run python -m bench.lora_serving [--model smollm2|tiny] [--swaps 5] [--requests 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.report import Report
from bench.smollm2 import server_memory_gib

RANK = 8
ADAPTERS = 16
THROUGHPUT_ADAPTERS = (0, 1, 4, 16)
"""resident adapters the throughput runs spread their requests over; 0: the base alone"""
PROMPT = "Write a short story about a robot who learns to paint."


def model_folder(name: str, root: Path) -> Path:
    if name == "tiny":
        from agentstream.models.tiny_model import build_tiny_model

        return build_tiny_model(root / "tiny")
    from agentstream.models.smollm2 import build_smollm2, default_folder

    return build_smollm2(default_folder())


def make_adapters(base: Path, root: Path, count: int) -> list[Path]:
    """`count` PEFT adapters of rank `RANK` over `base` (the trainer's `with_lora`), each with its own B."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentstream.trainer.grpo import with_lora
    from agentstream.trainer.settings import TrainerSettings

    model = with_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                      TrainerSettings(model=base.name, lora_rank=RANK))
    folders = []
    for index in range(count):
        torch.manual_seed(index)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, 0.02)
        folders.append(root / f"adapter-{index}")
        model.save_pretrained(folders[-1])
    return folders


def rss_gib(pid: int) -> float:
    """VmRSS of the server and its children (engine core, worker), added up."""
    return server_memory_gib(pid, "VmRSS")


def complete(url: str, model: str, max_tokens: int = 32) -> int:
    response = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True})
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"])


def load(url: str, name: str, folder: Path) -> float:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/load_lora_adapter", timeout=600, json={"lora_name": name, "lora_path": str(folder)})
    response.raise_for_status()
    return (time.perf_counter() - started) * 1000


def full_reload(url: str, model_dir: Path, version: int) -> float:
    started = time.perf_counter()
    httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
    httpx.post(f"{url}/collective_rpc", timeout=600, json={
        "method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}}).raise_for_status()
    httpx.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=60).raise_for_status()
    httpx.post(f"{url}/update_weight_version", json={"new_version": str(version)}, timeout=60).raise_for_status()
    httpx.post(f"{url}/resume", timeout=60).raise_for_status()
    return (time.perf_counter() - started) * 1000


def under_stream(url: str, model: str, operation: Callable[[], float]) -> tuple[float, float]:
    """Run `operation` while a stream of `model` generates: (the operation's ms, the stream's longest gap between
    chunks while it ran, ms)."""
    arrivals: list[float] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=600, json={
                "model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "ignore_eos": True,
                "stream": True}) as response:
            for _ in response.iter_lines():
                arrivals.append(time.perf_counter())
                if len(arrivals) == 8:
                    started.set()

    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(stream)
        started.wait(600)
        begin = time.perf_counter()
        took = operation()
        end = time.perf_counter()
        streaming.result()
    window = [t for t in arrivals if t >= begin]
    gaps = [b - a for a, b in zip([begin, *window], window) if a <= end]
    if len(window) < 2 or window[-1] <= end:
        raise RuntimeError("the stream ended before the operation did: raise its max_tokens")
    return took, max(gaps) * 1000


def throughput(url: str, models: list[str], requests: int, concurrency: int) -> float:
    """Completion tokens per second of `concurrency` clients, request i for models[i % len(models)]."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda i: complete(url, models[i % len(models)]), range(requests)))
    return tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--swaps", type=int, default=5, help="adapter loads and full reloads (median reported)")
    parser.add_argument("--requests", type=int, default=32, help="requests per throughput run")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four throughput runs (medians reported)")
    parser.add_argument("--server", help="a running local vLLM (`agentstream vllm start ... --max-loras 16 "
                        "--max-lora-rank 8 --name NAME`) of the model to use (and leave running) instead of starting one")
    args = parser.parse_args(argv)

    from agentstream.stack.vllm import LocalVLLM, Lora

    report = Report("lora_serving")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = LocalVLLM(name=args.server or f"bench-lora-{args.model}")
        running = server.state() if args.server else None
        if args.server and running is None:
            raise SystemExit(f"no local vLLM server named {args.server!r} runs")
        model_dir = Path(running.details["model"]) if running else model_folder(args.model, root)
        base = running.details["served_name"] if running else "base"
        folders = make_adapters(model_dir, root, ADAPTERS + args.swaps)
        state = running or server.start(model_dir, served_name=base, timeout=1200, lora=Lora(
            max_loras=ADAPTERS, max_rank=RANK, max_cpu_loras=ADAPTERS + args.swaps))
        url = state.url
        try:
            complete(url, base, 4)
            rss_before = rss_gib(state.pid)
            names = [f"tenant-{i}@1" for i in range(ADAPTERS)]
            for name, folder in zip(names, folders):
                load(url, name, folder)
                complete(url, name, 2)  # used once: its weights are in the engine's slots, not only read
            rss_after = rss_gib(state.pid)
            folder_mib = sum(f.stat().st_size for f in folders[0].iterdir()) / 2**20

            rounds = [{count: throughput(url, names[:count] if count else [base], args.requests, args.concurrency)
                       for count in THROUGHPUT_ADAPTERS} for _ in range(args.rounds)]

            adapter_swaps = [under_stream(url, names[0], lambda i=i: load(url, f"tenant-0@{i + 2}", folders[ADAPTERS + i]))
                             for i in range(args.swaps)]
            reloads = [under_stream(url, names[0], lambda i=i: full_reload(url, model_dir, i + 1))
                       for i in range(args.swaps)]
        finally:
            if not running:
                server.stop()

    reload_ms = statistics.median(took for took, _ in reloads)
    reload_gap = statistics.median(gap for _, gap in reloads)
    load_ms = statistics.median(took for took, _ in adapter_swaps)
    load_gap = statistics.median(gap for _, gap in adapter_swaps)
    report.add(f"full weight reload of {args.model}, p50 (baseline)", f"{reload_ms:.0f} ms")
    report.add("adapter load at run time, p50", f"{load_ms:.0f} ms", load_ms / reload_ms)
    report.add("another tenant's longest stall during a full reload, p50 (baseline)", f"{reload_gap:.0f} ms")
    report.add("another tenant's longest stall during an adapter load, p50", f"{load_gap:.0f} ms",
               load_gap / reload_gap)
    per_adapter_mib = (rss_after - rss_before) * 1024 / ADAPTERS
    report.add(f"server RSS, base / with {ADAPTERS} adapters (rank {RANK}) used",
               f"{rss_before:.2f} / {rss_after:.2f} GiB")
    report.add("memory per resident adapter (RSS growth / 16)", f"{per_adapter_mib:.1f} MiB (folder {folder_mib:.1f} MiB)")
    runs = {count: statistics.median(run[count] for run in rounds) for count in THROUGHPUT_ADAPTERS}
    base_tps = runs.pop(0)
    report.add(f"throughput, base alone, {args.concurrency} clients, median of {args.rounds} (baseline)",
               f"{base_tps:.0f} tok/s")
    for count, tps in runs.items():
        report.add(f"throughput, requests over {count} resident adapter{'s' if count > 1 else ''}",
                   f"{tps:.0f} tok/s", tps / base_tps)
    report.details.update(adapter_swaps_ms=adapter_swaps, full_reloads_ms=reloads, base_tok_s=base_tps,
                          adapters_tok_s=runs, throughput_rounds_tok_s=rounds, rss_gib={"base": rss_before, "adapters": rss_after})
    report.print()


if __name__ == "__main__":
    main()

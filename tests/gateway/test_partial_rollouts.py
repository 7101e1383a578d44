"""Partial rollouts on a real vLLM server: a long streamed answer in flight across a weight update goes on
with the new weights (the update does not wait for it), and its call event says at which token the
version changed. Greedy sampling makes the boundary checkable: the tokens before it are the old weights'
greedy answer, those after it the new weights' greedy continuation of the same prefix."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.gateway.test_pool_sync import weights
from tests.support.gateway import gateway_settings, read_events, running_gateway

# heavy, not in `make test`: whether the update lands inside the answer depends on the machine's speed (it passed
# at load 50 and idle, and failed in a clean-clone run): a deterministic form is owed (#47)
pytestmark = [pytest.mark.vllm, pytest.mark.heavy, pytest.mark.timeout(1500)]

ANSWER_TOKENS = 1900
"""long enough that the update (a pause, the tiny model's reload, a resume) lands while it streams: the tiny
model generates ~400 tokens/s on an idle machine, and its context holds 2,048"""
CHECKED_AFTER = 100
"""tokens after the switch compared with the new weights' own continuation"""


def served_version(vllm_server) -> str | None:
    """The version the server labels its weights with; None while it cannot say (it answers after a reload)."""
    try:
        return httpx.get(f"{vllm_server.url}/weight_info", timeout=60).json()["weight_version"]
    except httpx.HTTPError:
        return None


def greedy(vllm_server, prompt: list[int], tokens: int) -> list[int]:
    """The server's greedy answer to a prompt of token ids, as token ids."""
    response = httpx.post(f"{vllm_server.url}/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    response.raise_for_status()
    return list(response.json()["choices"][0]["token_ids"])


async def test_a_stream_in_flight_goes_on_with_the_new_weights_and_records_where(kafka, vllm_server):
    settings = gateway_settings(kafka, [f"tiny={vllm_server.url}"], partial_rollouts=True, drain_timeout_s=300)
    async with running_gateway(settings) as gw:
        pool = gw.gateway.pool
        old = pool.upstreams[vllm_server.url].weight_version
        assert old is not None
        new = old + 1
        received: list[int] = []
        text: list[str] = []
        swapped_at: int | None = None  # tokens the client had when it could see the server switched under its call
        update: asyncio.Task | None = None
        try:
            stream = await gw.openai().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "tell me a long story"}], stream=True,
                max_tokens=ANSWER_TOKENS, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
            finish = None
            async for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                received += (choice.model_extra or {}).get("token_ids") or []
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
                if update is None and len(received) >= 50:  # as the applying replica does on a weights event
                    update = asyncio.create_task(gw.gateway.sync.apply(weights("tiny", new, vllm_server.other_checkpoint)))
                # the switch, not the update task's end: that also waits for Kafka to acknowledge its pool event
                if swapped_at is None and any(c.switches for c in pool.followed.get(vllm_server.url, ())):
                    swapped_at = len(received)
            assert update is not None
            [applied] = await update
            assert applied.status == "ok" and pool.upstreams[vllm_server.url].weight_version == new
            assert finish == "length" and len(received) == ANSWER_TOKENS, "the answer was cut short"
            assert swapped_at is not None and swapped_at < ANSWER_TOKENS, \
                "the update waited for the answer to finish instead of going on under it"

            [event] = [e for e in await read_events(kafka, kafka.topics.calls, count=1)]
            call = event.data
            assert call.status == 200 and call.completion_token_ids == received, \
                "the event records other tokens than the client received"
            assert call.response is not None and call.response["choices"][0]["message"]["content"] == "".join(text)
            assert call.logprobs is not None and len(call.logprobs) == ANSWER_TOKENS
            assert call.weight_version == old
            [before, after] = call.weight_segments
            assert (before.version, before.start) == (old, 0) and after.version == new
            switch = after.start
            # (the relay counts a token before the client reads it, so the switch may be past `swapped_at`; the
            # greedy checks below pin it to the token)
            assert 50 <= switch < ANSWER_TOKENS, f"the switch at token {switch} is outside the answer"

            # the new weights' greedy continuation of the same prefix is what the answer went on with
            prompt = call.prompt_token_ids
            assert prompt
            assert served_version(vllm_server) == str(new)
            continued = greedy(vllm_server, prompt + received[:switch], CHECKED_AFTER)
            assert received[switch: switch + CHECKED_AFTER] == continued, "tokens after the switch are not the new weights'"
        finally:
            if update is not None:
                await asyncio.gather(update, return_exceptions=True)
            [restored] = await gw.gateway.sync.apply(weights("tiny", new + 1, vllm_server.model_dir))
            assert restored.status == "ok" and served_version(vllm_server) == str(new + 1)
        # and those before it are the old weights' greedy answer (the same weights, as version new + 1)
        assert received[:switch] == greedy(vllm_server, prompt, switch), "tokens before the switch are not the old weights'"
        old_went_on = greedy(vllm_server, prompt + received[:switch], CHECKED_AFTER)
        assert old_went_on != continued, "the two checkpoints answer alike: the test cannot tell the versions apart"

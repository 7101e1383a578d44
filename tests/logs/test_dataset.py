"""`dataset.chat_messages`: a call's conversation in a dataset row is what the gateway sent the model
(its own conversion, `schemas.conversation`), then the answer as a chat message."""

from __future__ import annotations

from typing import Any

import agentstream.schemas as s
from agentstream.gateway.messages import request as messages_request
from agentstream.gateway.responses import request as responses_request
from agentstream.logs.replay.dataset import chat_messages


def call(api: Any, request: dict[str, Any], response: dict[str, Any] | None, status: int = 200) -> s.Call:
    return s.Call(api=api, model="tiny", request={"model": "tiny", **request}, response=response, status=status,
                  started_at=1_700_000_000_000, latency_ms=1.0)


def test_a_messages_call_is_the_chat_the_gateway_sent_then_the_answer() -> None:
    request = {"max_tokens": 64, "system": "sys", "messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]}]}
    answer = {"content": [{"type": "thinking", "thinking": "read it"},
                          {"type": "tool_use", "id": "t2", "name": "cat", "input": {"path": "a.py"}}]}
    sent = messages_request.to_chat({"model": "tiny", **request})["messages"]
    assert chat_messages(call("messages", request, answer)) == [*sent, {
        "role": "assistant", "reasoning": "read it",
        "tool_calls": [{"id": "t2", "type": "function", "function": {"name": "cat", "arguments": '{"path": "a.py"}'}}]}]
    assert sent[-1] == {"role": "tool", "tool_call_id": "t1", "content": "a.py"}  # converted, not Anthropic blocks


def test_a_responses_call_is_the_chat_the_gateway_sent_then_the_answer() -> None:
    request = {"instructions": "be brief", "input": [
        {"role": "user", "content": "fix it"},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x = 1"}]}
    answer = {"output": [{"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": "done", "annotations": []}]}]}
    sent = responses_request.to_chat({"model": "tiny", **request})["messages"]
    assert chat_messages(call("responses", request, answer)) == [*sent, {"role": "assistant", "content": "done"}]
    assert [message["role"] for message in sent] == ["system", "user", "assistant", "tool"]  # the call kept


def test_a_call_without_a_conversation_has_no_messages() -> None:
    refused = call("responses", {"input": [{"type": "item_reference", "id": "r"}]}, None, status=400)
    assert chat_messages(refused) is None
    assert chat_messages(call("completions", {"prompt": "2+2="}, {"choices": [{"text": "4"}]})) is None
    failed = call("messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, None, status=502)
    assert chat_messages(failed) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]

"""`schemas.conversation`: Responses and Anthropic Messages conversations as chat messages, the one
conversion the gateway sends upstream and replay's dataset rows show; input that is not a conversation
is a `BadConversation` naming where."""

from __future__ import annotations

import json

import pytest

from agentstream.schemas.conversation import BadConversation, anthropic_messages, flat_name, responses_messages
from agentstream.schemas.errors import DecodeError


def test_responses_items_become_chat_messages() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "fix it"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look first"}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "fs", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "x = 1"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]
    assert responses_messages("be brief", items) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "reasoning": "look first", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "fs__read", "arguments": "{}"}},
            {"id": "c2", "type": "function",
             "function": {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
        {"role": "assistant", "content": "done"},
    ]
    assert responses_messages(None, "hi") == [{"role": "user", "content": "hi"}]
    assert flat_name("read", "fs") == "fs__read" and flat_name("read", None) == "read"


def test_anthropic_messages_become_chat_messages() -> None:
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2"}, {"type": "text", "text": "sys"}]
    messages = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "ls"}, {"type": "text", "text": "running"},
            {"type": "tool_use", "id": "t1", "name": "bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a.py"}]},
            {"type": "text", "text": "now read it"}]},
    ]
    assert anthropic_messages(system, messages) == [
        {"role": "system", "content": "sys"},  # the per-request billing block left out: every prefix stays the same
        {"role": "user", "content": "list files"},
        {"role": "assistant", "reasoning": "ls", "content": "running", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a.py"},  # before the rest of its user turn
        {"role": "user", "content": "now read it"},
    ]


@pytest.mark.parametrize(("convert", "args", "message"), [
    (responses_messages, (None, [{"type": "item_reference", "id": "r"}]), "input[0]: item references need stored"),
    (responses_messages, (None, [{"role": "tool", "content": "x"}]), "input[0].role must be one of user"),
    (responses_messages, (None, [{"role": "user", "content": [{"type": "input_file"}]}]),
     "input[0].content[0]: content parts of type 'input_file'"),
    (responses_messages, (7, "hi"), "instructions must be a string, not an integer"),
    (anthropic_messages, (None, []), "'messages' is required"),
    (anthropic_messages, (None, [{"role": "user", "content": [{"type": "document"}]}]),
     "messages[0].content[0]: content blocks of type 'document'"),
    (anthropic_messages, ([{"type": "image"}], [{"role": "user", "content": "x"}]),
     "system[0]: system blocks must be text blocks"),
])
def test_what_is_not_a_conversation_is_named(convert, args, message) -> None:
    with pytest.raises(BadConversation, match=None) as raised:
        convert(*args)
    assert str(raised.value).startswith(message)
    assert isinstance(raised.value, DecodeError) and raised.value.field

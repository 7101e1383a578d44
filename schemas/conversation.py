"""A Responses or Anthropic Messages conversation as chat messages, the way vLLM's servers build them.

One conversion for both of its users: the gateway sends the chat messages upstream (the tokens a call
records are the chat path's), and a replay's dataset rows show the same messages. It lives below both
because the layers let neither import the other.

Responses input items (`responses_messages`): instructions are a leading system message; a function call
joins the assistant message before it; a function call output is a `tool` message. Messages
(`anthropic_messages`): the system prompt, less Claude Code's per-request `x-anthropic-billing-header`
block (it would change every turn's prefix), is one leading system message; `tool_use` blocks are the
assistant message's tool calls (arguments as `json.dumps(input)`); each `tool_result` is a `tool`
message, before the rest of its user turn; thinking is the assistant message's `reasoning`.

Input that is not a conversation raises `BadConversation` naming where and why (the gateway answers it
as a 400).
"""

from __future__ import annotations

import json
from typing import Any

from agentstream.schemas.errors import DecodeError

Message = dict[str, Any]
SEPARATOR = "__"
"""between a Responses tool's namespace and its name in the flat name the model sees (as Claude Code's
`mcp__server__tool`)"""
_BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"})


class BadConversation(DecodeError):
    """A request's conversation that cannot be read as chat messages; the message names where and why."""


def kind_of(value: Any) -> str:
    """A JSON value's kind, as an error message names it ("an object", "a list", "null"...)."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def flat_name(name: str, namespace: str | None) -> str:
    """The one name the model sees for a Responses tool in a namespace."""
    return f"{namespace}{SEPARATOR}{name}" if namespace else name


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadConversation(f"{where} must be an object, not {kind_of(value)}", where)
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadConversation(f"{where} must be a list, not {kind_of(value)}", where)
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadConversation(f"{where} must be a string, not {kind_of(value)}", where)
    return value


# --- Responses input items ---------------------------------------------------------------------

def responses_messages(instructions: Any, items: Any) -> list[Message]:
    """The chat messages of a Responses request's `instructions` and `input` (a string or a list of items);
    also of a response's `output` items (instructions None), which become assistant messages."""
    messages: list[Message] = []
    if instructions:
        messages.append({"role": "system", "content": _text(instructions, "instructions")})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for index, item in enumerate(_list(items, "input")):
        where = f"input[{index}]"
        item = _object(item, where)
        kind = item.get("type") or ("message" if "role" in item else None)
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            _add_message(messages, last, item, where)
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, last, item, where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{where}.call_id"),
                             "content": content})
        elif kind == "reasoning":
            _add_reasoning(messages, last, item, where)
        elif kind == "item_reference":
            raise BadConversation(f"{where}: item references need stored responses, which this gateway does not "
                                  "keep; send the items themselves", where)
        else:
            raise BadConversation(f"{where}: input items of type {kind!r} are not supported by this gateway "
                                  "(it serves messages, function and custom tool calls and their outputs, and "
                                  "reasoning)", where)
    return messages


def _add_call(messages: list[Message], last: Message | None, item: dict[str, Any], where: str) -> None:
    """A function or custom tool call: it belongs to the assistant turn before it, if there is one."""
    arguments = (_text(item.get("arguments", ""), f"{where}.arguments") if item.get("type") == "function_call"
                 else json.dumps({"input": _text(item.get("input"), f"{where}.input")}))
    namespace = item.get("namespace")
    name = flat_name(_text(item.get("name"), f"{where}.name"),
                     _text(namespace, f"{where}.namespace") if namespace is not None else None)
    call = {"id": _text(item.get("call_id"), f"{where}.call_id"), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if last is not None:
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _add_reasoning(messages: list[Message], last: Message | None, item: dict[str, Any], where: str) -> None:
    text = _parts_text(item.get("content") or item.get("summary") or [], f"{where}.content")
    if not text:
        return  # only encrypted content, which no model served here produced
    if last is not None and not last.get("reasoning"):
        last["reasoning"] = text
    else:
        messages.append({"role": "assistant", "reasoning": text})


def _add_message(messages: list[Message], last: Message | None, item: dict[str, Any], where: str) -> None:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise BadConversation(f"{where}.role must be one of user, assistant, system, developer; not {role!r}",
                              f"{where}.role")
    content = item.get("content")
    if role == "assistant":
        text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
        if last is not None and last.get("content") is None:
            last["content"] = text  # the text of an assistant turn that began with its reasoning
        else:
            messages.append({"role": "assistant", "content": text})
        return
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    parts = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(_list(content, f"{where}.content"))]
    if len(parts) == 1 and parts[0]["type"] == "text":
        messages.append({"role": role, "content": parts[0]["text"]})
    else:
        messages.append({"role": role, "content": parts})


def _part(part: Any, where: str) -> dict[str, Any]:
    part = _object(part, where)
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        return {"type": "text", "text": _text(part.get("text", part.get("refusal")), f"{where}.text")}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail") or "auto"}}
    raise BadConversation(f"{where}: content parts of type {kind!r} are not supported by this gateway "
                          "(text, and images given by URL, are)", where)


def _parts_text(parts: Any, where: str) -> str:
    """The text of a list of text parts (the output of a tool, an assistant turn's content)."""
    if parts is None:
        return ""
    return "".join(_part(part, f"{where}[{i}]")["text"] for i, part in enumerate(_list(parts, where)))


# --- Anthropic Messages ------------------------------------------------------------------------

def anthropic_messages(system: Any, messages: Any) -> list[Message]:
    """The chat messages of a Messages request's `system` and `messages`; also of a response's `content`
    (as one assistant message), whose text, thinking and tool_use blocks become the assistant message's."""
    out: list[Message] = []
    if system:
        text = system if isinstance(system, str) else _system_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise BadConversation("'messages' is required: a non-empty list of {role, content} messages", "messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        message = _object(message, where)
        role = message.get("role")
        content = message.get("content")
        if role == "system":  # vLLM's extension: a system message within the conversation
            text = content if isinstance(content, str) else _system_text(content, f"{where}.content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise BadConversation(f"{where}.role must be 'user' or 'assistant', not {role!r}", f"{where}.role")
        chat: Message = {"role": role}
        if isinstance(content, str):
            chat["content"] = content
        else:
            _blocks(_list(content, f"{where}.content"), chat, out, where)
        if not (role == "user" and "content" not in chat):  # a user turn of tool results alone is those results
            out.append(chat)
    return out


def _system_text(blocks: Any, where: str) -> str:
    texts = []
    for index, block in enumerate(_list(blocks, where)):
        block = _object(block, f"{where}[{index}]")
        if block.get("type") != "text":
            raise BadConversation(f"{where}[{index}]: system blocks must be text blocks, not {block.get('type')!r}",
                                  f"{where}[{index}]")
        text = _text(block.get("text"), f"{where}[{index}].text")
        if not text.startswith(_BILLING_HEADER):
            texts.append(text)
    return "".join(texts)


def _blocks(blocks: list[Any], chat: Message, out: list[Message], where: str) -> None:
    """One message's content blocks into `chat`; its tool results into `out`, as `tool` messages before it."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        block = _object(block, at)
        kind = block.get("type")
        if kind == "text":
            if _text(block.get("text"), f"{at}.text"):
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "thinking":
            reasoning.append(_text(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque, and never produced by a model served here
        elif kind == "tool_use":
            calls.append({"id": _text(block.get("id"), f"{at}.id"), "type": "function",
                          "function": {"name": _text(block.get("name"), f"{at}.name"),
                                       "arguments": json.dumps(_object(block.get("input", {}), f"{at}.input"))}})
        elif kind == "tool_result":
            _tool_result(block, chat["role"], parts, out, at)
        else:
            raise BadConversation(f"{at}: content blocks of type {kind!r} are not supported by this gateway "
                                  "(text, image, tool_use, tool_result, thinking are)", at)
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _tool_result(block: dict[str, Any], role: str, parts: list[dict[str, Any]], out: list[Message],
                 where: str) -> None:
    content = block.get("content")
    images: list[str] = []
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        texts = []
        for index, item in enumerate(_list(content, f"{where}.content")):
            item = _object(item, f"{where}.content[{index}]")
            if item.get("type") == "text":
                texts.append(_text(item.get("text"), f"{where}.content[{index}].text"))
            elif item.get("type") == "image":
                images.append(_image_url(item.get("source"), f"{where}.content[{index}]"))
            else:
                raise BadConversation(f"{where}.content[{index}]: tool results hold text and image blocks, "
                                      f"not {item.get('type')!r}", f"{where}.content[{index}]")
        text = "\n".join(texts)
    if role != "user":  # vLLM's reading of a tool result in an assistant turn
        parts.append({"type": "text", "text": f"Tool result: {text}"})
        return
    out.append({"role": "tool", "tool_call_id": _text(block.get("tool_use_id", ""), f"{where}.tool_use_id"),
                "content": text})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]})


def _image_url(source: Any, where: str) -> str:
    source = _object(source, f"{where}.source")
    if source.get("type") == "url":
        return _text(source.get("url"), f"{where}.source.url")
    if source.get("type") == "base64":
        data = _text(source.get("data"), f"{where}.source.data")
        return f"data:{source.get('media_type', 'image/jpeg')};base64,{data}"
    raise BadConversation(f"{where}.source: images are given as base64 or url sources, not {source.get('type')!r}",
                          f"{where}.source")

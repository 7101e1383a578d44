"""A Messages request as a chat completions request, the way vLLM's own /v1/messages translates it.

The system prompt (less Claude Code's per-request `x-anthropic-billing-header` block, which would
change every turn's prefix) is one leading system message; `tool_use` blocks are the assistant
message's tool calls (arguments as `json.dumps(input)`); each `tool_result` is a `tool` message,
before the rest of its user turn; thinking is the assistant message's `reasoning`. Unlike vLLM,
a final assistant message is a prefill the answer continues, as the Messages API defines. Fields
the Messages API does not define (vLLM's `seed`, `allowed_token_ids`...) pass through to the
chat request.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from agentstream.gateway import fields
from agentstream.gateway.adapter import Body
from agentstream.gateway.fields import bad_request, list_of, object_of, text_of
from agentstream.gateway.translation import note_dropped

if TYPE_CHECKING:  # the SDK's shapes, for the type checker only
    from openai.types.chat import ChatCompletionFunctionToolParam
    from openai.types.shared_params import FunctionDefinition

_BILLING_HEADER = "x-anthropic-billing-header"
# the Messages API's own fields: translated below, or (no chat equivalent) not sent upstream
_MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
    "tool_choice", "thinking", "output_config", "stream", "metadata", "service_tier", "cache_control", "container",
    "inference_geo", "speed", "diagnostics", "user_profile_id", "workspace_id", "context_management", "mcp_servers",
})

_SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_")
"""type prefixes of Anthropic's server tools (`web_search_20250305`, …)"""
# what of the chat request vLLM's /tokenize takes to render the same prompt
_TOKENIZE_FIELDS = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs")



def check(body: Body) -> None:
    """A 400 for each field of a Messages request the gateway or vLLM reads, if it is malformed."""
    fields.flag(body, "stream")
    fields.number(body, "temperature", 0, 1)
    fields.number(body, "top_p", 0, 1)
    fields.integer(body, "top_k", 0)
    fields.texts(body, "stop_sequences")
    fields.optional_object(body, "metadata")
    fields.integer(body, "seed", -(2**63), 2**64 - 1)
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise bad_request(f"'system' must be a string or a list of text blocks, not {type(system).__name__}")


def to_chat(body: Body) -> Body:
    if body.get("mcp_servers"):
        raise bad_request("'mcp_servers' is not supported by this gateway: give the agent the tools itself")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request(f"'max_tokens' is required: a positive integer, not {max_tokens!r}")
    chat = {key: value for key, value in body.items() if key not in _MESSAGES_FIELDS}
    chat["model"] = body["model"]
    chat["max_tokens"] = max_tokens
    chat["messages"] = _messages(body.get("system"), body.get("messages"))
    last = chat["messages"][-1]
    if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
        # a prefill: the answer continues the assistant's text
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    for ours, theirs in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools"):
        tools = [object_of(tool, f"tools[{i}]") for i, tool in enumerate(list_of(body["tools"], "tools"))]
        kept = [(tool, f"tools[{i}]") for i, tool in enumerate(tools) if not _is_server_tool(tool)]
        if kept:
            chat["tools"] = [_tool(tool, where) for tool, where in kept]
    if body.get("tool_choice") is not None and (body.get("tools") is None or "tools" in chat):
        _tool_choice(object_of(body["tool_choice"], "tool_choice"), chat)
    _thinking(body, chat)
    if body.get("stream") is True:
        chat["stream"] = True
        # usage on every chunk: message_start tells the input tokens, message_delta the output tokens
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def tokenize_request(body: Body) -> Body:
    """The upstream `/tokenize` request for a `count_tokens` body: the prompt of the chat request a
    `/v1/messages` call with this body sends (count_tokens has no `max_tokens`; it changes no prompt)."""
    chat = to_chat({**body, "max_tokens": 1})
    return {key: chat[key] for key in _TOKENIZE_FIELDS if key in chat}


def _messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        text = system if isinstance(system, str) else _system_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of {role, content} messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        message = object_of(message, where)
        role = message.get("role")
        content = message.get("content")
        if role == "system":  # vLLM's extension: a system message within the conversation
            text = content if isinstance(content, str) else _system_text(content, f"{where}.content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant', not {role!r}")
        chat: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            chat["content"] = content
        else:
            _blocks(list_of(content, f"{where}.content"), chat, out, where)
        if not (role == "user" and "content" not in chat):  # a user turn of tool results alone is those results
            out.append(chat)
    return out


def _system_text(blocks: Any, where: str) -> str:
    texts = []
    for index, block in enumerate(list_of(blocks, where)):
        block = object_of(block, f"{where}[{index}]")
        if block.get("type") != "text":
            raise bad_request(f"{where}[{index}]: system blocks must be text blocks, not {block.get('type')!r}")
        text = text_of(block.get("text"), f"{where}[{index}].text")
        if not text.startswith(_BILLING_HEADER):
            texts.append(text)
    return "".join(texts)


def _blocks(blocks: list[Any], chat: dict[str, Any], out: list[dict[str, Any]], where: str) -> None:
    """One message's content blocks into `chat`; its tool results into `out`, as `tool` messages before it."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        block = object_of(block, at)
        kind = block.get("type")
        if kind == "text":
            if text_of(block.get("text"), f"{at}.text"):
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "thinking":
            reasoning.append(text_of(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque, and never produced by a model served here
        elif kind == "tool_use":
            calls.append({"id": text_of(block.get("id"), f"{at}.id"), "type": "function",
                          "function": {"name": text_of(block.get("name"), f"{at}.name"),
                                       "arguments": json.dumps(object_of(block.get("input", {}), f"{at}.input"))}})
        elif kind == "tool_result":
            _tool_result(block, chat["role"], parts, out, at)
        else:
            raise bad_request(f"{at}: content blocks of type {kind!r} are not supported by this gateway "
                              "(text, image, tool_use, tool_result, thinking are)")
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _tool_result(block: dict[str, Any], role: str, parts: list[dict[str, Any]], out: list[dict[str, Any]],
                 where: str) -> None:
    content = block.get("content")
    images: list[str] = []
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        texts = []
        for index, item in enumerate(list_of(content, f"{where}.content")):
            item = object_of(item, f"{where}.content[{index}]")
            if item.get("type") == "text":
                texts.append(text_of(item.get("text"), f"{where}.content[{index}].text"))
            elif item.get("type") == "image":
                images.append(_image_url(item.get("source"), f"{where}.content[{index}]"))
            else:
                raise bad_request(f"{where}.content[{index}]: tool results hold text and image blocks, "
                                  f"not {item.get('type')!r}")
        text = "\n".join(texts)
    if role != "user":  # vLLM's reading of a tool result in an assistant turn
        parts.append({"type": "text", "text": f"Tool result: {text}"})
        return
    out.append({"role": "tool", "tool_call_id": text_of(block.get("tool_use_id", ""), f"{where}.tool_use_id"),
                "content": text})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]})


def _image_url(source: Any, where: str) -> str:
    source = object_of(source, f"{where}.source")
    if source.get("type") == "url":
        return text_of(source.get("url"), f"{where}.source.url")
    if source.get("type") == "base64":
        data = text_of(source.get("data"), f"{where}.source.data")
        return f"data:{source.get('media_type', 'image/jpeg')};base64,{data}"
    raise bad_request(f"{where}.source: images are given as base64 or url sources, not {source.get('type')!r}")


def _is_server_tool(tool: dict[str, Any]) -> bool:
    """A tool Anthropic's servers run (web search, web fetch, code execution): no model behind this gateway
    can use one, so it is left out of what the model sees (as hosted tools of the Responses API are)."""
    kind = tool.get("type")
    if isinstance(kind, str) and kind.startswith(_SERVER_TOOLS):
        note_dropped(kind)
        return True
    return False


def _tool(tool: dict[str, Any], where: str) -> ChatCompletionFunctionToolParam:
    if tool.get("type") not in (None, "custom"):
        raise bad_request(f"{where}: Anthropic-defined tools ({tool.get('type')!r}) are not supported by this "
                          "gateway; define the tool with a name and an input_schema")
    schema = dict(object_of(tool.get("input_schema"), f"{where}.input_schema"))
    schema.setdefault("type", "object")
    function: FunctionDefinition = {"name": text_of(tool.get("name"), f"{where}.name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = text_of(tool["description"], f"{where}.description")
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        name = text_of(choice.get("name"), "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none, not {kind!r}")
    if choice.get("disable_parallel_tool_use") is not None:
        chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]


def _thinking(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """Extended thinking and output settings, as vLLM maps them."""
    thinking = object_of(body.get("thinking") or {}, "thinking")
    if thinking.get("type") == "enabled":
        chat["thinking_token_budget"] = thinking.get("budget_tokens")
    elif thinking.get("type") == "disabled":
        chat["reasoning_effort"] = "none"
    config = object_of(body.get("output_config") or {}, "output_config")
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    form = object_of(config.get("format") or {}, "output_config.format")
    if form.get("schema") is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                          "schema": form["schema"]}}


"""A Responses request as a chat completions request: input items to chat messages, tools, settings.

Input items become chat messages the way vLLM's Responses server builds them (instructions as a
leading system message; a function call joins the assistant message before it; a function call
output is a `tool` message). Tools are translated by `gateway.responses.tools`: function and custom
tools, namespaces flattened, hosted tools (web_search...) left out. `previous_response_id`,
`conversation` and prompt templates need state the gateway does not have, and are a 400. Fields the
Responses API does not define (vLLM's `seed`, `top_k`, `allowed_token_ids`...) pass through to the
chat request.
"""

from __future__ import annotations

import json
from typing import Any

from agentstream.gateway import fields
from agentstream.gateway.adapter import Body
from agentstream.gateway.fields import bad_request, list_of, object_of, text_of
from agentstream.gateway.responses.tools import chat_tools, flat_name

LOGPROBS = "message.output_text.logprobs"
# fields that need what a stateless proxy in front of vLLM cannot give
_NEEDS_STATE = {
    "previous_response_id": "send the whole conversation as `input` instead (and store=false)",
    "conversation": "send the whole conversation as `input` instead",
    "prompt": "send the prompt's text as `instructions` and `input` instead",
}
# the Responses API's own fields: translated below, or (no chat equivalent) echoed in the response only
_RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "reasoning", "include", "top_logprobs", "user", "stream", "store", "metadata",
    "truncation", "service_tier", "stream_options", "max_tool_calls", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "safety_identifier", "background", "background_options", "context_management",
    "access_programs", "moderation", "image", "client_metadata", *_NEEDS_STATE,
})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"})


def check(body: Body) -> None:
    """A 400 for each field of a Responses request the gateway or vLLM reads, if it is malformed."""
    fields.flag(body, "stream")
    fields.integer(body, "max_output_tokens", 1)
    fields.number(body, "temperature", 0, 2)
    fields.number(body, "top_p", 0, 1)
    fields.integer(body, "top_logprobs", 0, 20)
    fields.flag(body, "parallel_tool_calls")
    fields.optional_text(body, "instructions")
    fields.optional_text(body, "user")
    for index, value in enumerate(list_of(body.get("include") or [], "'include'")):
        text_of(value, f"include[{index}]")
    fields.optional_object(body, "reasoning")
    fields.optional_object(body, "text")
    fields.optional_object(body, "metadata")
    fields.integer(body, "seed", -(2**63), 2**64 - 1)


def to_chat(body: Body) -> Body:
    for name, instead in _NEEDS_STATE.items():
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported by this gateway: {instead}")
    if body.get("background"):
        raise bad_request("'background' is not supported by this gateway: make the request without it")
    if "input" not in body:
        raise bad_request("'input' is required: the conversation so far, as a string or a list of items")
    chat = {key: value for key, value in body.items() if key not in _RESPONSES_FIELDS}
    chat["model"] = body["model"]
    chat["messages"] = _messages(body.get("instructions"), body["input"])
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools") and (tools := chat_tools(body["tools"])):
        chat["tools"] = tools
    if body.get("tool_choice") is not None and "tools" in chat:  # (none left when all were hosted)
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = (object_of(body.get("reasoning") or {}, "reasoning")).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if LOGPROBS in (body.get("include") or []):
        chat["logprobs"] = True
        if body.get("top_logprobs"):
            chat["top_logprobs"] = body["top_logprobs"]
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
    return chat


# --- input items to chat messages --------------------------------------------------------------

def _messages(instructions: Any, items: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": text_of(instructions, "instructions")})
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    for index, item in enumerate(list_of(items, "input")):
        where = f"input[{index}]"
        item = object_of(item, where)
        kind = item.get("type") or ("message" if "role" in item else None)
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            _add_message(messages, last, item, where)
        elif kind in ("function_call", "custom_tool_call"):
            _add_call(messages, last, item, where)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": text_of(item.get("call_id"), f"{where}.call_id"),
                             "content": content})
        elif kind == "reasoning":
            _add_reasoning(messages, last, item, where)
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references need stored responses, which this gateway does not keep; "
                              "send the items themselves")
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported by this gateway "
                              "(it serves messages, function and custom tool calls and their outputs, and "
                              "reasoning)")
    return messages


def _add_call(messages: list[dict[str, Any]], last: dict[str, Any] | None, item: dict[str, Any], where: str) -> None:
    """A function or custom tool call: it belongs to the assistant turn before it, if there is one."""
    arguments = (text_of(item.get("arguments", ""), f"{where}.arguments") if item.get("type") == "function_call"
                 else json.dumps({"input": text_of(item.get("input"), f"{where}.input")}))
    namespace = item.get("namespace")
    name = flat_name(text_of(item.get("name"), f"{where}.name"),
                     text_of(namespace, f"{where}.namespace") if namespace is not None else None)
    call = {"id": text_of(item.get("call_id"), f"{where}.call_id"), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if last is not None:
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _add_reasoning(messages: list[dict[str, Any]], last: dict[str, Any] | None, item: dict[str, Any],
                   where: str) -> None:
    text = _text(item.get("content") or item.get("summary") or [], f"{where}.content")
    if not text:
        return  # only encrypted content, which no model served here produced
    if last is not None and not last.get("reasoning"):
        last["reasoning"] = text
    else:
        messages.append({"role": "assistant", "reasoning": text})


def _add_message(messages: list[dict[str, Any]], last: dict[str, Any] | None, item: dict[str, Any],
                 where: str) -> None:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{where}.role must be one of user, assistant, system, developer; not {role!r}")
    content = item.get("content")
    if role == "assistant":
        text = content if isinstance(content, str) else _text(content, f"{where}.content")
        if last is not None and last.get("content") is None:
            last["content"] = text  # the text of an assistant turn that began with its reasoning
        else:
            messages.append({"role": "assistant", "content": text})
        return
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    parts = [_part(part, f"{where}.content[{i}]") for i, part in enumerate(list_of(content, f"{where}.content"))]
    if len(parts) == 1 and parts[0]["type"] == "text":
        messages.append({"role": role, "content": parts[0]["text"]})
    else:
        messages.append({"role": role, "content": parts})


def _part(part: Any, where: str) -> dict[str, Any]:
    part = object_of(part, where)
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        return {"type": "text", "text": text_of(part.get("text", part.get("refusal")), f"{where}.text")}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail") or "auto"}}
    raise bad_request(f"{where}: content parts of type {kind!r} are not supported by this gateway "
                      "(text, and images given by URL, are)")


def _text(parts: Any, where: str) -> str:
    """The text of a list of text parts (the output of a tool, an assistant turn's content)."""
    if parts is None:
        return ""
    return "".join(_part(part, f"{where}[{i}]")["text"] for i, part in enumerate(list_of(parts, where)))


def _tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"),
                                                                                                  str):
        namespace = choice.get("namespace")
        return {"type": "function",
                "function": {"name": flat_name(choice["name"], namespace if isinstance(namespace, str) else None)}}
    raise bad_request(f"tool_choice {choice!r} is not supported by this gateway: use 'none', 'auto', 'required' "
                      "or {'type': 'function' or 'custom', 'name': ...}")


def _response_format(text: Any) -> dict[str, Any] | None:
    form = object_of(text, "text").get("format") if text else None
    if not form or form.get("type") == "text":
        return None
    if form.get("type") == "json_object":
        return {"type": "json_object"}
    if form.get("type") == "json_schema":
        schema = {key: form[key] for key in ("name", "schema", "strict", "description") if key in form}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format of type {form.get('type')!r} is not supported: use text, json_object or "
                      "json_schema")


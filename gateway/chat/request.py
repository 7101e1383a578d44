"""A chat completions request: its fields checked, and rewritten to ask for token ids and logprobs."""

from __future__ import annotations

from typing import Any

from agentstream.gateway import fields
from agentstream.gateway.adapter import Body, Rewrite
from agentstream.gateway.fields import bad_request, list_of, object_of

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_TOOL_CHOICES = frozenset({"none", "auto", "required"})


def check(body: Body) -> None:
    """A 400 for each field of a chat completions request the gateway or vLLM reads, if it is malformed."""
    check_sampling(body)
    messages = body.get("messages")
    if not isinstance(messages, list):  # (an empty one is well-formed: the upstream's template decides)
        raise bad_request("'messages' is required: a list of {role, content} messages")
    for index, message in enumerate(messages):
        check_message(object_of(message, f"messages[{index}]"), f"messages[{index}]")
    fields.integer(body, "max_completion_tokens", 1)
    fields.flag(body, "logprobs")
    fields.integer(body, "top_logprobs", 0, 20)
    fields.flag(body, "parallel_tool_calls")
    fields.number(body, "presence_penalty", -2, 2)
    fields.number(body, "frequency_penalty", -2, 2)
    check_tools(body)


def check_sampling(body: Body) -> None:
    """The fields chat completions and completions share."""
    fields.flag(body, "stream")
    options = fields.optional_object(body, "stream_options")
    if options is not None:
        fields.flag(options, "include_usage")
        fields.flag(options, "continuous_usage_stats")
    fields.integer(body, "n", 1)
    fields.integer(body, "max_tokens", 1)
    fields.number(body, "temperature", 0)
    fields.number(body, "top_p", 0, 1)
    fields.integer(body, "seed", -(2**63), 2**64 - 1)
    fields.texts(body, "stop")
    fields.flag(body, "return_token_ids")


def check_message(message: Body, where: str) -> None:
    role = message.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(sorted(_ROLES))}; not {role!r}")
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise bad_request(f"{where}.content must be a string or a list of content parts, not "
                          f"{type(content).__name__}")
    for index, part in enumerate(content if isinstance(content, list) else []):
        if not isinstance(object_of(part, f"{where}.content[{index}]").get("type"), str):
            raise bad_request(f"{where}.content[{index}].type must be a string (text, image_url...)")
    for index, call in enumerate(list_of(message.get("tool_calls") or [], f"{where}.tool_calls")):
        function = object_of(object_of(call, f"{where}.tool_calls[{index}]").get("function"),
                             f"{where}.tool_calls[{index}].function")
        fields.text_of(function.get("name"), f"{where}.tool_calls[{index}].function.name")


def check_tools(body: Body) -> None:
    for index, tool in enumerate(list_of(body.get("tools") or [], "'tools'")):
        where = f"tools[{index}]"
        tool = object_of(tool, where)
        if tool.get("type") == "custom":
            fields.text_of(object_of(tool.get("custom"), f"{where}.custom").get("name"), f"{where}.custom.name")
            continue
        if tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function' (or 'custom'), not {tool.get('type')!r}")
        function = object_of(tool.get("function"), f"{where}.function")
        fields.text_of(function.get("name"), f"{where}.function.name")
        fields.optional_object(function, "parameters")
        fields.optional_text(function, "description")
    choice = body.get("tool_choice")
    if choice is None or choice in _TOOL_CHOICES:
        return
    if not isinstance(choice, dict) or not isinstance(choice.get(choice.get("type") or "function"), dict):
        raise bad_request(f"'tool_choice' must be none, auto, required or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}; not {choice!r}")


def rewrite_openai(body: Body, training: bool, logprobs_asked: bool, logprobs_value: Any) -> Rewrite:
    """Chat completions' and completions' upstream request: in training, with token ids, logprobs, usage."""
    stream = body.get("stream") is True
    if not training:
        return Rewrite(body, stream)
    upstream = dict(body)
    upstream["return_token_ids"] = True
    if not logprobs_asked:
        upstream["logprobs"] = logprobs_value
    usage_asked = bool((body.get("stream_options") or {}).get("include_usage"))
    if stream and not usage_asked:
        upstream["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return Rewrite(upstream, stream, strip_token_ids=body.get("return_token_ids") is not True,
                   strip_logprobs=not logprobs_asked, strip_usage_chunk=stream and not usage_asked)

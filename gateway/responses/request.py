"""A Responses request as a chat completions request: input items to chat messages, tools, settings.

Input items become chat messages the way vLLM's Responses server builds them, by
`schemas.conversation.responses_messages` (which replay's dataset rows use too): instructions as a
leading system message; a function call joins the assistant message before it; a function call
output is a `tool` message. Tools are translated by `gateway.responses.tools`: function and custom
tools, namespaces flattened, hosted tools (web_search...) left out. `previous_response_id`,
`conversation` and prompt templates need state the gateway does not have, and are a 400. Fields the
Responses API does not define (vLLM's `seed`, `top_k`, `allowed_token_ids`...) pass through to the
chat request.
"""

from __future__ import annotations

from typing import Any

from agentstream.gateway import fields
from agentstream.gateway.adapter import Body
from agentstream.gateway.fields import bad_request, list_of, object_of, text_of
from agentstream.gateway.responses.tools import chat_tools
from agentstream.schemas.conversation import BadConversation, flat_name, responses_messages

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
    try:
        chat["messages"] = responses_messages(body.get("instructions"), body["input"])
    except BadConversation as exc:
        raise bad_request(str(exc)) from None
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


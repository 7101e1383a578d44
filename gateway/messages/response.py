"""A Messages `message` from a chat completion: content blocks, stop reason, usage; and Anthropic's error shape."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from agentstream.gateway.adapter import Body
from agentstream.gateway.errors import UpstreamFailed
from agentstream.gateway.translation import base_id, first_choice, reasoning_of

if TYPE_CHECKING:  # the SDK's shapes, for the type checker only
    from anthropic.types import ContentBlockParam

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def error_body(status: int, message: str) -> Body:
    """An error in the Anthropic shape `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def from_chat(chat: Body, request: Body) -> Body:
    choice = first_choice(chat)
    message = choice.get("message") or {}
    content: list[ContentBlockParam] = []
    if reasoning := reasoning_of(message):
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": str(message["content"])})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": str(call.get("id")), "name": str(function.get("name")),
                        "input": tool_input(function.get("arguments"))})
    if not content:  # Anthropic's shape of an empty answer: one empty text block
        content.append({"type": "text", "text": ""})
    stop_reason, stop_sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    return {"id": f"msg_{base_id(chat)}", "type": "message", "role": "assistant",
            "model": chat.get("model") or request.get("model"), "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": usage_of(chat.get("usage"))}


def count_tokens_response(tokenized: Body) -> Body:
    count = tokenized.get("count")
    if not isinstance(count, int):
        raise UpstreamFailed("the upstream's /tokenize answer has no token count")
    return {"input_tokens": count}


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the tool_use input (an object); {} when the model's text is not one."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish reason (a matched stop string is a str)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):  # not finished, or aborted
        return None, None
    if finish_reason == "tool_calls" or called:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out = {"input_tokens": (usage.get("prompt_tokens") or 0) - (cached or 0),
           "output_tokens": usage.get("completion_tokens") or 0}
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out


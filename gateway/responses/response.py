"""A Responses `response` from a chat completion: output items, usage, the request's settings echoed."""

from __future__ import annotations

import json
import time
from typing import Any

from agentstream.gateway.adapter import Body
from agentstream.gateway.responses.request import LOGPROBS
from agentstream.gateway.responses.tools import ToolName, agent_tool, tool_names
from agentstream.gateway.translation import base_id, first_choice, logprob_entries, reasoning_of


def from_chat(chat: Body, request: Body) -> Body:
    choice = first_choice(chat)
    message = choice.get("message") or {}
    ids = Ids(base_id(chat))
    items: list[dict[str, Any]] = []
    if reasoning := reasoning_of(message):
        items.append(reasoning_item(ids.reasoning, reasoning))
    calls = message.get("tool_calls") or []
    if message.get("content") or (not calls and not items):
        logprobs = output_logprobs(logprob_entries(choice)) if LOGPROBS in (request.get("include") or []) else []
        items.append(message_item(ids.message, message.get("content") or "", logprobs))
    names = tool_names(request)
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        tool, arguments = agent_tool(names, function.get("name") or ""), function.get("arguments") or ""
        call_id = call.get("id") or ids.call(index)
        items.append(custom_call_item(ids.call(index), call_id, tool, custom_input(arguments)) if tool.custom
                     else call_item(ids.call(index), call_id, tool, arguments))
    if choice.get("finish_reason") == "length":
        items[-1]["status"] = "incomplete"  # the item the limit cut short
    return response_object(request, chat.get("id"), chat.get("created"), chat.get("model"), items,
                           choice.get("finish_reason"), chat.get("usage"))


def custom_input(arguments: str) -> str:
    """The input of a custom tool call, from the arguments of the function call the model made."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments  # not the JSON asked for: the model's text is the closest to an input there is
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


class Ids:
    """Ids of one response's output items, derived from the chat completion's id (the same streamed or not)."""

    def __init__(self, base: str):
        self.response = f"resp_{base}"
        self.message = f"msg_{base}"
        self.reasoning = f"rs_{base}"
        self.base = base

    def call(self, index: int) -> str:
        return f"fc_{self.base}_{index}"


def output_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat logprobs in the Responses shape (the same fields, less the nulls)."""
    return [{"token": entry.get("token", ""), "logprob": entry.get("logprob", 0.0), "bytes": entry.get("bytes") or [],
             "top_logprobs": [{"token": top.get("token", ""), "logprob": top.get("logprob", 0.0),
                               "bytes": top.get("bytes") or []} for top in entry.get("top_logprobs") or []]}
            for entry in entries]


def message_item(item_id: str, text: str, logprobs: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call_id: str, tool: ToolName, arguments: str, status: str = "completed") -> dict[str, Any]:
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": tool.name, "arguments": arguments,
            "status": status}
    return _namespaced(item, tool)


def custom_call_item(item_id: str, call_id: str, tool: ToolName, tool_input: str,
                     status: str = "completed") -> dict[str, Any]:
    item = {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": tool.name, "input": tool_input,
            "status": status}
    return _namespaced(item, tool)


def _namespaced(item: dict[str, Any], tool: ToolName) -> dict[str, Any]:
    """A call to a tool of a namespace names the namespace, as the Responses API's calls do."""
    if tool.namespace is not None:
        item["namespace"] = tool.namespace
    return item


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage.get("prompt_tokens") or 0,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage.get("completion_tokens") or 0, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens") or 0}


def response_object(request: dict[str, Any], chat_id: str | None, created: int | None, model: str | None,
                    output: list[dict[str, Any]], finish_reason: str | None, usage: dict[str, Any] | None,
                    status: str | None = None) -> dict[str, Any]:
    """A Responses `response`: the output, and the request's settings echoed as OpenAI does."""
    if status is None:
        status = "incomplete" if finish_reason == "length" else "completed"
    reasoning = request.get("reasoning")
    return {
        "id": Ids(base_id({"id": chat_id})).response, "object": "response",
        "created_at": created or int(time.time()), "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "model": model or request.get("model"), "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True), "previous_response_id": None,
        "reasoning": reasoning if isinstance(reasoning, dict) else None,
        "store": False,  # nothing is stored here: a later previous_response_id would not find it
        "temperature": request.get("temperature"), "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"), "tools": request.get("tools") or [],
        "top_p": request.get("top_p"), "top_logprobs": request.get("top_logprobs"),
        "truncation": request.get("truncation") or "disabled", "user": request.get("user"),
        "metadata": request.get("metadata") or {}, "usage": _usage(usage),
    }


"""The OpenAI Responses API (`POST /v1/responses`), served by translating each call to a chat completion.

Why not proxy vLLM's own /v1/responses: vLLM 0.32 serves it, and with `enable_response_messages`
its answer does show the exact prompt and output token ids (`input_messages`, `output_messages`,
also in a stream's `response.completed`). But its logprobs ride on `output_text` parts only
(`include: ["message.output_text.logprobs"]`): a turn that only calls a tool, or whose reasoning
the parser takes out, comes back with token ids and no logprobs, and streamed tool-call tokens
have none either. As a chat completion the same call returns every generated token's id and
logprob (`return_token_ids`, `logprobs`), so the gateway sends it upstream as one and translates
the answer back. `prompt_token_ids` are then what the upstream's chat template rendered from the
translated messages: the exact prompt the model saw, as for a chat call.

Input items become chat messages the way vLLM's Responses server builds them (instructions as a
leading system message; a function call joins the assistant message before it; a function call
output is a `tool` message). Function tools, and custom (freeform) tools such as Codex's
`apply_patch`: the model sees a custom tool as a function of one string, `input` (with the tool's
grammar, if any, in its description), and its call comes back as a custom tool call; streamed,
the input arrives whole when the call ends. Built-in tools, `previous_response_id`, `conversation`
and prompt templates need state or services the gateway does not have, and are a 400. Fields the Responses API does not define (vLLM's `seed`, `top_k`, `allowed_token_ids`...)
pass through to the chat request.
"""

from __future__ import annotations

import json
import time
from typing import Any

from gateway.capture import ChatTranslation, Rewrite, StreamAssembler, TranslatedStream
from gateway.errors import GatewayError
from gateway.translate import (
    bad_request, base_id, first_choice, list_of, logprob_entries, object_of, reasoning_of, text_of,
)

_LOGPROBS = "message.output_text.logprobs"
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
    "access_programs", "moderation", "image", *_NEEDS_STATE,
})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"})
# a custom (freeform) tool, such as Codex's apply_patch, is a function of one string to a chat model
_CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string", "description": "the tool's input"}},
                 "required": ["input"]}


class Responses(ChatTranslation):
    api = "responses"
    path = "/v1/responses"

    # --- request --------------------------------------------------------------------------------

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
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
        if body.get("tools"):
            chat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(list_of(body["tools"], "tools"))]
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        response_format = _response_format(body.get("text"))
        if response_format is not None:
            chat["response_format"] = response_format
        effort = (object_of(body.get("reasoning") or {}, "reasoning")).get("effort")
        if effort is not None:
            chat["reasoning_effort"] = effort
        if _LOGPROBS in (body.get("include") or []):
            chat["logprobs"] = True
            if body.get("top_logprobs"):
                chat["top_logprobs"] = body["top_logprobs"]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}  # response.completed carries the usage
        return chat

    # --- answer ---------------------------------------------------------------------------------

    def from_chat(self, chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        choice = first_choice(chat)
        message = choice.get("message") or {}
        ids = _Ids(base_id(chat))
        items: list[dict[str, Any]] = []
        if reasoning := reasoning_of(message):
            items.append(_reasoning_item(ids.reasoning, reasoning))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls and not items:
            logprobs = _logprobs(logprob_entries(choice)) if _LOGPROBS in (request.get("include") or []) else []
            items.append(_message_item(ids.message, message.get("content") or "", logprobs))
        custom = custom_tools(request)
        for index, call in enumerate(calls):
            function = call.get("function") or {}
            name, arguments = function.get("name") or "", function.get("arguments") or ""
            call_id = call.get("id") or ids.call(index)
            items.append(_custom_call_item(ids.call(index), call_id, name, _custom_input(arguments)) if name in custom
                         else _call_item(ids.call(index), call_id, name, arguments))
        if choice.get("finish_reason") == "length":
            items[-1]["status"] = "incomplete"  # the item the limit cut short
        return response_object(request, chat.get("id"), chat.get("created"), chat.get("model"), items,
                               choice.get("finish_reason"), chat.get("usage"))

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return _ResponsesStream(rewrite)


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
            arguments = (text_of(item.get("arguments", ""), f"{where}.arguments") if kind == "function_call"
                         else json.dumps({"input": text_of(item.get("input"), f"{where}.input")}))
            call = {"id": text_of(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": text_of(item.get("name"), f"{where}.name"), "arguments": arguments}}
            if last is not None:  # the call belongs to the assistant turn before it
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": text_of(item.get("call_id"), f"{where}.call_id"),
                             "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _text(parts, f"{where}.content")
            if not text:
                continue  # only encrypted content, which no model served here produced
            if last is not None and not last.get("reasoning"):
                last["reasoning"] = text
            else:
                messages.append({"role": "assistant", "reasoning": text})
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references need stored responses, which this gateway does not keep; "
                              "send the items themselves")
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported by this gateway "
                              "(it serves messages, function and custom tool calls and their outputs, and "
                              "reasoning)")
    return messages


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


def _tool(tool: Any, where: str) -> dict[str, Any]:
    tool = object_of(tool, where)
    if tool.get("type") == "custom":
        return {"type": "function", "function": {"name": text_of(tool.get("name"), f"{where}.name"),
                                                 "description": _custom_description(tool, where),
                                                 "parameters": _CUSTOM_INPUT}}
    if tool.get("type") != "function":
        raise bad_request(f"{where}: tools of type {tool.get('type')!r} are not supported by this gateway "
                          "(function and custom tools are)")
    function = {"name": text_of(tool.get("name"), f"{where}.name")}
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _custom_description(tool: dict[str, Any], where: str) -> str:
    """A custom tool's description, with the grammar its input follows, if it names one."""
    description = tool.get("description") or ""
    form = object_of(tool.get("format") or {}, f"{where}.format")
    if form.get("type") == "grammar" and form.get("definition"):
        description += (f"\n\nThe input follows this {form.get('syntax') or ''} grammar:\n"
                        f"{text_of(form['definition'], f'{where}.format.definition')}")
    return description


def custom_tools(request: dict[str, Any]) -> frozenset[str]:
    """The names of the request's custom tools: their calls are answered as custom tool calls."""
    tools = request.get("tools")
    return frozenset(tool.get("name") for tool in tools if isinstance(tool, dict) and tool.get("type") == "custom") \
        if isinstance(tools, list) else frozenset()


def _custom_input(arguments: str) -> str:
    """The input of a custom tool call, from the arguments of the function call the model made."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments  # not the JSON asked for: the model's text is the closest to an input there is
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def _tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"),
                                                                                                  str):
        return {"type": "function", "function": {"name": choice["name"]}}
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


# --- the response -------------------------------------------------------------------------------


class _Ids:
    """Ids of one response's output items, derived from the chat completion's id (the same streamed or not)."""

    def __init__(self, base: str):
        self.response = f"resp_{base}"
        self.message = f"msg_{base}"
        self.reasoning = f"rs_{base}"
        self.base = base

    def call(self, index: int) -> str:
        return f"fc_{self.base}_{index}"


def _logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat logprobs in the Responses shape (the same fields, less the nulls)."""
    return [{"token": entry.get("token", ""), "logprob": entry.get("logprob", 0.0), "bytes": entry.get("bytes") or [],
             "top_logprobs": [{"token": top.get("token", ""), "logprob": top.get("logprob", 0.0),
                               "bytes": top.get("bytes") or []} for top in entry.get("top_logprobs") or []]}
            for entry in entries]


def _message_item(item_id: str, text: str, logprobs: list, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _text_part(text: str, logprobs: list) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _custom_call_item(item_id: str, call_id: str, name: str, tool_input: str,
                      status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": name, "input": tool_input,
            "status": status}


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
        "id": _Ids(base_id({"id": chat_id})).response, "object": "response",
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


class _ResponsesStream(TranslatedStream):
    """Chat chunks in, Responses stream events out: created, one item after another, completed."""

    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
        self.sequence = 0
        self.ids: _Ids | None = None
        self.chat_id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        """the item being streamed"""
        self.call_items: dict[int, dict[str, Any]] = {}
        self.custom = custom_tools(self.request)
        self.custom_arguments: dict[str, str] = {}
        """custom tool call item id → the function arguments so far (its input is known at their end)"""
        self.with_logprobs = _LOGPROBS in (self.request.get("include") or [])

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def translate(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.ids is None and chunk.get("id"):
            self.chat_id, self.created, self.model = chunk["id"], chunk.get("created"), chunk.get("model")
            self.ids = _Ids(base_id(chunk))
            response = self.response_so_far("in_progress")
            events += [self.event("response.created", response=response),
                       self.event("response.in_progress", response=response)]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning := reasoning_of(delta):
                events += self.to_kind("reasoning")
                events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                         output_index=self.index, content_index=0, delta=reasoning))
                self.open["content"][0]["text"] += reasoning
            if delta.get("content"):
                events += self.to_kind("message")
                logprobs = _logprobs(logprob_entries(choice)) if self.with_logprobs else []
                events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                         output_index=self.index, content_index=0, delta=delta["content"],
                                         logprobs=logprobs))
                self.open["content"][0]["text"] += delta["content"]
                self.open["content"][0]["logprobs"] += logprobs
            for call in delta.get("tool_calls") or []:
                events += self.call_delta(call)
        return events

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def to_kind(self, kind: str) -> list[dict[str, Any]]:
        """Events that make a reasoning or message item the open one, if it is not already."""
        if self.open is not None and self.open["type"] == kind:
            return []
        if kind == "reasoning":
            item = _reasoning_item(self.unused(self.ids.reasoning), "")
            item["status"] = "in_progress"
            return self.open_item(item, {"type": "reasoning_text", "text": ""})
        return self.open_item(_message_item(self.unused(self.ids.message), "", [], status="in_progress"),
                              _text_part("", []))

    def open_item(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The open item's end, then the start of `item` (and of its content `part`)."""
        events = self.close_item()
        self.items.append(item)
        self.open = item
        added = dict(item) if part is None else {**item, "content": []}
        events.append(self.event("response.output_item.added", output_index=self.index, item=added))
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                     content_index=0, part=part))
        return events

    def unused(self, item_id: str) -> str:
        """`item_id`, or (text again after a tool call) a variant of it no item has yet."""
        return item_id if all(item["id"] != item_id for item in self.items) else f"{item_id}_{len(self.items)}"

    def call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        events: list[dict[str, Any]] = []
        if index not in self.call_items:
            name, call_id = function.get("name") or "", call.get("id") or self.ids.call(index)
            if name in self.custom:
                item = _custom_call_item(self.ids.call(index), call_id, name, "", status="in_progress")
                self.custom_arguments[item["id"]] = ""
            else:
                item = _call_item(self.ids.call(index), call_id, name, "", status="in_progress")
            self.call_items[index] = item
            events += self.open_item(item)
        item = self.call_items[index]
        if item["type"] == "custom_tool_call":
            self.custom_arguments[item["id"]] += function.get("arguments") or ""
        elif function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=function["arguments"]))
        return events

    def close_item(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=part["logprobs"]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            del item["status"]
            events += [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        elif item["type"] == "custom_tool_call":
            item["input"] = _custom_input(self.custom_arguments[item["id"]])
            events += [self.event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                                  delta=item["input"]),
                       self.event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                  input=item["input"])]
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def closing(self) -> list[dict[str, Any]]:
        if self.ids is None:  # an upstream stream without a single chunk: nothing to translate
            self.ids = _Ids("0")
        events = []
        if not self.items:  # an empty answer is one empty message, as when not streamed
            events += self.to_kind("message")
        events += self.close_item()
        finish = self.choice(0).finish_reason
        if finish == "length" and self.items:
            self.items[-1]["status"] = "incomplete"
        response = self.response()
        return events + [self.event(f"response.{response['status']}", response=response)]

    def error_lines(self, error: GatewayError) -> list[bytes]:
        response = self.response()
        response["status"] = "failed"
        response["error"] = {"code": "server_error", "message": error.message}
        return [self.frame(self.event("response.failed", response=response))]

    def response_so_far(self, status: str) -> dict[str, Any]:
        return response_object(self.request, self.chat_id, self.created, self.model, list(self.items), None, None,
                               status=status)

    def response(self) -> dict[str, Any]:
        chat = self.chat_response()
        finish = self.choice(0).finish_reason
        status = "incomplete" if finish == "length" else "completed" if finish else "in_progress"
        return response_object(self.request, self.chat_id, self.created, self.model, list(self.items), finish,
                               chat.get("usage"), status=status)


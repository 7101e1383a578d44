"""The Anthropic Messages API (`POST /v1/messages`), served by translating each call to a chat completion.

Why not proxy vLLM's own /v1/messages: in vLLM 0.32 it is a translation to chat completions
inside the server (`AnthropicServingMessages`), and its answer keeps nothing of the chat
completion's token ids or logprobs (the request model has no `return_token_ids`/`logprobs`, the
response model no field for them). So the gateway does the same translation itself, sends a
chat completion that asks for token ids and logprobs, and translates the answer back: the
tokens recorded are the chat path's, exact, and `prompt_token_ids` is what the upstream's chat
template rendered, the prompt the model saw.

The translation follows vLLM's, so a call renders the prompt vLLM's /v1/messages would: the
system prompt (less Claude Code's per-request `x-anthropic-billing-header` block, which would
change every turn's prefix) is one leading system message; `tool_use` blocks are the assistant
message's tool calls (arguments as `json.dumps(input)`); each `tool_result` is a `tool` message,
before the rest of its user turn; thinking is the assistant message's `reasoning`. Unlike vLLM,
a final assistant message is a prefill the answer continues, as the Messages API defines. Fields
the Messages API does not define (vLLM's `seed`, `allowed_token_ids`...) pass through to the
chat request. Errors, the gateway's and the upstream's, are in the Anthropic shape
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson

from gateway.capture import ChatTranslation, Rewrite, StreamAssembler, TranslatedStream
from gateway.errors import GatewayError
from gateway.translate import (
    bad_request, base_id, first_choice, list_of, object_of, reasoning_of, text_of,
)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}
_BILLING_HEADER = "x-anthropic-billing-header"
# the Messages API's own fields: translated below, or (no chat equivalent) not sent upstream
_MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
    "tool_choice", "thinking", "output_config", "stream", "metadata", "service_tier", "cache_control", "container",
    "inference_geo", "speed", "diagnostics", "user_profile_id", "workspace_id", "context_management", "mcp_servers",
})

# what of the chat request vLLM's /tokenize takes to render the same prompt
_TOKENIZE_FIELDS = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs")


class Messages(ChatTranslation):
    api = "messages"
    path = "/v1/messages"

    def error_body(self, status: int, message: str, code: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}

    def relay_error(self, status: int, raw: bytes, message: str) -> bytes:
        return orjson.dumps(self.error_body(status, message, ""))

    # --- request --------------------------------------------------------------------------------

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
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
            chat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(list_of(body["tools"], "tools"))]
        if body.get("tool_choice") is not None:
            _tool_choice(object_of(body["tool_choice"], "tool_choice"), chat)
        _thinking(body, chat)
        if body.get("stream") is True:
            chat["stream"] = True
            # usage on every chunk: message_start tells the input tokens, message_delta the output tokens
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return chat

    def tokenize_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """The upstream `/tokenize` request for a `count_tokens` body: the prompt of the chat request a
        `/v1/messages` call with this body sends (count_tokens has no `max_tokens`; it changes no prompt)."""
        chat = self.to_chat({**body, "max_tokens": 1})
        return {key: chat[key] for key in _TOKENIZE_FIELDS if key in chat}

    @staticmethod
    def count_tokens_response(tokenized: dict[str, Any]) -> dict[str, Any]:
        count = tokenized.get("count")
        if not isinstance(count, int):
            raise GatewayError(502, "the upstream's /tokenize answer has no token count", "upstream_error")
        return {"input_tokens": count}

    # --- answer ---------------------------------------------------------------------------------

    def from_chat(self, chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        choice = first_choice(chat)
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        if reasoning := reasoning_of(message):
            content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        for call in calls:
            function = call.get("function") or {}
            content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                            "input": _input(function.get("arguments"))})
        if not content:  # Anthropic's shape of an empty answer: one empty text block
            content.append({"type": "text", "text": ""})
        stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
        return {"id": f"msg_{base_id(chat)}", "type": "message", "role": "assistant",
                "model": chat.get("model") or request.get("model"), "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": _usage(chat.get("usage"))}

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return _MessagesStream(rewrite, self)


# --- request pieces -----------------------------------------------------------------------------


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


def _tool(tool: Any, where: str) -> dict[str, Any]:
    tool = object_of(tool, where)
    if tool.get("type") not in (None, "custom"):
        raise bad_request(f"{where}: Anthropic-defined tools ({tool.get('type')!r}) are not supported by this "
                          "gateway; define the tool with a name and an input_schema")
    schema = dict(object_of(tool.get("input_schema"), f"{where}.input_schema"))
    schema.setdefault("type", "object")
    function = {"name": text_of(tool.get("name"), f"{where}.name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
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


# --- answer pieces ------------------------------------------------------------------------------


def _input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the tool_use input (an object); {} when the model's text is not one."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str | None, str | None]:
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


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out = {"input_tokens": (usage.get("prompt_tokens") or 0) - (cached or 0),
           "output_tokens": usage.get("completion_tokens") or 0}
    if cached is not None:
        out["cache_read_input_tokens"] = cached
    return out


class _MessagesStream(TranslatedStream):
    """Chat chunks in, Messages stream events out: message_start, content blocks, message_delta, message_stop."""

    def __init__(self, rewrite: Rewrite, adapter: Messages):
        super().__init__(rewrite)
        self.adapter = adapter
        self.message: dict[str, Any] | None = None
        self.blocks: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}
        self.arguments: dict[int, str] = {}

    def translate(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.message is None and chunk.get("id"):
            self.message = {"id": f"msg_{base_id(chunk)}", "type": "message", "role": "assistant", "content": [],
                            "model": chunk.get("model") or self.request.get("model"), "stop_reason": None,
                            "stop_sequence": None, "usage": {**_usage(chunk.get("usage")), "output_tokens": 0}}
            events.append({"type": "message_start", "message": self.message})
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning := reasoning_of(delta):
                events += self.to_block({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self.delta({"type": "thinking_delta", "thinking": reasoning}))
                self.open["thinking"] += reasoning
            if delta.get("content"):
                events += self.to_block({"type": "text", "text": ""})
                events.append(self.delta({"type": "text_delta", "text": delta["content"]}))
                self.open["text"] += delta["content"]
            for call in delta.get("tool_calls") or []:
                events += self.call_delta(call)
        return events

    def to_block(self, block: dict[str, Any], new: bool = False) -> list[dict[str, Any]]:
        if not new and self.open is not None and self.open["type"] == block["type"]:
            return []
        events = self.close_block()
        self.blocks.append(block)
        self.open = block
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks.index(self.open), "delta": delta}

    def call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call.get("index", 0)
        function = call.get("function") or {}
        events: list[dict[str, Any]] = []
        if index not in self.calls:
            self.calls[index] = {"type": "tool_use", "id": call.get("id") or f"toolu_{index}",
                                 "name": function.get("name") or "", "input": {}}
            self.arguments[index] = ""
            events += self.to_block(self.calls[index], new=True)
        if function.get("arguments"):
            self.arguments[index] += function["arguments"]
            events.append({"type": "content_block_delta", "index": self.blocks.index(self.calls[index]),
                           "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}})
        return events

    def close_block(self) -> list[dict[str, Any]]:
        block, self.open = self.open, None
        if block is None:
            return []
        index = self.blocks.index(block)
        events = []
        if block["type"] == "thinking":
            block["signature"] = uuid.uuid4().hex
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block["signature"]}})
        return events + [{"type": "content_block_stop", "index": index}]

    def closing(self) -> list[dict[str, Any]]:
        events = []
        if self.message is None:
            self.message = {"id": "msg_0", "type": "message", "role": "assistant", "content": [],
                            "model": self.request.get("model"), "stop_reason": None, "stop_sequence": None,
                            "usage": _usage(None)}
            events.append({"type": "message_start", "message": self.message})
        if not self.blocks:
            events += self.to_block({"type": "text", "text": ""})
        events += self.close_block()
        response = self.response()
        usage = response["usage"]
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": response["stop_reason"], "stop_sequence": response["stop_sequence"]},
                          "usage": usage},
                         {"type": "message_stop"}]

    def error_lines(self, error: GatewayError) -> list[bytes]:
        return [self.frame(self.adapter.error_body(error.status, error.message, error.code))]

    def response(self) -> dict[str, Any]:
        chat = self.chat_response()
        choice = first_choice(chat)
        for index, call in self.calls.items():
            call["input"] = _input(self.arguments[index])
        stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"), bool(self.calls))
        head = self.message or {"id": "msg_0", "model": self.request.get("model")}
        return {"id": head["id"], "type": "message", "role": "assistant", "model": head["model"],
                "content": [dict(block) for block in self.blocks], "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": _usage(chat.get("usage"))}

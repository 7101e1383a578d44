"""A Messages stream from a chat completion stream: message_start, content blocks, message_delta, message_stop."""

from __future__ import annotations

import uuid
from typing import Any

from agentstream.gateway.adapter import Rewrite
from agentstream.gateway.errors import GatewayError
from agentstream.gateway.messages.response import error_body, stop_of, tool_input, usage_of
from agentstream.gateway.translation import TranslatedStream, base_id, first_choice, reasoning_of


class MessagesStream(TranslatedStream):
    """Chat chunks in, Messages stream events out: message_start, content blocks, message_delta, message_stop."""

    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
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
                            "stop_sequence": None, "usage": {**usage_of(chunk.get("usage")), "output_tokens": 0}}
            events.append({"type": "message_start", "message": self.message})
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning := reasoning_of(delta):
                events += self.to_block({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self.delta({"type": "thinking_delta", "thinking": reasoning}))
                self.current["thinking"] += reasoning
            if delta.get("content"):
                events += self.to_block({"type": "text", "text": ""})
                events.append(self.delta({"type": "text_delta", "text": delta["content"]}))
                self.current["text"] += delta["content"]
            for call in delta.get("tool_calls") or []:
                events += self.call_delta(call)
        return events

    @property
    def current(self) -> dict[str, Any]:
        """The open one (there is one right after it was opened)."""
        assert self.open is not None
        return self.open

    def to_block(self, block: dict[str, Any], new: bool = False) -> list[dict[str, Any]]:
        if not new and self.open is not None and self.current["type"] == block["type"]:
            return []
        events = self.close_block()
        self.blocks.append(block)
        self.open = block
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks.index(self.current), "delta": delta}

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
                            "usage": usage_of(None)}
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
        return [self.frame(error_body(error.status, error.message))]

    def response(self) -> dict[str, Any]:
        chat = self.chat_response()
        choice = first_choice(chat)
        for index, call in self.calls.items():
            call["input"] = tool_input(self.arguments[index])
        stop_reason, stop_sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"), bool(self.calls))
        head = self.message or {"id": "msg_0", "model": self.request.get("model")}
        return {"id": head["id"], "type": "message", "role": "assistant", "model": head["model"],
                "content": [dict(block) for block in self.blocks], "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage_of(chat.get("usage"))}

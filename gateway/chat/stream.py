"""A streamed chat completion: each chunk's tokens captured and stripped, and the chunks assembled into
the chat completion a non-streamed call would have returned."""

from __future__ import annotations

from typing import Any

from agentstream.gateway.adapter import Body, Rewrite, StreamAssembler, blank, concat
from agentstream.gateway.chat.response import logprobs_of

_HEAD = ("id", "created", "model", "system_fingerprint", "service_tier")


class ChatAssembler(StreamAssembler):
    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
        self._head: Body = {}
        self._out: dict[int, Body] = {}

    def _capture(self, chunk: Body) -> None:
        if chunk.get("prompt_token_ids") is not None:
            self._prompt = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            ids = choice.get("token_ids")
            self.choice(index).add(ids, logprobs_of(choice.get("logprobs")))
            if ids or (choice.get("delta") or {}).get("content"):
                self.tokens_seen = True
            self.note_finish(index, choice.get("finish_reason"))

    def _strip(self, chunk: Body) -> None:
        if self.rewrite.strip_token_ids:
            blank(chunk, "prompt_token_ids")
        for choice in chunk.get("choices") or []:
            if self.rewrite.strip_token_ids:
                blank(choice, "token_ids")
            if self.rewrite.strip_logprobs:
                blank(choice, "logprobs")

    def _merge(self, chunk: Body) -> None:
        for key in _HEAD:
            if chunk.get(key) is not None:
                self._head[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            out = self._out.setdefault(choice.get("index", 0), {"message": {}, "logprobs": None, "finish_reason": None})
            delta = choice.get("delta") or {}
            message = out["message"]
            concat(message, {k: v for k, v in delta.items() if k != "tool_calls"}, keep=frozenset({"role"}))
            for call in delta.get("tool_calls") or []:
                _merge_call(message, call)
            logprobs = choice.get("logprobs")
            if logprobs and logprobs.get("content") is not None:
                out["logprobs"] = out["logprobs"] or {"content": []}
                out["logprobs"]["content"] += logprobs["content"]
            for key in ("finish_reason", "stop_reason"):
                if choice.get(key) is not None:
                    out[key] = choice[key]

    def response(self) -> Body:
        choices = [{"index": index, **out} for index, out in sorted(self._out.items())]
        for choice in choices:
            choice["message"].setdefault("role", "assistant")
            choice["message"].setdefault("content", None)
        return {**self._head, "object": "chat.completion", "choices": choices, "usage": self._agent_usage}


def _merge_call(message: Body, call: dict[str, Any]) -> None:
    """A streamed tool call's piece into the message's tool calls (by its index)."""
    calls = message.setdefault("tool_calls", [])
    while len(calls) <= call.get("index", 0):
        calls.append({"function": {}})
    merged = calls[call.get("index", 0)]
    concat(merged, {k: v for k, v in call.items() if k not in ("function", "index")}, keep=frozenset({"id", "type"}))
    concat(merged["function"], call.get("function") or {})

"""A Responses stream from a chat completion stream: created, one item after another, completed."""

from __future__ import annotations

from typing import Any

from agentstream.gateway.adapter import Rewrite
from agentstream.gateway.errors import GatewayError
from agentstream.gateway.responses.request import LOGPROBS
from agentstream.gateway.responses.response import (
    Ids,
    call_item,
    custom_call_item,
    custom_input,
    message_item,
    output_logprobs,
    reasoning_item,
    response_object,
    text_part,
)
from agentstream.gateway.responses.tools import agent_tool, tool_names
from agentstream.gateway.translation import TranslatedStream, base_id, logprob_entries, reasoning_of


class ResponsesStream(TranslatedStream):
    """Chat chunks in, Responses stream events out: created, one item after another, completed."""

    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
        self.sequence = 0
        self.ids = Ids("0")
        self.started = False
        """a chunk with the chat completion's id has come (its ids are the items')"""
        self.chat_id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        """the item being streamed"""
        self.call_items: dict[int, dict[str, Any]] = {}
        self.names = tool_names(self.request)
        self.custom_arguments: dict[str, str] = {}
        """custom tool call item id → the function arguments so far (its input is known at their end)"""
        self.with_logprobs = LOGPROBS in (self.request.get("include") or [])

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def translate(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not self.started and chunk.get("id"):
            self.started = True
            self.chat_id, self.created, self.model = chunk["id"], chunk.get("created"), chunk.get("model")
            self.ids = Ids(base_id(chunk))
            response = self.response_so_far("in_progress")
            events += [self.event("response.created", response=response),
                       self.event("response.in_progress", response=response)]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if reasoning := reasoning_of(delta):
                events += self.to_kind("reasoning")
                events.append(self.event("response.reasoning_text.delta", item_id=self.current["id"],
                                         output_index=self.index, content_index=0, delta=reasoning))
                self.current["content"][0]["text"] += reasoning
            if delta.get("content"):
                events += self.to_kind("message")
                logprobs = output_logprobs(logprob_entries(choice)) if self.with_logprobs else []
                events.append(self.event("response.output_text.delta", item_id=self.current["id"],
                                         output_index=self.index, content_index=0, delta=delta["content"],
                                         logprobs=logprobs))
                self.current["content"][0]["text"] += delta["content"]
                self.current["content"][0]["logprobs"] += logprobs
            for call in delta.get("tool_calls") or []:
                events += self.call_delta(call)
        return events

    @property
    def current(self) -> dict[str, Any]:
        """The open one (there is one right after it was opened)."""
        assert self.open is not None
        return self.open

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def to_kind(self, kind: str) -> list[dict[str, Any]]:
        """Events that make a reasoning or message item the open one, if it is not already."""
        if self.open is not None and self.current["type"] == kind:
            return []
        if kind == "reasoning":
            item = reasoning_item(self.unused(self.ids.reasoning), "")
            item["status"] = "in_progress"
            return self.open_item(item, {"type": "reasoning_text", "text": ""})
        return self.open_item(message_item(self.unused(self.ids.message), "", [], status="in_progress"),
                              text_part("", []))

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
            tool, call_id = agent_tool(self.names, function.get("name") or ""), call.get("id") or self.ids.call(index)
            if tool.custom:
                item = custom_call_item(self.ids.call(index), call_id, tool, "", status="in_progress")
                self.custom_arguments[item["id"]] = ""
            else:
                item = call_item(self.ids.call(index), call_id, tool, "", status="in_progress")
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
            item["input"] = custom_input(self.custom_arguments[item["id"]])
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


"""APIs served by translating each call to a chat completion (Responses, Anthropic Messages).

Their calls go upstream as chat completions (`upstream_path`), so the tokens they record are the
chat path's, exact; the answer is translated back into the API's own shapes, errors included. A
`ChatTranslation` translates the request (`to_chat`, a `BadRequest` for input the API does not
allow) and the answer (`from_chat`); a `TranslatedStream` does it for streams, chunk by chunk.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import replace
from typing import Any

from agentstream.gateway import sse
from agentstream.gateway.adapter import Adapter, Body, Rewrite, Tokens
from agentstream.gateway.chat import ChatAssembler, ChatCompletions

CHAT = ChatCompletions()
log = logging.getLogger("gateway.translation")
_dropped: set[str] = set()


class ChatTranslation(Adapter):
    @property
    def upstream_path(self) -> str:
        return CHAT.path

    @abstractmethod
    def to_chat(self, body: Body) -> Body:
        """The chat completions request for the agent's request."""

    @abstractmethod
    def from_chat(self, chat: Body, request: Body) -> Body:
        """The API's response for a (non-streamed) chat completion."""

    def rewrite(self, body: Body, training: bool) -> Rewrite:
        return replace(CHAT.rewrite(self.to_chat(body), training), request=body)

    def finish(self, response: Body, rewrite: Rewrite) -> Tokens:
        tokens = CHAT.finish(response, rewrite)
        translated = self.from_chat(response, rewrite.request or {})
        response.clear()
        response.update(translated)
        return tokens


class TranslatedStream(ChatAssembler):
    """Captures and assembles the upstream's chat chunks as for chat, and forwards them translated.

    A subclass turns each chunk into the API's events (`translate`), ends the stream with the
    API's closing events (`closing`) and builds the response the agent saw from what it sent.
    """

    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
        self.request: Body = rewrite.request or {}

    def lines(self, chunk: Body) -> list[bytes]:
        self.feed(chunk)  # capture and the assembled chat completion, as for chat
        return [self.frame(event) for event in self.translate(chunk)]

    def close(self) -> list[bytes]:
        return [self.frame(event) for event in self.closing()]

    @staticmethod
    def frame(event: Body) -> bytes:
        """Responses and Messages streams name each event after its type."""
        return sse.event(event, event["type"])

    @abstractmethod
    def translate(self, chunk: Body) -> list[Body]: ...

    @abstractmethod
    def closing(self) -> list[Body]: ...

    def chat_response(self) -> Body:
        """The chat completion the stream added up to (usage included)."""
        chat = ChatAssembler.response(self)
        chat["usage"] = self._usage
        return chat


# --- reading a chat completion ---------------------------------------------------------------


def base_id(chat: Body) -> str:
    """The unique part of a chat completion's id (`chatcmpl-<this>`), for the ids of what it is translated into."""
    return str(chat.get("id") or "").removeprefix("chatcmpl-") or "0"


def first_choice(chat: Body) -> Body:
    choices = chat.get("choices") or [{}]
    choice: Body = choices[0]
    return choice


def reasoning_of(message: Body) -> str | None:
    """vLLM's reasoning text (a reasoning parser's output); older versions call it `reasoning_content`."""
    text: str | None = message.get("reasoning") or message.get("reasoning_content") or None
    return text


def logprob_entries(choice: Body) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = ((choice.get("logprobs") or {}).get("content")) or []
    return entries


def note_dropped(kind: str) -> None:
    """Log, once per kind, a hosted tool left out of what the model sees (web search and the like)."""
    if kind not in _dropped:
        _dropped.add(kind)
        log.info("a hosted tool (%s) is left out of what the model sees: it runs on its provider's servers, "
                 "which are not behind this gateway (logged once per kind)", kind)

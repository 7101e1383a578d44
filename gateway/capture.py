"""What the gateway changes in a model call, and what it takes out of the answer.

An `Adapter` is one API (chat completions and completions here; Responses and Messages in
`gateway.responses` and `gateway.messages`). It rewrites the agent's request for the upstream
(in training mode: ask for token ids and logprobs), and turns the upstream's answer into two
things: the response the agent asked for (what was injected is set back to what the upstream
sends when not asked), and the `Tokens` the call event records. Streams go through a
`StreamAssembler`, chunk by chunk: token ids are taken from the chunks as they pass, never
re-tokenized, and the chunks are assembled into the same response a non-streamed call would
have returned.

An API the upstream cannot answer with token ids is a `ChatTranslation`: its calls go upstream
as chat completions (`upstream_path`), and the answer is translated back into the API's own
shapes, errors included.

Every adapter produces the same `Tokens`, so a new API is one new adapter in
`gateway.adapters.ADAPTERS` (the app serves each at its `path`, plain and rollout-scoped).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import orjson
from starlette.responses import Response

from schemas.events import ChoiceTokens, Usage

from gateway import sse
from gateway.errors import GatewayError, error_body


@dataclass
class Tokens:
    """The training view of a call: exact token ids and one logprob per completion token."""

    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    extra_choices: list[ChoiceTokens] = field(default_factory=list)
    usage: Usage | None = None


@dataclass(frozen=True)
class Rewrite:
    """The request for the upstream, and what to take out of its answer before the agent sees it."""

    body: dict[str, Any]
    stream: bool
    strip_token_ids: bool = False
    strip_logprobs: bool = False
    strip_usage_chunk: bool = False
    request: dict[str, Any] | None = None
    """the agent's request, for adapters that translate it (their answers echo parts of it)"""


@dataclass
class _Choice:
    """Token capture of one choice, filled from a response or chunk by chunk."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_complete: bool = True
    finish_reason: str | None = None

    def add(self, ids: list[int] | None, logprobs: list[float] | None) -> None:
        if ids:
            self.ids += ids
        if logprobs is None:
            self.logprobs_complete = self.logprobs_complete and not ids
        else:
            self.logprobs += logprobs


def _tokens(prompt: list[int] | None, choices: dict[int, _Choice], usage: dict | None) -> Tokens:
    def logprobs_of(choice: _Choice) -> list[float] | None:
        ok = choice.logprobs_complete and len(choice.logprobs) == len(choice.ids)
        return choice.logprobs if ok and choice.ids else None

    first = choices.get(0, _Choice())
    have_ids = any(choice.ids for choice in choices.values())
    tokens = Tokens(
        prompt_token_ids=prompt,
        completion_token_ids=first.ids if have_ids else None,
        logprobs=logprobs_of(first),
        finish_reason=first.finish_reason,
        extra_choices=[ChoiceTokens(index=index, completion_token_ids=choice.ids, logprobs=logprobs_of(choice),
                                    finish_reason=choice.finish_reason)
                       for index, choice in sorted(choices.items()) if index != 0 and have_ids],
    )
    if usage:
        tokens.usage = Usage(prompt_tokens=usage.get("prompt_tokens") or 0,
                             completion_tokens=usage.get("completion_tokens") or 0,
                             total_tokens=usage.get("total_tokens") or 0)
    elif prompt is not None and have_ids:
        completion = sum(len(choice.ids) for choice in choices.values())
        tokens.usage = Usage(prompt_tokens=len(prompt), completion_tokens=completion,
                             total_tokens=len(prompt) + completion)
    return tokens


class StreamAssembler(ABC):
    """Follows one SSE stream: strips each chunk for the agent and assembles the whole response."""

    def __init__(self, rewrite: Rewrite):
        self.rewrite = rewrite
        self.finished = False
        """a chunk has ended a choice: from here on the agent's response is ending"""
        self.tokens_seen = False
        self._prompt: list[int] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: dict | None = None

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """Take one upstream chunk; return the chunk to forward to the agent, or None to drop it."""
        if chunk.get("usage") and not chunk.get("choices"):
            self._usage = chunk["usage"]
            self.finished = True
            return None if self.rewrite.strip_usage_chunk else chunk
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        self._capture(chunk)
        self._strip(chunk)
        self._merge(chunk)
        return chunk

    def lines(self, chunk: dict[str, Any]) -> list[bytes]:
        """Take one upstream chunk; return the SSE lines to forward to the agent for it."""
        out = self.feed(chunk)
        return [] if out is None else [sse.event(out)]

    def close(self) -> list[bytes]:
        """The lines that end the agent's stream; sent only once the call is recorded."""
        return [sse.DONE_EVENT]

    def error_lines(self, error: GatewayError) -> list[bytes]:
        """The lines that end the agent's stream when the call failed mid-way."""
        return [sse.event(error.body)]

    def choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice()
        return choice

    def note_finish(self, index: int, finish_reason: str | None) -> None:
        if finish_reason is not None:
            self.choice(index).finish_reason = finish_reason
            self.finished = True

    def tokens(self) -> Tokens:
        return _tokens(self._prompt, self._choices, self._usage)

    @property
    def _agent_usage(self) -> dict | None:
        """Usage as the agent saw it: none if it did not ask for the usage chunk."""
        return None if self.rewrite.strip_usage_chunk else self._usage

    @abstractmethod
    def _capture(self, chunk: dict[str, Any]) -> None: ...

    @abstractmethod
    def _strip(self, chunk: dict[str, Any]) -> None: ...

    @abstractmethod
    def _merge(self, chunk: dict[str, Any]) -> None: ...

    @abstractmethod
    def response(self) -> dict[str, Any]:
        """The response the agent received, assembled as a non-streamed one would look."""


class Adapter(ABC):
    api: ClassVar[str]
    """the `Call.api` of this adapter's events"""
    path: ClassVar[str]
    """the path this API is served at, by the gateway and (unless `upstream_path` differs) by the upstream"""

    @property
    def upstream_path(self) -> str:
        return self.path

    def error_body(self, status: int, message: str, code: str) -> dict[str, Any]:
        """An error in this API's shape (the OpenAI one unless an adapter says otherwise)."""
        return error_body(status, message, code)

    def error_response(self, error: GatewayError) -> Response:
        return Response(orjson.dumps(self.error_body(error.status, error.message, error.code)), error.status,
                        headers=error.headers, media_type="application/json")

    def relay_error(self, status: int, raw: bytes, message: str) -> bytes:
        """The body an upstream error reaches the agent with: as the upstream sent it, for an API proxied as is."""
        return raw

    @abstractmethod
    def rewrite(self, body: dict[str, Any], training: bool) -> Rewrite: ...

    @abstractmethod
    def finish(self, response: dict[str, Any], rewrite: Rewrite) -> Tokens:
        """Capture the tokens of a non-streamed response and strip it for the agent, in place."""

    @abstractmethod
    def assembler(self, rewrite: Rewrite) -> StreamAssembler: ...


# --- OpenAI chat completions and completions -------------------------------------------------


def _rewrite_openai(body: dict[str, Any], training: bool, logprobs_asked: bool, logprobs_value: Any) -> Rewrite:
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


def _blank(container: dict[str, Any], key: str) -> None:
    """Set an injected field to what the upstream sends when it was not asked for (null)."""
    if key in container:
        container[key] = None


def _concat(target: dict[str, Any], delta: dict[str, Any], keep: frozenset[str] = frozenset()) -> None:
    """Accumulate a streamed delta: strings are appended, except the fields in `keep`, which are set once."""
    for key, value in delta.items():
        old = target.get(key)
        if isinstance(value, str) and isinstance(old, str) and key not in keep:
            target[key] = old + value
        elif value is not None or key not in target:
            target[key] = value


def _chat_logprobs(logprobs: dict | None) -> list[float] | None:
    if not logprobs or logprobs.get("content") is None:
        return None
    return [entry["logprob"] for entry in logprobs["content"]]


class ChatCompletions(Adapter):
    api = "chat.completions"
    path = "/v1/chat/completions"

    def rewrite(self, body: dict[str, Any], training: bool) -> Rewrite:
        return _rewrite_openai(body, training, logprobs_asked=body.get("logprobs") is True, logprobs_value=True)

    def finish(self, response: dict[str, Any], rewrite: Rewrite) -> Tokens:
        choices: dict[int, _Choice] = {}
        for choice in response.get("choices") or []:
            captured = choices[choice.get("index", 0)] = _Choice(finish_reason=choice.get("finish_reason"))
            captured.add(choice.get("token_ids"), _chat_logprobs(choice.get("logprobs")))
            if rewrite.strip_token_ids:
                _blank(choice, "token_ids")
            if rewrite.strip_logprobs:
                _blank(choice, "logprobs")
        tokens = _tokens(response.get("prompt_token_ids"), choices, response.get("usage"))
        if rewrite.strip_token_ids:
            _blank(response, "prompt_token_ids")
        return tokens

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return ChatAssembler(rewrite)


class ChatAssembler(StreamAssembler):
    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
        self._head: dict[str, Any] = {}
        self._out: dict[int, dict[str, Any]] = {}

    def _capture(self, chunk: dict[str, Any]) -> None:
        if chunk.get("prompt_token_ids") is not None:
            self._prompt = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            ids = choice.get("token_ids")
            self.choice(index).add(ids, _chat_logprobs(choice.get("logprobs")))
            if ids or (choice.get("delta") or {}).get("content"):
                self.tokens_seen = True
            self.note_finish(index, choice.get("finish_reason"))

    def _strip(self, chunk: dict[str, Any]) -> None:
        if self.rewrite.strip_token_ids:
            _blank(chunk, "prompt_token_ids")
        for choice in chunk.get("choices") or []:
            if self.rewrite.strip_token_ids:
                _blank(choice, "token_ids")
            if self.rewrite.strip_logprobs:
                _blank(choice, "logprobs")

    def _merge(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if chunk.get(key) is not None:
                self._head[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            out = self._out.setdefault(choice.get("index", 0), {"message": {}, "logprobs": None, "finish_reason": None})
            delta = choice.get("delta") or {}
            message = out["message"]
            _concat(message, {k: v for k, v in delta.items() if k != "tool_calls"}, keep=frozenset({"role"}))
            for call in delta.get("tool_calls") or []:
                calls = message.setdefault("tool_calls", [])
                while len(calls) <= call.get("index", 0):
                    calls.append({"function": {}})
                merged = calls[call.get("index", 0)]
                _concat(merged, {k: v for k, v in call.items() if k not in ("function", "index")},
                        keep=frozenset({"id", "type"}))
                _concat(merged["function"], call.get("function") or {})
            logprobs = choice.get("logprobs")
            if logprobs and logprobs.get("content") is not None:
                out["logprobs"] = out["logprobs"] or {"content": []}
                out["logprobs"]["content"] += logprobs["content"]
            for key in ("finish_reason", "stop_reason"):
                if choice.get(key) is not None:
                    out[key] = choice[key]

    def response(self) -> dict[str, Any]:
        choices = [{"index": index, **out} for index, out in sorted(self._out.items())]
        for choice in choices:
            choice["message"].setdefault("role", "assistant")
            choice["message"].setdefault("content", None)
        return {**self._head, "object": "chat.completion", "choices": choices, "usage": self._agent_usage}


class Completions(Adapter):
    api = "completions"
    path = "/v1/completions"

    def rewrite(self, body: dict[str, Any], training: bool) -> Rewrite:
        # completions' `logprobs` is a count of alternatives; 0 returns the sampled token's logprob alone
        asked = body.get("logprobs") is not None and body.get("logprobs") is not False
        return _rewrite_openai(body, training, logprobs_asked=asked, logprobs_value=0)

    def finish(self, response: dict[str, Any], rewrite: Rewrite) -> Tokens:
        choices: dict[int, _Choice] = {}
        prompt = None
        for choice in response.get("choices") or []:
            index = choice.get("index", 0)
            captured = choices[index] = _Choice(finish_reason=choice.get("finish_reason"))
            captured.add(choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs"))
            if index == 0:
                prompt = choice.get("prompt_token_ids")
            if rewrite.strip_token_ids:
                _blank(choice, "token_ids")
                _blank(choice, "prompt_token_ids")
            if rewrite.strip_logprobs:
                _blank(choice, "logprobs")
        return _tokens(prompt, choices, response.get("usage"))

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return _CompletionsAssembler(rewrite)


class _CompletionsAssembler(StreamAssembler):
    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
        self._head: dict[str, Any] = {}
        self._out: dict[int, dict[str, Any]] = {}

    def _capture(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            if index == 0 and choice.get("prompt_token_ids") is not None:
                self._prompt = choice["prompt_token_ids"]
            ids = choice.get("token_ids")
            self.choice(index).add(ids, (choice.get("logprobs") or {}).get("token_logprobs"))
            if ids or choice.get("text"):
                self.tokens_seen = True
            self.note_finish(index, choice.get("finish_reason"))

    def _strip(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            if self.rewrite.strip_token_ids:
                _blank(choice, "token_ids")
                _blank(choice, "prompt_token_ids")
            if self.rewrite.strip_logprobs:
                _blank(choice, "logprobs")

    def _merge(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model", "system_fingerprint"):
            if chunk.get(key) is not None:
                self._head[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            out = self._out.setdefault(choice.get("index", 0), {"text": "", "logprobs": None, "finish_reason": None})
            out["text"] += choice.get("text") or ""
            logprobs = choice.get("logprobs")
            if logprobs:
                merged = out["logprobs"] = out["logprobs"] or {}
                for key, values in logprobs.items():
                    if isinstance(values, list):
                        merged[key] = merged.get(key, []) + values
            for key in ("finish_reason", "stop_reason"):
                if choice.get(key) is not None:
                    out[key] = choice[key]

    def response(self) -> dict[str, Any]:
        choices = [{"index": index, **out} for index, out in sorted(self._out.items())]
        return {**self._head, "object": "text_completion", "choices": choices, "usage": self._agent_usage}


# --- APIs served by translating to chat completions -------------------------------------------


CHAT = ChatCompletions()


class ChatTranslation(Adapter):
    """An API whose calls go upstream as chat completions, so their tokens are the chat path's, exact.

    A subclass translates the request (`to_chat`, raising a 400 `GatewayError` for input the API
    does not allow) and the answer (`from_chat`, and a `TranslatedStream` for streams).
    """

    @property
    def upstream_path(self) -> str:
        return CHAT.path

    @abstractmethod
    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completions request for the agent's request."""

    @abstractmethod
    def from_chat(self, chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
        """The API's response for a (non-streamed) chat completion."""

    def rewrite(self, body: dict[str, Any], training: bool) -> Rewrite:
        return replace(CHAT.rewrite(self.to_chat(body), training), request=body)

    def finish(self, response: dict[str, Any], rewrite: Rewrite) -> Tokens:
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
        self.request = rewrite.request or {}

    def lines(self, chunk: dict[str, Any]) -> list[bytes]:
        self.feed(chunk)  # capture and the assembled chat completion, as for chat
        return [self.frame(event) for event in self.translate(chunk)]

    def close(self) -> list[bytes]:
        return [self.frame(event) for event in self.closing()]

    @staticmethod
    def frame(event: dict[str, Any]) -> bytes:
        """Responses and Messages streams name each event after its type."""
        return sse.event(event, event["type"])

    @abstractmethod
    def translate(self, chunk: dict[str, Any]) -> list[dict[str, Any]]: ...

    @abstractmethod
    def closing(self) -> list[dict[str, Any]]: ...

    def chat_response(self) -> dict[str, Any]:
        """The chat completion the stream added up to (usage included)."""
        chat = ChatAssembler.response(self)
        chat["usage"] = self._usage
        return chat

"""What the gateway changes in a model call, and what it takes out of the answer: the `Adapter`.

An `Adapter` is one API (`gateway.chat`, `gateway.completions`, `gateway.responses`,
`gateway.messages`). It checks and rewrites the agent's request for the upstream (in training
mode: ask for token ids and logprobs), and turns the upstream's answer into two things: the
response the agent asked for (what was injected is set back to what the upstream sends when not
asked), and the `Tokens` the call event records. Streams go through a `StreamAssembler`, chunk by
chunk: token ids are taken from the chunks as they pass, never re-tokenized, and the chunks are
assembled into the same response a non-streamed call would have returned.

Every adapter produces the same `Tokens`, so a new API is one new adapter in
`gateway.apis.ADAPTERS` (the app serves each at its `path`, plain and rollout-scoped).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import orjson
from starlette.responses import Response

from agentstream.gateway import sse
from agentstream.gateway.errors import ErrorCode, GatewayError, UpstreamFailed
from agentstream.schemas.api_errors import error_body
from agentstream.schemas.events import ChoiceTokens, Usage

Body = dict[str, Any]
"""a JSON object as it came over the wire (checked field by field where it is read)"""
Api = Literal["chat.completions", "completions", "responses", "messages"]


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

    body: Body
    stream: bool
    strip_token_ids: bool = False
    strip_logprobs: bool = False
    strip_usage_chunk: bool = False
    request: Body | None = None
    """the agent's request, for adapters that translate it (their answers echo parts of it)"""


@dataclass
class Capture:
    """Token capture of one choice, filled from a response or chunk by chunk."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_complete: bool = True
    finish_reason: str | None = None

    def add(self, ids: list[int] | None, logprobs: list[float] | None) -> None:
        if logprobs is not None:
            _check_finite(logprobs)
        if ids:
            self.ids += ids
        if logprobs is None:
            self.logprobs_complete = self.logprobs_complete and not ids
        else:
            self.logprobs += logprobs


def _check_finite(logprobs: list[float]) -> None:
    """A 502 for logprobs no event can carry: vLLM sends a NaN logprob (broken weights) as null."""
    try:
        total = math.fsum(logprobs)  # in C: one pass, and NaN, ±inf or a non-number all show in the sum
    except (TypeError, OverflowError):
        total = math.nan
    if not math.isfinite(total):
        bad = next((value for value in logprobs if not (isinstance(value, (int, float)) and math.isfinite(value))),
                   None)
        raise UpstreamFailed(f"the upstream sent a logprob that is not a finite number ({bad!r}; vLLM sends NaN "
                             "as null): its weights may be broken; the call is recorded as failed, without tokens",
                             ErrorCode.UPSTREAM_NON_FINITE)


def tokens_of(prompt: list[int] | None, choices: dict[int, Capture], usage: Body | None) -> Tokens:
    """The `Tokens` of a call from its choices' captures (the first is the call's, the others `extra_choices`)."""
    first = choices.get(0, Capture())
    have_ids = any(choice.ids for choice in choices.values())
    tokens = Tokens(
        prompt_token_ids=prompt,
        completion_token_ids=first.ids if have_ids else None,
        logprobs=_logprobs_of(first),
        finish_reason=first.finish_reason,
        extra_choices=[ChoiceTokens(index=index, completion_token_ids=choice.ids, logprobs=_logprobs_of(choice),
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


def _logprobs_of(choice: Capture) -> list[float] | None:
    ok = choice.logprobs_complete and len(choice.logprobs) == len(choice.ids)
    return choice.logprobs if ok and choice.ids else None


def blank(container: Body, key: str) -> None:
    """Set an injected field to what the upstream sends when it was not asked for (null)."""
    if key in container:
        container[key] = None


def concat(target: Body, delta: Body, keep: frozenset[str] = frozenset()) -> None:
    """Accumulate a streamed delta: strings are appended, except the fields in `keep`, which are set once."""
    for key, value in delta.items():
        old = target.get(key)
        if isinstance(value, str) and isinstance(old, str) and key not in keep:
            target[key] = old + value
        elif value is not None or key not in target:
            target[key] = value


class StreamAssembler(ABC):
    """Follows one SSE stream: strips each chunk for the agent and assembles the whole response."""

    def __init__(self, rewrite: Rewrite):
        self.rewrite = rewrite
        self.finished = False
        """a chunk has ended a choice: from here on the agent's response is ending"""
        self.tokens_seen = False
        self._prompt: list[int] | None = None
        self._choices: dict[int, Capture] = {}
        self._usage: Body | None = None

    def feed(self, chunk: Body) -> Body | None:
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

    def lines(self, chunk: Body) -> list[bytes]:
        """Take one upstream chunk; return the SSE lines to forward to the agent for it."""
        out = self.feed(chunk)
        return [] if out is None else [sse.event(out)]

    def close(self) -> list[bytes]:
        """The lines that end the agent's stream; sent only once the call is recorded."""
        return [sse.DONE_EVENT]

    def error_lines(self, error: GatewayError) -> list[bytes]:
        """The lines that end the agent's stream when the call failed mid-way."""
        return [sse.event(error.body)]

    def choice(self, index: int) -> Capture:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = Capture()
        return choice

    def note_finish(self, index: int, finish_reason: str | None) -> None:
        if finish_reason is not None:
            self.choice(index).finish_reason = finish_reason
            self.finished = True

    def tokens(self) -> Tokens:
        return tokens_of(self._prompt, self._choices, self._usage)

    def generated(self) -> int:
        """Completion tokens of the first choice that have passed so far."""
        first = self._choices.get(0)
        return len(first.ids) if first else 0

    @property
    def _agent_usage(self) -> Body | None:
        """Usage as the agent saw it: none if it did not ask for the usage chunk."""
        return None if self.rewrite.strip_usage_chunk else self._usage

    @abstractmethod
    def _capture(self, chunk: Body) -> None: ...

    @abstractmethod
    def _strip(self, chunk: Body) -> None: ...

    @abstractmethod
    def _merge(self, chunk: Body) -> None: ...

    @abstractmethod
    def response(self) -> Body:
        """The response the agent received, assembled as a non-streamed one would look."""


class Adapter(ABC):
    api: ClassVar[Api]
    """the `Call.api` of this adapter's events"""
    path: ClassVar[str]
    """the path this API is served at, by the gateway and (unless `upstream_path` differs) by the upstream"""

    @property
    def upstream_path(self) -> str:
        return self.path

    def error_body(self, status: int, message: str, code: ErrorCode | str) -> Body:
        """An error in this API's shape (the OpenAI one unless an adapter says otherwise)."""
        return error_body(status, message, code)

    def error_response(self, error: GatewayError) -> Response:
        return Response(orjson.dumps(self.error_body(error.status, error.message, error.code)), error.status,
                        headers=error.headers, media_type="application/json")

    def relay_error(self, status: int, raw: bytes, message: str) -> bytes:
        """The body an upstream error reaches the agent with: as the upstream sent it, for an API proxied as is."""
        return raw

    def check(self, body: Body) -> None:  # noqa: B027 (a hook: an adapter with no fields to check keeps it)
        """A `BadRequest` for a field of the agent's request that is malformed, before anything goes upstream."""

    @abstractmethod
    def rewrite(self, body: Body, training: bool) -> Rewrite:
        """The upstream request for the agent's; a `BadRequest` for input the API does not allow."""

    @abstractmethod
    def finish(self, response: Body, rewrite: Rewrite) -> Tokens:
        """Capture the tokens of a non-streamed response and strip it for the agent, in place."""

    @abstractmethod
    def assembler(self, rewrite: Rewrite) -> StreamAssembler: ...

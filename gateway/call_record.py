"""What is known about one model call so far, and the one `call` event it becomes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import Headers

from agentstream.gateway.adapter import Adapter, Body, Tokens
from agentstream.gateway.auth import Attribution
from agentstream.gateway.lora import TenantAdapter
from agentstream.gateway.pool import Upstream
from agentstream.schemas.events import Call, CallEvent, WeightSegment
from agentstream.schemas.ids import new_id, now_ms

RETRY_HEADERS = ("x-stainless-retry-count", "x-retry-count")
"""where SDKs say which retry a request is (OpenAI's and Anthropic's SDKs: the first; some others: the second)"""
_SECRET_FIELDS = frozenset({"api_key", "apikey", "authorization", "password", "secret", "access_token"})
_NO_TOKENS = Tokens()


@dataclass(eq=False)
class CallRecord:
    """What is known about one call so far; becomes its event. (Compared by identity: a followed call is kept in
    a set, `gateway/pool.py`.)"""

    adapter: Adapter
    attribution: Attribution
    id: str = field(default_factory=new_id)
    started_at: int = field(default_factory=now_ms)
    t0: float = field(default_factory=time.perf_counter)
    body: dict[str, Any] | None = None
    model: str = ""
    streamed: bool = False
    upstream: Upstream | None = None
    weight_version: int | None = None
    retry_count: int | None = None
    lora: TenantAdapter | None = None
    """the tenant's adapter that serves the call (None: the base model)"""
    generated: Callable[[], int] | None = None
    """how many completion tokens have passed so far (a followed stream's, `gateway/pool.py` `Lease.follow`)"""
    switches: list[WeightSegment] = field(default_factory=list)
    """where its server began serving newer weights while it ran (partial rollouts)"""

    def switched(self, version: int) -> None:
        """Its server serves `version` from the next token on: a new segment starts at the tokens seen so far."""
        current = self.switches[-1].version if self.switches else self.weight_version
        if self.generated is not None and (current is None or version > current):
            self.switches.append(WeightSegment(version=version, start=self.generated()))

    def segments(self, completion_tokens: int) -> list[WeightSegment]:
        """The call's versions by token, from its first: a switch before the first token is the version of every
        token, one after the last is of none."""
        segments = [WeightSegment(version=self.weight_version, start=0)]
        for switch in self.switches:
            if switch.start >= completion_tokens:
                break
            if switch.start == segments[-1].start:
                segments[-1] = switch
            else:
                segments.append(switch)
        return segments

    @property
    def served_model(self) -> str:
        """The model the upstream is asked for and the event records: the tenant's adapter, else the model asked."""
        return self.lora.name if self.lora else self.model

    @property
    def upstream_url(self) -> str:
        return self.upstream.url if self.upstream else "(none)"

    @property
    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000

    def event(self, source: str, status: int, *, response: Body | None = None, tokens: Tokens = _NO_TOKENS,
              error: str | None = None, ttft_ms: float | None = None) -> CallEvent:
        segments = self.segments(len(tokens.completion_token_ids or ()))
        data = Call(
            api=self.adapter.api, model=self.served_model, upstream=self.upstream.url if self.upstream else None,
            weight_version=self.lora.version if self.lora else segments[0].version,
            weight_segments=segments if len(segments) > 1 else [],
            streamed=self.streamed,
            session_id=self.attribution.session_id,
            request=_redacted(self.body or {}), response=response,
            prompt_token_ids=tokens.prompt_token_ids, completion_token_ids=tokens.completion_token_ids,
            logprobs=tokens.logprobs, finish_reason=tokens.finish_reason, extra_choices=tokens.extra_choices,
            usage=tokens.usage, status=status, error=error, started_at=self.started_at,
            latency_ms=round(self.elapsed_ms, 3), ttft_ms=ttft_ms, retry_count=self.retry_count,
            tenant=self.attribution.tenant,
        )
        return CallEvent(id=self.id, source=source, rollout_id=self.attribution.rollout_id,
                         attempt_id=self.attribution.attempt_id, data=data)


def retry_count_of(headers: Headers) -> int | None:
    """The SDK's retry number of this request, if it says (a retry is not a new turn of the agent)."""
    for name in RETRY_HEADERS:
        value = headers.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _redacted(body: dict[str, Any]) -> dict[str, Any]:
    if _SECRET_FIELDS.isdisjoint(body):
        return body
    return {key: value for key, value in body.items() if key not in _SECRET_FIELDS}

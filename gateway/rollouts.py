"""What an agent (or its harness) posts about its rollout besides model calls: a reward, its end, its diff.

A reward is the agent's only for an attempt nothing else scores: a token whose attempt a grader or reward
function scores (`RolloutClaims.graded`) gets a 403 for one. Reward values are finite and fit the trainer's
float32 tensors (larger ones would be inf there): others are a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from agentstream.gateway.auth import auth_headers
from agentstream.gateway.errors import BadRequest, ErrorCode, Forbidden, TooLarge
from agentstream.gateway.service import Gateway
from agentstream.schemas.events import (
    REWARD_MAX,
    Event,
    Reward,
    RewardEvent,
    RolloutDiff,
    RolloutDiffEvent,
    RolloutFinished,
    RolloutFinishedEvent,
    TurnReward,
)

M = TypeVar("M", bound=BaseModel)

MAX_DIFF_BYTES = 512 * 1024
"""a longer diff is cut to this and marked truncated (a grader scores it 0): one event fits a Kafka record"""
MAX_DIFF_BODY_BYTES = 8 * MAX_DIFF_BYTES
"""a body larger than this is refused (413) unread"""


RewardValue = Annotated[float, Field(ge=-REWARD_MAX, le=REWARD_MAX, allow_inf_nan=False)]


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    value: RewardValue
    turns: list[TurnReward] = Field(default_factory=list)
    details: dict[str, Any] = Field(default_factory=dict)
    attempt_id: str | None = None


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    exit_code: int | None = None
    duration_ms: int | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    attempt_id: str | None = None


class DiffBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instance_id: str
    base_commit: str
    diff: str
    outcome: str | None = Field(None, min_length=1, max_length=64)
    details: dict[str, Any] = Field(default_factory=dict)


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


async def reward(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    principal = gateway.auth.principal(auth_headers(request.scope))  # 401 before any look at the body
    if principal.claims is not None and principal.claims.graded:
        raise Forbidden(f"attempt {principal.claims.attempt_id!r} of rollout {principal.claims.rollout_id!r} is "
                        "scored by its grader: its agent cannot post a reward", ErrorCode.REWARD_FROM_GRADER)
    body = _body(await request.body(), RewardBody)
    if any(not abs(turn.value) <= REWARD_MAX for turn in body.turns):
        raise BadRequest(f"turns: every value must be a finite number within ±{REWARD_MAX:.4g}")
    where = gateway.attribution(request, request.path_params["rollout_id"],
                                request.path_params.get("attempt_id") or body.attempt_id, principal)
    return await _published(gateway, RewardEvent(
        source=gateway.settings.source, rollout_id=where.rollout_id, attempt_id=where.attempt_id,
        data=Reward(value=body.value, turns=body.turns, details=body.details)))


async def finish(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    principal = gateway.auth.principal(auth_headers(request.scope))  # 401 before any look at the body
    body = _body(await request.body(), FinishBody)
    where = gateway.attribution(request, request.path_params["rollout_id"],
                                request.path_params.get("attempt_id") or body.attempt_id, principal)
    return await _published(gateway, RolloutFinishedEvent(
        source=gateway.settings.source, rollout_id=where.rollout_id, attempt_id=where.attempt_id,
        data=RolloutFinished(by="agent", exit_code=body.exit_code, duration_ms=body.duration_ms,
                             details=body.details)))


async def diff(request: Request) -> Response:
    """The attempt's final diff (coding agents): a `rollout.diff` event a grader scores."""
    gateway: Gateway = request.app.state.gateway
    principal = gateway.auth.principal(auth_headers(request.scope))  # 401 before any look at the body
    where = gateway.attribution(request, request.path_params["rollout_id"], request.path_params["attempt_id"],
                                principal)
    body = _body(await _limited_body(request, MAX_DIFF_BODY_BYTES), DiffBody)
    encoded = body.diff.encode()
    truncated = len(encoded) > MAX_DIFF_BYTES
    text = encoded[:MAX_DIFF_BYTES].decode("utf-8", "ignore") if truncated else body.diff
    return await _published(gateway, RolloutDiffEvent(
        source=gateway.settings.source, rollout_id=where.rollout_id, attempt_id=where.attempt_id,
        data=RolloutDiff(**body.model_dump(exclude={"diff"}), diff=text, size=len(encoded), truncated=truncated)))


async def _published(gateway: Gateway, event: Event) -> Response:
    await gateway.recorder.publish(event)
    return json_response({"id": event.id, "rollout_id": event.rollout_id, "attempt_id": event.attempt_id})


async def _limited_body(request: Request, limit: int, code: ErrorCode = ErrorCode.DIFF_TOO_LARGE) -> bytes:
    """The request body, or 413 once it passes `limit` bytes (without reading the rest)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            hint = ": leave generated and binary files out of the diff" if code is ErrorCode.DIFF_TOO_LARGE else ""
            raise TooLarge(f"the body is over {limit} bytes{hint}", code)
        chunks.append(chunk)
    return b"".join(chunks)


def _body(raw: bytes, model: type[M]) -> M:
    try:
        return model.model_validate(orjson.loads(raw or b"{}"))
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}", ErrorCode.INVALID_JSON) from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise BadRequest(f"{where}: {first['msg']}") from None

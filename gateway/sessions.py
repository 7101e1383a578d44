"""What a client posts about a session of production traffic: its end, and feedback, at any time later.

A session is the `/v1` calls that share a session id (the `x-agentstream-session-id` header, else the
key's default session). `POST /sessions/{id}/end` ends its current conversation now rather than
after the streams worker's idle timeout; `POST /sessions/{id}/feedback` (about the session) and
`POST /sessions/{id}/calls/{call_id}/feedback` (about one call: its `x-agentstream-call-id`, the id
of its `call` event) record what someone thought of it: a score, a label or thumbs, with who sent it.

Both answer only once Kafka acknowledged the event. The gateway keeps no sessions: feedback for a
session it never served (another replica, or a year ago) is recorded the same, and the worker decides
what it rewards (`streams/sessions.py`). A feedback body with an `id` is idempotent: the event's id
derives from it, so a retried post is one feedback for every reader.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import Response

from agentstream.gateway.auth import Principal, auth_headers, session_of
from agentstream.gateway.errors import BadRequest, ErrorCode, Forbidden
from agentstream.gateway.rollouts import _body, _limited_body, json_response
from agentstream.gateway.service import Gateway
from agentstream.schemas.events import Event, Feedback, FeedbackEvent, SessionEnded, SessionEndedEvent
from agentstream.schemas.ids import new_id
from agentstream.schemas.sessions import feedback_id

MAX_BODY_BYTES = 64 * 1024
"""a feedback or end body larger than this is refused (413) unread"""
_TEXT = 256


class EndBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    details: dict[str, Any] = Field(default_factory=dict)


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    id: str | None = Field(None, min_length=1, max_length=_TEXT, description="the sender's id: posted twice, one feedback")
    score: float | None = None
    label: str | None = Field(None, min_length=1, max_length=_TEXT)
    thumbs: Literal["up", "down"] | None = None
    comment: str | None = Field(None, max_length=16_384)
    user: str | None = Field(None, min_length=1, max_length=_TEXT, description="the end user it comes from")
    details: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _says_something(self) -> FeedbackBody:
        if self.score is None and self.label is None and self.thumbs is None:
            raise ValueError("feedback needs a score, a label or thumbs ('up' or 'down')")
        return self


async def end(request: Request) -> Response:
    gateway, principal, session_id = _session_request(request)
    body = _body(await _limited_body(request, MAX_BODY_BYTES, ErrorCode.BODY_TOO_LARGE), EndBody)
    return await _published(gateway, SessionEndedEvent(
        source=gateway.settings.source, rollout_id=_rollout_of(gateway, principal, session_id),
        data=SessionEnded(session_id=session_id, sender=principal.identity, details=body.details)))


async def feedback(request: Request) -> Response:
    gateway, principal, session_id = _session_request(request)
    body = _body(await _limited_body(request, MAX_BODY_BYTES, ErrorCode.BODY_TOO_LARGE), FeedbackBody)
    call_id = request.path_params.get("call_id")
    return await _published(gateway, FeedbackEvent(
        id=feedback_id(session_id, body.id) if body.id else new_id(), source=gateway.settings.source,
        rollout_id=_rollout_of(gateway, principal, session_id),
        data=Feedback(session_id=session_id, call_id=call_id, score=body.score, label=body.label,
                      thumbs=body.thumbs, comment=body.comment, sender=principal.identity, user=body.user,
                      client_id=body.id, details=body.details)))


def _session_request(request: Request) -> tuple[Gateway, Principal, str]:
    """The gateway, who is asking (401 before any look at the body; 403 for a rollout token) and the session."""
    gateway: Gateway = request.app.state.gateway
    principal = gateway.auth.principal(auth_headers(request.scope))
    if principal.claims is not None:
        raise Forbidden(f"a rollout token (rollout {principal.claims.rollout_id!r}) cannot end or rate sessions: "
                        "use a gateway key", ErrorCode.SESSION_FORBIDDEN)
    session_id, call_id = request.path_params["session_id"], request.path_params.get("call_id")
    if not session_id.strip():
        raise BadRequest("the session id in the path is blank", ErrorCode.INVALID_SESSION)
    if call_id is not None and not 0 < len(call_id.strip()) <= _TEXT:
        raise BadRequest(f"the call id in the path must be 1 to {_TEXT} characters (a call's x-agentstream-call-id)",
                         ErrorCode.INVALID_REQUEST)
    return gateway, principal, session_of(session_id, principal)


def _rollout_of(gateway: Gateway, principal: Principal, session_id: str) -> str:
    rollout_id = gateway.auth.attribute(principal, None, None, session_id).rollout_id
    assert rollout_id is not None
    return rollout_id


async def _published(gateway: Gateway, event: Event) -> Response:
    await gateway.recorder.publish(event)  # acknowledged by Kafka before the answer, whatever --durability says
    session_id = getattr(event.data, "session_id")  # noqa: B009 (Feedback and SessionEnded both have it; Payload does not)
    return json_response({"id": event.id, "session_id": session_id, "rollout_id": event.rollout_id,
                          "call_id": getattr(event.data, "call_id", None)})

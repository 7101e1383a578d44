"""What a client posts about a session of production traffic: its end, and feedback, at any time later.

A session is the `/v1` calls that share a session id (the `x-agentstream-session-id` header, else the
key's default session). `POST /sessions/{id}/end` ends its current conversation now rather than
after the streams worker's idle timeout; `POST /sessions/{id}/feedback` (about the session) and
`POST /sessions/{id}/calls/{call_id}/feedback` (about one call: its `x-agentstream-call-id`, the id
of its `call` event) record what someone thought of it: a score, a label or thumbs, with who sent it.

Both answer only once Kafka acknowledged the event. The gateway keeps no sessions: feedback for a
session it never served (another replica, or a year ago) is recorded the same, and the worker decides
what it rewards (`streams/sessions.py`). An app key names sessions in its own namespace (`gateway/auth.py`),
so it ends and rates its own only. A feedback body with an `id` is idempotent: the event's id derives from
(sender, session, id), so a retried post is one feedback for every reader and another sender cannot take
the id first; the same id with a different body is a 409 (`FeedbackIds`). A score outside the declared
range (`--feedback-score-min/max`, default [-1, 1]) is a 400.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import Response

from agentstream.gateway.auth import Principal, auth_headers, session_of
from agentstream.gateway.errors import BadRequest, Conflict, ErrorCode, Forbidden
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
    low, high = gateway.settings.feedback_score_min, gateway.settings.feedback_score_max
    if body.score is not None and not low <= body.score <= high:
        raise BadRequest(f"score: {body.score!r} is outside this gateway's range [{low}, {high}]")
    call_id = request.path_params.get("call_id")
    event = FeedbackEvent(
        id=feedback_id(principal.identity, session_id, body.id) if body.id else new_id(),
        source=gateway.settings.source, rollout_id=_rollout_of(gateway, principal, session_id),
        data=Feedback(session_id=session_id, call_id=call_id, score=body.score, label=body.label,
                      thumbs=body.thumbs, comment=body.comment, sender=principal.identity, user=body.user,
                      client_id=body.id, details=body.details))
    if body.id is None:
        return await _published(gateway, event)
    ids: FeedbackIds = request.app.state.feedback_ids
    digest = _digest(call_id, body)
    first = ids.claim(event.id, digest)
    try:
        return await _published(gateway, event)  # (a repeat too: the same event id, which every reader keeps once)
    except BaseException:
        if first:
            ids.release(event.id)  # not recorded: a retry may send it (or another body) again
        raise


class FeedbackIds:
    """The feedback ids this replica took lately, with a digest of each one's body: the same body under one
    id is a repeat (200; the same event id, one feedback for every reader), another body a 409. Bounded
    (oldest forgotten first). Another replica's ids, or ones from before a restart, are not known here: a
    different body under such an id is published with the same event id, and every reader keeps the first."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._digests: OrderedDict[str, bytes] = OrderedDict()

    def claim(self, event_id: str, digest: bytes) -> bool:
        """True if the id is new here (now taken), False for a repeat of the same body; 409 for another body."""
        known = self._digests.get(event_id)
        if known is None:
            self._digests[event_id] = digest
            if len(self._digests) > self.capacity:
                self._digests.popitem(last=False)
            return True
        if known != digest:
            raise Conflict("this feedback id was already sent with a different body: feedback is not edited in "
                           "place; send the correction under a new id (the reward policy takes the latest)",
                           ErrorCode.FEEDBACK_CONFLICT)
        return False

    def release(self, event_id: str) -> None:
        self._digests.pop(event_id, None)


def _digest(call_id: str | None, body: FeedbackBody) -> bytes:
    content = orjson.dumps([call_id, body.model_dump(mode="json")], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(content, digest_size=16).digest()


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

"""Who is calling, and which rollout or session a request belongs to.

Gateway keys have a scope (`schemas.keys.KeyRing`): operator keys may act for any rollout and any session;
app keys for their own sessions only, whose ids are in the key's own namespace
(`schemas.sessions.app_session_id`), never for a rollout; read-only keys (the dashboard's) for nothing
here. Agents hold rollout tokens (`schemas.tokens`), bound to one rollout and attempt: a token names its
rollout by itself, and a request that names another one is refused (403). No key, or a key of no scope,
is a 401; a key used beyond its scope a 403.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from agentstream.gateway.errors import BadRequest, ErrorCode, Forbidden, Unauthorized
from agentstream.schemas.keys import KeyRing, presented_key
from agentstream.schemas.sessions import (
    MAX_SESSION_ID,
    app_session_id,
    default_session_id,
    key_identity,
    session_rollout_id,
)
from agentstream.schemas.tokens import InvalidToken, RolloutClaims, is_rollout_token, verify_rollout_token

ROLLOUT_HEADER = "x-agentstream-rollout-id"
ATTEMPT_HEADER = "x-agentstream-attempt-id"
SESSION_HEADER = "x-agentstream-session-id"
_KEY_HEADERS = ("authorization", "x-api-key", "api-key")
_WANTED = frozenset(name.encode() for name in (*_KEY_HEADERS, ROLLOUT_HEADER, ATTEMPT_HEADER, SESSION_HEADER))


def auth_headers(scope: MutableMapping[str, Any]) -> dict[str, str]:
    """The headers auth and attribution read, in one pass over the request's (lower-cased) headers."""
    return {name.decode(): value.decode("latin-1") for name, value in scope["headers"] if name in _WANTED}


@dataclass(frozen=True)
class Principal:
    kind: Literal["operator", "app", "rollout", "anonymous"]
    claims: RolloutClaims | None = None
    identity: str = "anonymous"
    """who this is in events (feedback's sender, a key's default session): `key:<hash>` of a gateway key"""
    tenant: str | None = None
    """the tenant a key belongs to (its adapter serves and learns from its calls); None: the shared policy"""


@dataclass(frozen=True)
class Attribution:
    """Where a call or reward belongs: a rollout attempt, or a session of production traffic (then
    `rollout_id` is the session's, `schemas.sessions.session_rollout_id`, and `attempt_id` None)."""

    rollout_id: str | None = None
    attempt_id: str | None = None
    session_id: str | None = None
    tenant: str | None = None
    """the caller's tenant (its key's, or its rollout token's claim): whose adapter the call is for"""


class Authenticator:
    def __init__(self, keys: KeyRing, token_secret: str, allow_anonymous: bool):
        self._keys = keys
        self._secret = token_secret
        self._anonymous = allow_anonymous

    @property
    def configured(self) -> bool:
        return bool(self._keys or self._secret or self._anonymous)

    def principal(self, headers: Mapping[str, str]) -> Principal:
        token = presented_key(headers)
        if token is None:
            if self._anonymous:
                return Principal("anonymous")
            raise Unauthorized("no API key: send 'Authorization: Bearer <gateway key or rollout token>'",
                                   ErrorCode.MISSING_API_KEY)
        if is_rollout_token(token):
            if not self._secret:
                raise Unauthorized("rollout tokens are not accepted: this gateway has no token secret "
                                   "(AGENTSTREAM_TOKEN_SECRET)")
            try:
                claims = verify_rollout_token(self._secret, token)
                return Principal("rollout", claims, tenant=claims.tenant)
            except InvalidToken as exc:
                raise Unauthorized(f"invalid rollout token: {exc}") from None
        scope = self._keys.scope_of(token)
        if scope == "read":
            raise Forbidden("a read-only key is for the dashboard and its SQL: model calls, rewards and feedback "
                            "need an app or operator key", ErrorCode.KEY_SCOPE)
        if scope is not None:
            return Principal(scope, identity=key_identity(token), tenant=self._keys.tenant_of(token))
        if self._anonymous:
            return Principal("anonymous")
        raise Unauthorized("invalid API key: not a gateway key or a rollout token")

    @staticmethod
    def attribute(principal: Principal, rollout_id: str | None, attempt_id: str | None,
                  session_id: str | None = None) -> Attribution:
        """The attribution of a request that names `rollout_id`/`attempt_id` (URL or headers), if allowed."""
        claims = principal.claims
        if claims is None:
            if rollout_id is not None:
                if principal.kind == "app":
                    raise Forbidden(f"an app key acts for its own sessions only, not for rollout {rollout_id!r}: "
                                    "send no rollout id (agents use their rollout token)", ErrorCode.KEY_SCOPE)
                return Attribution(rollout_id, attempt_id, tenant=principal.tenant)
            session = session_of(session_id, principal)
            return Attribution(session_rollout_id(session), None, session, principal.tenant)
        if rollout_id is not None and rollout_id != claims.rollout_id:
            raise Forbidden(f"this token belongs to rollout {claims.rollout_id!r}, not {rollout_id!r}",
                            ErrorCode.WRONG_ROLLOUT)
        if attempt_id is not None and attempt_id != claims.attempt_id:
            raise Forbidden(f"this token belongs to attempt {claims.attempt_id!r} of rollout "
                               f"{claims.rollout_id!r}, not attempt {attempt_id!r}", ErrorCode.WRONG_ATTEMPT)
        return Attribution(claims.rollout_id, claims.attempt_id, tenant=principal.tenant)


_KEY_SESSION = re.compile(r"(default:)?key:[0-9a-f]{16}(:|$)")
"""a session id in a key's namespace, or a key's default session (`schemas.sessions`)"""


def session_of(session_id: str | None, principal: Principal) -> str:
    """The session a request names (header or path), else its key's default one; an app key's in its own
    namespace (403 for one that names another key's); 400 for one too long."""
    if session_id is None or not session_id.strip():
        return default_session_id(principal.identity)
    if principal.kind == "app":
        return _app_session(session_id, principal.identity)
    _check_length(session_id)
    return session_id


def _app_session(session_id: str, identity: str) -> str:
    """An app key's session: its id in the key's namespace; its own full id or default session as they are
    (as the answers name them); another key's, or another key's default session, a 403."""
    own = app_session_id(identity, "")
    if session_id == default_session_id(identity):
        return session_id
    if session_id.startswith(own):
        _check_length(session_id.removeprefix(own))
        return session_id
    if _KEY_SESSION.match(session_id):
        raise Forbidden("this session id names another key's session: an app key acts for its own sessions only",
                        ErrorCode.KEY_SCOPE)
    _check_length(session_id)
    return app_session_id(identity, session_id)


def _check_length(session_id: str) -> None:
    if len(session_id) > MAX_SESSION_ID:
        raise BadRequest(f"the session id is {len(session_id)} characters long: at most {MAX_SESSION_ID} "
                         "(a UUID per conversation is enough)", ErrorCode.INVALID_SESSION)

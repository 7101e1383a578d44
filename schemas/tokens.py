"""Rollout-scoped tokens: what an agent uses as its API key.

A token is bound to one rollout and one attempt and signed (HMAC-SHA256) with the secret the
controller and the gateway share, so the gateway can check it without a lookup, and a token for
one rollout cannot write calls or rewards for another.

Format: `ast1.<base64url(JSON claims)>.<base64url(signature)>`.

Why the signing is the standard library's `hmac` and not a signing library: the whole scheme is one
HMAC-SHA256 over a fixed prefix and the claims, checked with `hmac.compare_digest`; there is no
algorithm to negotiate (the pitfall JWT libraries guard against), no key rotation and no nested
serializer to configure. itsdangerous would sign the same way with a different wire format, so tokens
minted by a running controller would stop verifying at an upgrade, for no gain in what is checked.
The adversarial tests (forged, tampered, other secret, expired, other rollout) pin what it must refuse.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass

import orjson

from agentstream.schemas.errors import DecodeError

PREFIX = "ast1"


class InvalidToken(DecodeError):
    """A rollout token that does not verify (forged, for another secret, malformed)."""


@dataclass(frozen=True)
class RolloutClaims:
    rollout_id: str
    attempt_id: str
    expires_at: float
    graded: bool = False
    """the attempt's reward comes from a grader or reward function, never from the agent (claim `g`)"""
    tenant: str | None = None
    """the tenant the controller launched the attempt for: its calls are that tenant's (claim `t`)"""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _sign(secret: str, body: str) -> str:
    return _b64(hmac.new(secret.encode(), f"{PREFIX}.{body}".encode(), hashlib.sha256).digest())


def mint_rollout_token(secret: str, rollout_id: str, attempt_id: str, ttl_s: float = 7 * 24 * 3600,
                       graded: bool = False, tenant: str | None = None) -> str:
    """A token for one attempt; `graded`: its reward comes from a grader, so the gateway refuses the agent's;
    `tenant`: the attempt's calls are that tenant's."""
    if not secret:
        raise ValueError("a rollout token needs a non-empty secret (AGENTSTREAM_TOKEN_SECRET)")
    claims: dict[str, object] = {"r": rollout_id, "a": attempt_id, "exp": int(time.time() + ttl_s)}
    if graded:
        claims["g"] = 1  # (absent otherwise: a token minted before this claim reads the same)
    if tenant is not None:
        claims["t"] = tenant
    body = _b64(orjson.dumps(claims))
    return f"{PREFIX}.{body}.{_sign(secret, body)}"


def is_rollout_token(token: str) -> bool:
    return token.startswith(PREFIX + ".")


def verify_rollout_token(secret: str, token: str) -> RolloutClaims:
    """The claims of a valid token; `InvalidToken` (with the reason) otherwise."""
    try:
        prefix, body, signature = token.split(".")
    except ValueError:
        raise InvalidToken("malformed rollout token") from None
    if prefix != PREFIX:
        raise InvalidToken("not a rollout token")
    if not hmac.compare_digest(signature, _sign(secret, body)):
        raise InvalidToken("rollout token signature does not match")
    try:
        claims = orjson.loads(_unb64(body))
        tenant = claims.get("t")
        parsed = RolloutClaims(str(claims["r"]), str(claims["a"]), float(claims["exp"]), bool(claims.get("g")),
                               None if tenant is None else str(tenant))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidToken("malformed rollout token claims") from None
    if parsed.expires_at < time.time():
        raise InvalidToken("rollout token expired")
    return parsed

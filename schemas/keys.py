"""Gateway keys: the settings the gateway and the dashboard share (AGENTSTREAM_API_KEYS operator keys,
AGENTSTREAM_APP_KEYS app keys, AGENTSTREAM_READ_KEYS read-only keys: the same keys for both), their scopes,
and the check of the key a request presents."""

from __future__ import annotations

import hmac
import json
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal

from pydantic import SecretStr
from pydantic_settings import NoDecode

OperatorKeys = Annotated[list[SecretStr], NoDecode]
"""a settings field of operator keys: from the environment as a JSON list or `key1,key2` (`text_list`)"""


def text_list(value: Any) -> Any:
    """A list setting from text: a JSON list, or `a,b`, which is easier to type; anything else as it is."""
    if isinstance(value, str):
        text = value.strip()
        return json.loads(text) if text.startswith("[") else [part.strip() for part in text.split(",") if part.strip()]
    return value


def secret_values(keys: list[SecretStr]) -> frozenset[str]:
    """The keys as text, empty ones left out."""
    return frozenset(key.get_secret_value() for key in keys if key.get_secret_value())


PLACEHOLDERS = frozenset({"change-me", "change-me-too"})
"""the placeholders compose files and examples once shipped: anyone who read them holds the key"""
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def placeholder_secret(service: str, host: str, secrets: Mapping[str, Collection[str]]) -> str | None:
    """Which shipped placeholder a service reachable from other hosts would run with, as the error to show (the
    first variable of `secrets` that holds one); None if none. The local stack listens on 127.0.0.1, where only
    this machine reaches it: the placeholders are fine there."""
    if host in LOOPBACK:
        return None
    for variable, values in secrets.items():
        found = sorted(set(values) & PLACEHOLDERS)
        if found:
            return (f"{variable} holds the placeholder {found[0]!r} and the {service} listens on {host}: set one "
                    "of your own (e.g. `openssl rand -hex 32`)")
    return None


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents (lower-cased header names): a bearer token, else x-api-key or api-key."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    # the Anthropic SDK sends x-api-key; Azure-style clients send api-key
    return headers.get("x-api-key") or headers.get("api-key") or None


def is_operator_key(key: str, keys: Collection[bytes]) -> bool:
    """Whether `key` is one of `keys` (encoded), compared in constant time."""
    presented = key.encode()
    return any(hmac.compare_digest(presented, known) for known in keys)


Scope = Literal["operator", "app", "read"]
"""what a key may do: `operator` everything; `app` its own sessions' calls, end and feedback (in its own
namespace of session ids); `read` the dashboard and its SQL only (the gateway refuses it everywhere)"""


class KeyRing:
    """The keys of each scope; which scope a presented key has, compared in constant time against each."""

    def __init__(self, operator: Collection[str] = (), app: Collection[str] = (), read: Collection[str] = ()):
        self._keys: dict[Scope, tuple[bytes, ...]] = {
            "operator": tuple(key.encode() for key in operator), "app": tuple(key.encode() for key in app),
            "read": tuple(key.encode() for key in read)}
        shared = set(operator) & set(app) | set(operator) & set(read) | set(app) & set(read)
        if shared:
            raise ValueError(f"{len(shared)} key(s) are listed under two scopes (operator, app, read): give each "
                             "key one scope")

    def __bool__(self) -> bool:
        return any(self._keys.values())

    def scope_of(self, key: str) -> Scope | None:
        """The scope of `key`, or None for a key of no scope."""
        matched = [scope for scope, keys in self._keys.items() if is_operator_key(key, keys)]  # (each compared)
        return matched[0] if matched else None

"""Gateway keys: the settings the gateway and the dashboard share (AGENTSTREAM_API_KEYS operator keys,
AGENTSTREAM_APP_KEYS app keys, AGENTSTREAM_READ_KEYS read-only keys, AGENTSTREAM_TENANTS which tenant each app or
read key belongs to: the same for both), their scopes and tenants, and the check of the key a request presents."""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal

from pydantic import SecretStr
from pydantic_settings import NoDecode

OperatorKeys = Annotated[list[SecretStr], NoDecode]
"""a settings field of operator keys: from the environment as a JSON list or `key1,key2` (`text_list`)"""


Tenants = dict[str, list[SecretStr]]
"""a settings field of tenants: from the environment as a JSON object `{"<tenant>": ["<key>", ...]}`"""

TENANT_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
TENANT_NAME = re.compile(TENANT_PATTERN)
"""what a tenant is named: it names adapters (`<tenant>@<version>`), checkpoint folders and SQL filters"""


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


def tenant_keys(tenants: Tenants) -> dict[str, frozenset[str]]:
    """Each tenant's keys as text, empty ones left out."""
    return {tenant: secret_values(keys) for tenant, keys in tenants.items()}


class KeyRing:
    """The keys of each scope and of each tenant; which scope and which tenant a presented key has, compared in
    constant time against each."""

    def __init__(self, operator: Collection[str] = (), app: Collection[str] = (), read: Collection[str] = (),
                 tenants: Mapping[str, Collection[str]] | None = None):
        self._keys: dict[Scope, tuple[bytes, ...]] = {
            "operator": tuple(key.encode() for key in operator), "app": tuple(key.encode() for key in app),
            "read": tuple(key.encode() for key in read)}
        shared = set(operator) & set(app) | set(operator) & set(read) | set(app) & set(read)
        if shared:
            raise ValueError(f"{len(shared)} key(s) are listed under two scopes (operator, app, read): give each "
                             "key one scope")
        tenants = tenants or {}
        problem = tenants_problem(tenants, set(app) | set(read))
        if problem:
            raise ValueError(problem)
        self._tenants = {tenant: tuple(key.encode() for key in keys) for tenant, keys in tenants.items()}

    def __bool__(self) -> bool:
        return any(self._keys.values())

    def scope_of(self, key: str) -> Scope | None:
        """The scope of `key`, or None for a key of no scope."""
        matched = [scope for scope, keys in self._keys.items() if is_operator_key(key, keys)]  # (each compared)
        return matched[0] if matched else None

    def tenant_of(self, key: str) -> str | None:
        """The tenant `key` belongs to, or None (an operator key, a key of no tenant, no key of ours)."""
        matched = [tenant for tenant, keys in self._tenants.items() if is_operator_key(key, keys)]  # (each compared)
        return matched[0] if matched else None


def tenants_problem(tenants: Mapping[str, Collection[str]], declared: Collection[str]) -> str | None:
    """What is wrong with AGENTSTREAM_TENANTS over the app and read keys `declared`, as the error to show; None if
    nothing. Each key one tenant at most, each an app or read key (an operator sees every tenant: it has none)."""
    for tenant, keys in tenants.items():
        if not TENANT_NAME.fullmatch(tenant):
            return (f"AGENTSTREAM_TENANTS names a tenant {tenant[:80]!r}: a tenant's name is 1-63 lower-case letters, "
                    "digits, '-' or '_', starting with a letter or digit (it names its adapter, `<tenant>@<version>`)")
        undeclared = set(keys) - set(declared)
        if undeclared:
            return (f"AGENTSTREAM_TENANTS gives tenant {tenant!r} {len(undeclared)} key(s) that are not app or read "
                    "keys: list each under AGENTSTREAM_APP_KEYS or AGENTSTREAM_READ_KEYS too (operator keys belong "
                    "to no tenant)")
    owners: dict[str, str] = {}
    for tenant, keys in tenants.items():
        for key in keys:
            if owners.setdefault(key, tenant) != tenant:
                return (f"AGENTSTREAM_TENANTS gives one key to two tenants ({owners[key]!r} and {tenant!r}): give "
                        "each key one tenant")
    return None

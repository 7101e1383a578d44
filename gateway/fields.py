"""Checks of the request fields the gateway reads: a bad one is the agent's error (400), found before
anything goes upstream, never an upstream error or a 500.

Each check takes the request body and a field name, and returns the field's value (None when it
is absent or null, which every API treats as "not given"), or raises `BadRequest` naming the
field, what it must be and what it was.
"""

from __future__ import annotations

import math
from typing import Any

from agentstream.gateway.errors import BadRequest, ErrorCode
from agentstream.schemas.conversation import kind_of

Body = dict[str, Any]


def bad_request(message: str) -> BadRequest:
    return BadRequest(message)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def object_of(value: Any, where: str) -> Body:
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object, not {kind_of(value)}")
    return value


def list_of(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list, not {kind_of(value)}")
    return value


def text_of(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string, not {kind_of(value)}")
    return value


def flag(body: Body, name: str) -> bool | None:
    """An optional boolean (`stream`, `logprobs`...): `"yes"` is not one."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, not {kind_of(value)} ({_shown(value)})")
    return value


def integer(body: Body, name: str, minimum: int, maximum: int | None = None) -> int | None:
    """An optional integer within bounds (`n`, `max_tokens`...)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be an integer, not {kind_of(value)} ({_shown(value)})")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise bad_request(f"'{name}' must be {bounds}, not {value}")
    return value


def number(body: Body, name: str, minimum: float, maximum: float | None = None) -> float | None:
    """An optional finite number within bounds (`temperature`, `top_p`...)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, not {kind_of(value)} ({_shown(value)})")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise bad_request(f"'{name}' must be {bounds}, not {value}")
    return float(value)


def optional_object(body: Body, name: str) -> Body | None:
    value = body.get(name)
    return None if value is None else object_of(value, f"'{name}'")


def optional_text(body: Body, name: str) -> str | None:
    value = body.get(name)
    return None if value is None else text_of(value, f"'{name}'")


def texts(body: Body, name: str, most: int | None = None) -> list[str] | None:
    """An optional string or list of strings (`stop`)."""
    value = body.get(name)
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    items = list_of(value, f"'{name}'")
    for index, item in enumerate(items):
        text_of(item, f"{name}[{index}]")
    if most is not None and len(items) > most:
        raise bad_request(f"'{name}' holds at most {most} strings, not {len(items)}")
    return items


def model_of(body: Body) -> str:
    """The model the call is for: every API requires it, a non-empty string."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        detail = "" if model is None else f", not {kind_of(model)} ({_shown(model)})"
        raise BadRequest(f"'model' is required: the name of the model to call (see GET /v1/models){detail}",
                         ErrorCode.MISSING_MODEL)
    return model


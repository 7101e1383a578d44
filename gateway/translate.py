"""Pieces the chat-translating APIs (Responses, Messages) share: reading a chat completion, checking input."""

from __future__ import annotations

from typing import Any

from gateway.errors import GatewayError


def bad_request(message: str) -> GatewayError:
    return GatewayError(400, message, "invalid_request")


def object_of(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object, not {type(value).__name__}")
    return value


def list_of(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list, not {type(value).__name__}")
    return value


def text_of(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string, not {type(value).__name__}")
    return value


def base_id(chat: dict[str, Any]) -> str:
    """The unique part of a chat completion's id (`chatcmpl-<this>`), for the ids of what it is translated into."""
    return str(chat.get("id") or "").removeprefix("chatcmpl-") or "0"


def first_choice(chat: dict[str, Any]) -> dict[str, Any]:
    choices = chat.get("choices") or [{}]
    return choices[0]


def reasoning_of(message: dict[str, Any]) -> str | None:
    """vLLM's reasoning text (a reasoning parser's output); older versions call it `reasoning_content`."""
    return message.get("reasoning") or message.get("reasoning_content") or None


def logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]]:
    return ((choice.get("logprobs") or {}).get("content")) or []

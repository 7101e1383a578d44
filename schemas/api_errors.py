"""The error shape of agentstream's HTTP APIs, the gateway's and the dashboard's alike:
`{"error": {"message", "type", "code"}}` (OpenAI's, so agents' SDKs raise their usual exceptions).

`ApiError` is raised anywhere in a request's path; each app answers it with its framework's response
of `body` and `status`. It lives here, below both apps, because the shape is their shared contract:
the dashboard does not import the gateway to answer an error.
"""

from __future__ import annotations

from typing import Any

from agentstream.schemas.errors import AgentstreamError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "conflict_error", 502: "upstream_error", 503: "service_unavailable", 504: "upstream_error"}


class ApiError(AgentstreamError):
    """An error a client gets as an HTTP response: its status, message and stable `code`."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}

    @property
    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code)


def error_body(status: int, message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "code": str(code)}}

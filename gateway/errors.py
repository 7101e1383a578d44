"""Errors in the OpenAI shape `{"error": {"message", "type", "code"}}`, so agents' SDKs raise their usual exceptions."""

from __future__ import annotations

import orjson
from starlette.responses import Response

from schemas.errors import AgentstreamError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 502: "upstream_error", 503: "service_unavailable", 504: "upstream_error"}


class GatewayError(AgentstreamError):
    """An error the agent gets as an HTTP response; raise it anywhere in a request's path."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}

    @property
    def body(self) -> dict:
        return error_body(self.status, self.message, self.code)

    def response(self) -> Response:
        return Response(orjson.dumps(self.body), self.status, headers=self.headers, media_type="application/json")


def error_body(status: int, message: str, code: str) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "code": code}}


def unavailable(message: str, code: str, retry_after_s: float) -> GatewayError:
    return GatewayError(503, message, code, headers={"Retry-After": str(max(1, round(retry_after_s)))})

"""The errors an agent gets from the gateway, as HTTP responses in its API's own error shape.

Every one is a `GatewayError`: raise it anywhere in a request's path and the agent gets its
status, message and `code` (an `ErrorCode`), in the OpenAI shape `{"error": {"message", "type",
"code"}}` by default, so agents' SDKs raise their usual exceptions (the Anthropic Messages API
answers in its own shape, `gateway.messages`).

    AgentstreamError              (schemas.errors) every error this project raises
    └── ApiError                  (schemas.api_errors) the error shape of the project's HTTP APIs
        └── GatewayError          any error the agent gets as an HTTP response
            ├── BadRequest       (400)    the agent's request is wrong: JSON, a field, a value the pool cannot take
            ├── Unauthorized     (401)    no key, or not one of ours
            ├── Forbidden        (403)    a rollout token used for another rollout or attempt, a key beyond its scope
            ├── NotFound         (404)    a model or path not served here
            ├── Conflict         (409)    a feedback id already used for another body
            ├── TooLarge         (413)    a body over its limit
            ├── UpstreamFailed   (502)    the inference server failed, or answered with something unusable
            └── Unavailable      (503)    Kafka is not acknowledging, or a model is held for a weight update
                                      (with Retry-After)

A bad field is the agent's error (`BadRequest`), found before anything goes upstream; what the
upstream gets wrong is `UpstreamFailed`, never a 500.
"""

from __future__ import annotations

from enum import StrEnum

import orjson
from starlette.responses import Response

from agentstream.schemas.api_errors import ApiError


class ErrorCode(StrEnum):
    """The `code` of every error the gateway answers with (stable: agents and operators match on them)."""

    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request"
    MISSING_MODEL = "missing_model"
    REFUSED_FIELD = "refused_field"
    """a field the pool cannot take (`GatewaySettings.refused_fields`)"""
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    WRONG_ROLLOUT = "wrong_rollout"
    WRONG_ATTEMPT = "wrong_attempt"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    ADAPTER_UNAVAILABLE = "adapter_unavailable"
    """a tenant's LoRA adapter its server could not load (`gateway/lora.py`)"""
    DIFF_TOO_LARGE = "diff_too_large"
    INVALID_SESSION = "invalid_session"
    SESSION_FORBIDDEN = "session_forbidden"
    """a rollout token used for a session's end or feedback: sessions are operator traffic"""
    KEY_SCOPE = "key_scope"
    """a key used beyond its scope: a read-only key on the gateway, an app key for a rollout"""
    REWARD_FROM_GRADER = "reward_from_grader"
    """an agent's reward for an attempt a grader or reward function scores (its token says so)"""
    FEEDBACK_CONFLICT = "feedback_conflict"
    """a feedback id its sender already used for a different body (409)"""
    BODY_TOO_LARGE = "body_too_large"
    HTTP_ERROR = "http_error"
    UPSTREAM_ERROR = "upstream_error"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_NON_FINITE = "upstream_non_finite"
    """the upstream's answer holds a number that is not finite (NaN, ±Infinity), which no event can carry"""
    KAFKA_UNAVAILABLE = "kafka_unavailable"
    MODEL_UPDATING = "model_updating"


class GatewayError(ApiError):
    """An error the agent gets as an HTTP response; raise it anywhere in a request's path."""

    def response(self) -> Response:
        return Response(orjson.dumps(self.body), self.status, headers=self.headers, media_type="application/json")


class BadRequest(GatewayError):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST):
        super().__init__(400, message, code)


class Unauthorized(GatewayError):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_API_KEY):
        super().__init__(401, message, code)


class Forbidden(GatewayError):
    def __init__(self, message: str, code: ErrorCode):
        super().__init__(403, message, code)


class NotFound(GatewayError):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.NOT_FOUND):
        super().__init__(404, message, code)


class Conflict(GatewayError):
    def __init__(self, message: str, code: ErrorCode):
        super().__init__(409, message, code)


class TooLarge(GatewayError):
    def __init__(self, message: str, code: ErrorCode):
        super().__init__(413, message, code)


class UpstreamFailed(GatewayError):
    def __init__(self, message: str, code: ErrorCode = ErrorCode.UPSTREAM_ERROR):
        super().__init__(502, message, code)


class Unavailable(GatewayError):
    def __init__(self, message: str, code: ErrorCode, retry_after_s: float):
        super().__init__(503, message, code, headers={"Retry-After": str(max(1, round(retry_after_s)))})


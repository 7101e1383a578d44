"""A stand-in for a model provider that cannot run here (OpenAI, Anthropic's OpenAI-compatible endpoint): a Starlette
server speaking chat completions as they do, and only that. It wants its key as a bearer token (a wrong one gets a
401 that quotes it, as OpenAI's "Incorrect API key provided: sk-…" does), refuses a field it does not know with a 400
(as OpenAI refuses vLLM's `return_token_ids`), has no /health, no /v1/models of this platform, no token ids. It answers
fixed texts: the i-th answer to a conversation holding i assistant messages. Every request is kept, headers too."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentstream.stack.process import free_port
from tests.support.wait import wait_for

KNOWN_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
                          "stop", "stream", "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs",
                          "presence_penalty", "frequency_penalty", "user", "response_format", "seed"})
"""chat completions' fields as a provider takes them; vLLM's extensions are not among them"""


@dataclass
class Provider:
    url: str
    key: str
    answers: list[str]
    fields: frozenset[str] | None = KNOWN_FIELDS
    """the fields it takes; None: any, and a /health (a stand-in for this platform's own server, to see what it is
    sent)"""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """each request's `headers` (lower-cased names) and `body`, in order"""

    def app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"])]
        if self.fields is None:
            routes.append(Route("/health", lambda _request: JSONResponse({})))
        return Starlette(routes=routes)

    async def chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append({"headers": dict(request.headers), "body": body})
        given = request.headers.get("authorization", "").removeprefix("Bearer ")
        if given != self.key:
            return error(401, f"Incorrect API key provided: {given}. You can find your API key at "
                              "https://provider.example/keys.", "invalid_api_key")
        unknown = sorted(set(body) - self.fields) if self.fields is not None else []
        if unknown:
            return error(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", None)
        turn = sum(1 for message in body.get("messages", []) if message.get("role") == "assistant")
        text = self.answers[min(turn, len(self.answers) - 1)]
        return JSONResponse({
            "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "choices": [{"index": 0, "finish_reason": "stop",
                                                    "message": {"role": "assistant", "content": text}}],
            # a provider counts its own tokens: ~4 characters a token
            "usage": {"prompt_tokens": 100, "completion_tokens": len(text) // 4 + 1, "total_tokens": 100 + len(text) // 4 + 1}})


def error(status: int, message: str, code: str | None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
                        status)


@contextmanager
def running_provider(key: str, answers: list[str], fields: frozenset[str] | None = KNOWN_FIELDS) -> Iterator[Provider]:
    """The provider on 127.0.0.1, in a thread of its own (so that a test's blocking command can call it)."""
    port = free_port()
    provider = Provider(f"http://127.0.0.1:{port}", key, answers, fields)
    server = uvicorn.Server(uvicorn.Config(provider.app(), host="127.0.0.1", port=port, log_config=None,
                                          access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, name="provider", daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), timeout=30, what="the provider stand-in to start")
    assert server.started, "the provider stand-in stopped while starting"
    try:
        yield provider
    finally:
        server.should_exit = True
        thread.join(timeout=10)

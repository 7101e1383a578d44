"""The OpenAI chat completions API (`POST /v1/chat/completions`), proxied to the upstream's own.

The request is checked field by field (`request`) and, in training mode, asks for token ids and
logprobs; the answer (`response`, or chunk by chunk `stream`) is captured and stripped of what
the agent did not ask for.
"""

from __future__ import annotations

from agentstream.gateway.adapter import Adapter, Body, Rewrite, StreamAssembler, Tokens
from agentstream.gateway.chat.request import check, rewrite_openai
from agentstream.gateway.chat.response import finish
from agentstream.gateway.chat.stream import ChatAssembler


class ChatCompletions(Adapter):
    api = "chat.completions"
    path = "/v1/chat/completions"

    def check(self, body: Body) -> None:
        check(body)

    def rewrite(self, body: Body, training: bool) -> Rewrite:
        return rewrite_openai(body, training, logprobs_asked=body.get("logprobs") is True, logprobs_value=True)

    def finish(self, response: Body, rewrite: Rewrite) -> Tokens:
        return finish(response, rewrite)

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return ChatAssembler(rewrite)


__all__ = ["ChatAssembler", "ChatCompletions"]

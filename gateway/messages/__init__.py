"""The Anthropic Messages API (`POST /v1/messages`), served by translating each call to a chat completion.

Why not proxy vLLM's own /v1/messages: in vLLM 0.32 it is a translation to chat completions
inside the server (`AnthropicServingMessages`), and its answer keeps nothing of the chat
completion's token ids or logprobs (the request model has no `return_token_ids`/`logprobs`, the
response model no field for them). So the gateway does the same translation itself, sends a
chat completion that asks for token ids and logprobs, and translates the answer back: the
tokens recorded are the chat path's, exact, and `prompt_token_ids` is what the upstream's chat
template rendered, the prompt the model saw.

Errors, the gateway's and the upstream's, are in the Anthropic shape
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import orjson

from agentstream.gateway.adapter import Body, Rewrite, StreamAssembler
from agentstream.gateway.errors import ErrorCode
from agentstream.gateway.messages.request import check, to_chat, tokenize_request
from agentstream.gateway.messages.response import count_tokens_response, error_body, from_chat
from agentstream.gateway.messages.stream import MessagesStream
from agentstream.gateway.translation import ChatTranslation


class Messages(ChatTranslation):
    api = "messages"
    path = "/v1/messages"

    def error_body(self, status: int, message: str, code: ErrorCode | str) -> Body:
        return error_body(status, message)

    def relay_error(self, status: int, raw: bytes, message: str) -> bytes:
        return orjson.dumps(error_body(status, message))

    def check(self, body: Body) -> None:
        check(body)

    def to_chat(self, body: Body) -> Body:
        return to_chat(body)

    def from_chat(self, chat: Body, request: Body) -> Body:
        return from_chat(chat, request)

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return MessagesStream(rewrite)

    tokenize_request = staticmethod(tokenize_request)
    count_tokens_response = staticmethod(count_tokens_response)

"""The OpenAI Responses API (`POST /v1/responses`), served by translating each call to a chat completion.

Why not proxy vLLM's own /v1/responses: vLLM 0.32 serves it, and with `enable_response_messages`
its answer does show the exact prompt and output token ids (`input_messages`, `output_messages`,
also in a stream's `response.completed`). But its logprobs ride on `output_text` parts only
(`include: ["message.output_text.logprobs"]`): a turn that only calls a tool, or whose reasoning
the parser takes out, comes back with token ids and no logprobs, and streamed tool-call tokens
have none either. As a chat completion the same call returns every generated token's id and
logprob (`return_token_ids`, `logprobs`), so the gateway sends it upstream as one and translates
the answer back. `prompt_token_ids` are then what the upstream's chat template rendered from the
translated messages: the exact prompt the model saw, as for a chat call.
"""

from __future__ import annotations

from agentstream.gateway.adapter import Body, Rewrite, StreamAssembler
from agentstream.gateway.responses.request import check, to_chat
from agentstream.gateway.responses.response import from_chat
from agentstream.gateway.responses.stream import ResponsesStream
from agentstream.gateway.translation import ChatTranslation


class Responses(ChatTranslation):
    api = "responses"
    path = "/v1/responses"

    def check(self, body: Body) -> None:
        check(body)

    def to_chat(self, body: Body) -> Body:
        return to_chat(body)

    def from_chat(self, chat: Body, request: Body) -> Body:
        return from_chat(chat, request)

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return ResponsesStream(rewrite)

"""The capture layer on its own: request rewrites, stripping, stream assembly, SSE framing.

Inputs are written in the shapes vLLM sends (see test_gateway_api.py for the same paths against
the real server); what the tiny model cannot produce (tool calls, several choices) is covered here.
"""

from __future__ import annotations

import copy

from agentstream.gateway import sse
from agentstream.gateway.chat import ChatCompletions
from agentstream.gateway.completions import Completions

CHAT = ChatCompletions()
COMPLETIONS = Completions()


def chunk(index=0, content=None, ids=None, logprobs=None, finish=None, **delta):
    choice = {"index": index, "delta": {**({"content": content} if content is not None else {}), **delta},
              "logprobs": {"content": [{"token": "x", "logprob": lp} for lp in logprobs]} if logprobs else None,
              "finish_reason": finish, "token_ids": ids}
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": [choice]}


def test_training_rewrite_asks_for_tokens_and_leaves_the_agents_request_alone():
    body = {"model": "tiny", "messages": [], "stream": True, "temperature": 0.5, "custom_field": [1]}
    original = copy.deepcopy(body)
    rewrite = CHAT.rewrite(body, training=True)
    assert body == original, "the agent's request (recorded as sent) was changed"
    assert rewrite.body["return_token_ids"] is True and rewrite.body["logprobs"] is True
    assert rewrite.body["stream_options"] == {"include_usage": True}
    assert rewrite.body["custom_field"] == [1], "unknown fields must pass through"
    assert rewrite.strip_token_ids and rewrite.strip_logprobs and rewrite.strip_usage_chunk

    asked = CHAT.rewrite({**body, "logprobs": True, "top_logprobs": 3, "stream_options": {"include_usage": True}}, True)
    assert asked.body["top_logprobs"] == 3 and not asked.strip_logprobs and not asked.strip_usage_chunk

    assert CHAT.rewrite(body, training=False).body is body, "passthrough mode forwards the request unchanged"
    assert COMPLETIONS.rewrite({"model": "m", "prompt": "p"}, True).body["logprobs"] == 0
    assert not COMPLETIONS.rewrite({"model": "m", "prompt": "p", "logprobs": 2}, True).strip_logprobs


def test_non_streamed_chat_is_stripped_back_to_what_the_agent_asked_for():
    rewrite = CHAT.rewrite({"model": "tiny", "messages": []}, training=True)
    response = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
             "token_ids": [104, 105], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}},
            {"index": 1, "message": {"role": "assistant", "content": "h"}, "finish_reason": "length",
             "token_ids": [104], "logprobs": {"content": [{"logprob": -1.0}]}},
        ],
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }
    tokens = CHAT.finish(response, rewrite)
    assert tokens.prompt_token_ids == [1, 2, 3]
    assert tokens.completion_token_ids == [104, 105] and tokens.logprobs == [-0.5, -0.25]
    assert tokens.finish_reason == "stop"
    assert [(c.index, c.completion_token_ids, c.logprobs) for c in tokens.extra_choices] == [(1, [104], [-1.0])]
    assert tokens.usage.total_tokens == 6
    assert response["prompt_token_ids"] is None
    assert all(c["token_ids"] is None and c["logprobs"] is None for c in response["choices"])


def test_streamed_tool_calls_and_choices_assemble_into_one_response():
    rewrite = CHAT.rewrite({"model": "tiny", "messages": [], "stream": True, "n": 2}, training=True)
    assembler = CHAT.assembler(rewrite)
    first = chunk(content="", role="assistant")
    first["prompt_token_ids"] = [7, 8]
    chunks = [
        first,
        chunk(content="Let me", ids=[1, 2], logprobs=[-0.1, -0.2]),
        chunk(index=1, content="No", ids=[9], logprobs=[-0.9]),
        chunk(ids=[3], logprobs=[-0.3], tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                                      "function": {"name": "add", "arguments": "{\"a\": "}}]),
        chunk(ids=[4], logprobs=[-0.4], tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
        chunk(index=1, ids=[10], logprobs=[-1.0], finish="length"),
        chunk(ids=[5], logprobs=[-0.5], finish="tool_calls"),
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9}},
    ]
    forwarded = [assembler.feed(c) for c in chunks]

    assert forwarded[-1] is None, "the usage chunk the agent did not ask for must not reach it"
    assert forwarded[0]["prompt_token_ids"] is None
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["logprobs"] is None for c in forwarded[:-1])
    assert assembler.finished and assembler.tokens_seen

    tokens = assembler.tokens()
    assert tokens.prompt_token_ids == [7, 8]
    assert tokens.completion_token_ids == [1, 2, 3, 4, 5] and tokens.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert tokens.finish_reason == "tool_calls"
    assert tokens.extra_choices[0].completion_token_ids == [9, 10]
    assert tokens.usage.completion_tokens == 7

    response = assembler.response()
    assert response["object"] == "chat.completion" and response["usage"] is None
    message = response["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "Let me"
    assert message["tool_calls"] == [{"id": "call_1", "type": "function",
                                      "function": {"name": "add", "arguments": "{\"a\": 1}"}}]
    assert response["choices"][1]["message"]["content"] == "No"
    assert response["choices"][1]["finish_reason"] == "length"


def test_missing_logprobs_leave_the_logprobs_unset_rather_than_misaligned():
    assembler = CHAT.assembler(CHAT.rewrite({"model": "tiny", "messages": [], "stream": True}, training=True))
    assembler.feed(chunk(content="a", ids=[97], logprobs=[-0.1]))
    assembler.feed(chunk(content="b", ids=[98], finish="stop"))  # this chunk came without logprobs
    tokens = assembler.tokens()
    assert tokens.completion_token_ids == [97, 98] and tokens.logprobs is None


def test_streamed_completions_assemble_text_and_logprobs():
    rewrite = COMPLETIONS.rewrite({"model": "m", "prompt": "ab", "stream": True, "logprobs": 0}, training=True)
    assembler = COMPLETIONS.assembler(rewrite)

    def piece(text, ids, lp, finish=None, prompt=None):
        logprobs = {"tokens": [text], "token_logprobs": lp, "top_logprobs": [{text: lp[0]}], "text_offset": [0]}
        return {"id": "x", "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                                        "token_ids": ids, "prompt_token_ids": prompt}]}

    out = [assembler.feed(piece("c", [99], [-1.0], prompt=[97, 98])), assembler.feed(piece("d", [100], [-2.0], "length"))]
    assert out[0]["choices"][0]["logprobs"]["token_logprobs"] == [-1.0], "the agent asked for logprobs"
    assert out[0]["choices"][0]["token_ids"] is None and out[0]["choices"][0]["prompt_token_ids"] is None
    tokens = assembler.tokens()
    assert (tokens.prompt_token_ids, tokens.completion_token_ids, tokens.logprobs) == ([97, 98], [99, 100], [-1.0, -2.0])
    choice = assembler.response()["choices"][0]
    assert choice["text"] == "cd" and choice["logprobs"]["token_logprobs"] == [-1.0, -2.0]
    assert choice["finish_reason"] == "length"


async def test_sse_framing_survives_arbitrary_chunk_boundaries_and_crlf():
    stream = b'data: {"a": 1}\r\n\r\n: comment\n\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'

    async def pieces(size):
        for start in range(0, len(stream), size):
            yield stream[start:start + size]

    for size in (1, 3, 7, len(stream)):
        assert [data async for data in sse.data_of(pieces(size))] == [b'{"a": 1}', b'{"b":\n2}', b"[DONE]"]

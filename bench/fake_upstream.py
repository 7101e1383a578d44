"""A tiny OpenAI-shaped server, fast enough that a benchmark measures the gateway, not the model.

It answers `/v1/chat/completions` and `/v1/completions` (streamed or not) with a fixed number
of tokens, in vLLM's shapes: token ids and logprobs when asked (`return_token_ids`, `logprobs`),
and the endpoints the gateway's health checks use. A raw ASGI app on uvicorn (uvloop, httptools).
`--delay-ms` makes each answer take that long without using the CPU: a model's service time, so
that clients call at the pace agents do rather than as fast as the machine allows. It takes a
weight swap as vLLM's RL endpoints do (`/pause`, `/collective_rpc`, `/update_weight_version`,
`/resume`; `/weight_info` reports the label), loading nothing: for runs with a trainer in the loop.

    python -m bench.fake_upstream --port 8001 [--delay-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
import uvicorn

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]
PROMPT_IDS = list(range(97, 97 + 21))
DELAY_S = 0.0
SWAP = {"version": "default", "paused": False}
"""the weight swap's state: the version label, and whether the engine is paused"""


async def _reply(send, status: int, body: bytes, headers=JSON) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _completion(request: dict, chat: bool) -> tuple[list[int], str]:
    count = int(request.get("max_tokens") or 16)
    ids = [97 + i % 26 for i in range(count)]
    return ids, bytes(ids).decode()


def _choice(chat: bool, text: str, ids: list[int], request: dict, finish: str | None, delta: bool = False) -> dict:
    logprobs = None
    if request.get("logprobs") not in (None, False):
        if chat:
            logprobs = {"content": [{"token": chr(i), "logprob": -0.5, "bytes": [i], "top_logprobs": []} for i in ids]}
        else:
            logprobs = {"tokens": [chr(i) for i in ids], "token_logprobs": [-0.5] * len(ids),
                        "top_logprobs": [{chr(i): -0.5} for i in ids], "text_offset": list(range(len(ids)))}
    choice: dict = {"index": 0, "logprobs": logprobs, "finish_reason": finish,
                    "token_ids": ids if request.get("return_token_ids") else None}
    if chat:
        choice["delta" if delta else "message"] = {"role": "assistant", "content": text} if not delta else {"content": text}
    else:
        choice["text"] = text
    return choice


SWAP_STEPS = {
    "/pause": lambda body: SWAP.update(paused=True),
    "/resume": lambda body: SWAP.update(paused=False),
    "/collective_rpc": lambda body: None,
    "/reset_prefix_cache": lambda body: None,
    "/update_weight_version": lambda body: SWAP.update(version=str(body["new_version"])),
}


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        await receive()  # startup
        await send({"type": "lifespan.startup.complete"})
        await receive()  # shutdown
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if scope["method"] == "GET":
        if path == "/health":
            return await _reply(send, 200, b"")
        if path == "/weight_info":
            return await _reply(send, 200, orjson.dumps({"weight_version": SWAP["version"]}))
        if path == "/is_paused":
            return await _reply(send, 200, orjson.dumps({"is_paused": SWAP["paused"]}))
        if path == "/v1/models":
            return await _reply(send, 200, b'{"object":"list","data":[{"id":"tiny","object":"model"}]}')
        return await _reply(send, 404, b'{"error":{"message":"not found"}}')
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if path in SWAP_STEPS:
        SWAP_STEPS[path](orjson.loads(body) if body.strip() else {})
        return await _reply(send, 200, b'{"success":true}')
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return await _reply(send, 404, b'{"error":{"message":"not found"}}')
    chat = path == "/v1/chat/completions"
    request = orjson.loads(body)
    if DELAY_S:
        await asyncio.sleep(DELAY_S)
    ids, text = _completion(request, chat)
    prompt = PROMPT_IDS if request.get("return_token_ids") else None
    head = {"id": "cmpl-bench", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": request.get("model", "tiny")}
    usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(ids), "total_tokens": len(PROMPT_IDS) + len(ids)}
    if not request.get("stream"):
        payload = {**head, "choices": [_choice(chat, text, ids, request, "length")], "usage": usage}
        if chat:
            payload["prompt_token_ids"] = prompt
        else:
            payload["choices"][0]["prompt_token_ids"] = prompt
        return await _reply(send, 200, orjson.dumps(payload))

    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    for position, token in enumerate(ids):
        finish = "length" if position == len(ids) - 1 else None
        chunk = {**head, "choices": [_choice(chat, chr(token), [token], request, finish, delta=True)]}
        if position == 0:
            (chunk if chat else chunk["choices"][0])["prompt_token_ids"] = prompt
        await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n", "more_body": True})
    if (request.get("stream_options") or {}).get("include_usage"):
        chunk = {**head, "choices": [], "usage": usage}
        await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="each answer's service time")
    args = parser.parse_args(argv)
    global DELAY_S
    DELAY_S = args.delay_ms / 1000
    uvicorn.run(app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", backlog=4096)


if __name__ == "__main__":
    main()

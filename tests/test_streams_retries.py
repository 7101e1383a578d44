"""An agent's SDK retrying a request whose answer it did not get: the gateway records which retry a
call is, from the SDK's own headers, for the assembly to tell a retry from a new turn."""

from __future__ import annotations

import openai
import pytest

from agentstream.stack.process import free_port
from tests.gateway_support import OPERATOR_KEY, gateway_settings, read_events, running_gateway

pytestmark = pytest.mark.timeout(180)


async def test_the_gateway_records_the_openai_sdks_retry_number(kafka):
    """The only upstream is down: the gateway answers 5xx, and the real OpenAI SDK sends the same
    request again, saying so in `x-stainless-retry-count`."""
    down = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(gateway_settings(kafka, [down])) as gateway:
        client = openai.AsyncOpenAI(api_key=OPERATOR_KEY, base_url=f"{gateway.url}/v1", max_retries=1)
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        plain = await gateway.http().post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})  # no SDK: nothing said
        assert plain.status_code >= 500
    calls = await read_events(kafka, kafka.topics.calls, count=3)
    assert [call.data.retry_count for call in sorted(calls, key=lambda c: c.data.started_at)] == [0, 1, None]
    assert calls[0].data.request == calls[1].data.request  # the same request, token for token

"""No response without its record: Kafka going away means 503s (never unrecorded answers), and
calls flow again once it is back. Uses a broker of its own, not the session's."""

from __future__ import annotations

import time

import openai
import pytest

from agentstream.schemas.kafka import KafkaSettings, ensure_topics
from agentstream.stack.process import free_port
from tests.support.gateway import gateway_settings, read_events, running_gateway
from tests.support.wait import wait_for_async

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_kafka_down_gives_503_and_calls_flow_again_when_it_returns(own_broker, vllm_server):
    broker = own_broker
    kafka = KafkaSettings(bootstrap_servers=broker.start(port=free_port()).url, topic_prefix="durable.")
    try:
        assert (await ensure_topics(kafka)).ok
        upstreams = [f"tiny={vllm_server.url}"]
        ack_settings = gateway_settings(kafka, upstreams, publish_timeout_s=3.0, pool_sync=False)
        async_settings = gateway_settings(kafka, upstreams, publish_timeout_s=3.0, pool_sync=False, durability="async")
        async with running_gateway(ack_settings) as gw, running_gateway(async_settings) as fast:
            client, fast_client = gw.openai(), fast.openai()
            before = await client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=2)
            fast_before = await fast_client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, max_tokens=2)
            await wait_for_async(lambda: fast.gateway.recorder.unacknowledged == 0, what="the async gateway's ack")

            assert broker.stop()
            # a stream already under way when Kafka stops: the agent gets its tokens, but not the end of the
            # response (finish chunk, [DONE]); an error event names the cause instead
            stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=True)
            received = []
            with pytest.raises(openai.APIError, match="Kafka"):
                async for chunk in stream:
                    received.append(chunk)
            assert received and all(chunk.choices[0].finish_reason is None for chunk in received if chunk.choices)

            # now the gateway knows: a 503 at once, before the upstream generates anything
            started = time.monotonic()
            with pytest.raises(openai.InternalServerError) as refused:
                await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
            assert refused.value.status_code == 503 and time.monotonic() - started < 1.0
            assert refused.value.response.headers["retry-after"]
            assert refused.value.body["code"] == "kafka_unavailable"
            assert "Kafka" in refused.value.message
            async with gw.http() as http:
                assert (await http.post("/rollouts/r1/reward", json={"value": 1})).status_code == 503
                assert (await http.get("/healthz")).json()["kafka"] is False

            # async durability answers without the ack, until an event waits longer than the publish timeout
            unacked = await fast_client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, max_tokens=2)

            async def refused_by_fast() -> bool:
                try:
                    await fast_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
                except openai.InternalServerError as exc:
                    return exc.status_code == 503
                return False

            await wait_for_async(refused_by_fast, timeout=30, interval=0.5, what="the async gateway to notice")

            broker.start()

            async def served(agent) -> str | None:
                try:
                    raw = await agent.chat.completions.with_raw_response.create(
                        model="tiny", messages=MESSAGES, max_tokens=2)
                except openai.InternalServerError:
                    return None
                return raw.headers["x-agentstream-call-id"]

            after = await wait_for_async(lambda: served(client), timeout=60, interval=0.5, what="calls to flow again")
            fast_after = await wait_for_async(lambda: served(fast_client), timeout=60, interval=0.5,
                                              what="async calls to flow again")
            expected = {before.headers["x-agentstream-call-id"], fast_before.headers["x-agentstream-call-id"], after,
                        fast_after, unacked.headers["x-agentstream-call-id"]}  # the producer kept that one for later

            async def all_recorded() -> bool:
                return expected <= {event.id for event in await read_events(kafka, kafka.topics.calls, settle_ms=200)}

            await wait_for_async(all_recorded, timeout=30, interval=0.5, what="every answered call in the log")
    finally:
        broker.stop()


async def test_async_durability_answers_first_and_records_in_the_background(kafka, vllm_server):
    settings = gateway_settings(kafka, [f"tiny={vllm_server.url}"], durability="async", pool_sync=False)
    async with running_gateway(settings) as gw:
        client = gw.openai()
        ids = []
        for stream in (False, True):
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, max_tokens=3, stream=stream)
            if stream:
                [chunk async for chunk in raw.parse()]
            ids.append(raw.headers["x-agentstream-call-id"])
        events = {event.id: event for event in await read_events(kafka, kafka.topics.calls, count=2)}
        assert set(ids) == set(events)
        assert all(event.data.status == 200 and event.data.completion_token_ids for event in events.values())

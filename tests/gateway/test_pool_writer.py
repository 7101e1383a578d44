"""One writer per server: three gateway processes share a real vLLM server and a real broker; the one that
applies a weight update is killed (-9) mid-update, and another finishes it. The server ends on the weights
of the version it reports, the survivors' agents see no error, and the engine holds no request while it is
paused (the survivors hold theirs until the pool event says the update is done)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from agentstream.gateway.pool import _BUSY
from agentstream.schemas import PoolUpdateEvent
from tests.gateway.test_pool_sync import MESSAGES, publish, served_version, weights
from tests.support.gateway import GatewayProcess, read_events
from tests.support.vllm import hf_logprobs, served_logprobs
from tests.support.wait import wait_for_async

pytestmark = [pytest.mark.vllm,
              pytest.mark.slow]  # a broker's session timeout (10 s) before another replica takes the update over

REPLICAS = 3
TOKENS = [1, 42, 7, 99, 200, 5, 120, 12]


class Engine:
    """What the test sees of the vLLM server: its pause state, and the requests it holds while paused."""

    def __init__(self, url: str):
        self.http = httpx.AsyncClient(base_url=url, timeout=10)
        self.paused_seen = 0
        self.busy_while_paused: list[float] = []
        self.problems: list[str] = []

    async def is_paused(self) -> bool:
        return (await self.http.get("/is_paused")).json()["is_paused"] is True

    async def busy(self) -> float:
        text = (await self.http.get("/metrics")).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.split("{", 1)[0].split(" ", 1)[0] in _BUSY)

    async def watch(self) -> None:
        """Sample the requests the engine holds, between two samples that both found it paused."""
        while True:
            try:
                before = await self.is_paused()
                busy = await self.busy()
                after = await self.is_paused()
            except httpx.HTTPError as exc:  # a slow answer under load: sample again
                self.problems.append(f"{type(exc).__name__}: {exc}")
                continue
            if before and after:
                self.paused_seen += 1
                if busy:
                    self.busy_while_paused.append(busy)


@pytest.mark.parametrize("fault", ["gateway.after_reload", "gateway.after_label"])
async def test_a_writer_killed_mid_update_is_replaced_and_no_request_sees_the_paused_engine(
        kafka, vllm_server, tmp_path, fault):
    env = {"AGENTSTREAM_HOLD_TIMEOUT_S": "180", "AGENTSTREAM_HEALTH_INTERVAL_S": "0.5",
           "AGENTSTREAM_FAULT_ONCE": str(tmp_path / "fired"), "AGENTSTREAM_LOG_LEVEL": "info"}
    replicas = [GatewayProcess(kafka, [f"tiny={vllm_server.url}"], tmp_path / f"gw-{i}.log", fault=fault,
                               env={**env, "AGENTSTREAM_REPLICA_ID": f"gw-{i}"}) for i in range(REPLICAS)]
    engine = Engine(vllm_server.url)
    start_version = _version(vllm_server)
    new_version = start_version + 1
    errors: dict[str, list[str]] = {f"gw-{i}": [] for i in range(REPLICAS)}
    done: list[tuple[str, float]] = []  # (replica, monotonic time the call started)
    stop = asyncio.Event()

    async def agent(name: str, replica: GatewayProcess) -> None:
        async with replica.http() as http:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    async with http.stream("POST", "/v1/chat/completions", json={
                            "model": "tiny", "messages": MESSAGES, "max_tokens": 8, "stream": True}) as response:
                        body = (await response.aread()).decode()
                    problem = None if response.status_code == 200 and "[DONE]" in body else \
                        f"{response.status_code}: {body[:300]}"
                except httpx.HTTPError as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                if problem:
                    errors[name].append(problem)  # the killed replica's are not counted
                else:
                    done.append((name, started))
                if replica.process.poll() is not None:
                    return

    watcher = asyncio.create_task(engine.watch())
    agents: list[asyncio.Task[None]] = []
    try:
        for replica in replicas:
            await asyncio.to_thread(replica.start)
        agents = [asyncio.create_task(agent(f"gw-{i}", replica)) for i, replica in enumerate(replicas) for _ in range(3)]
        await wait_for_async(lambda: len(done) >= 15, timeout=120, what="traffic before the update")

        await publish(kafka, weights("tiny", new_version, vllm_server.other_checkpoint))
        [killed] = await wait_for_async(lambda: [r for r in replicas if r.process.poll() is not None], timeout=180,
                                        what="the replica applying the update to die")
        killed_name = killed.env["AGENTSTREAM_REPLICA_ID"]
        assert killed.process.returncode == -9
        survivors = [replica for replica in replicas if replica is not killed]

        async def finished() -> bool:
            return served_version(vllm_server) == str(new_version) and not await engine.is_paused()

        await wait_for_async(finished, timeout=240, what="another replica to finish the update")
        for replica in survivors:
            await wait_for_async(lambda replica=replica: _released(replica, new_version), timeout=60,
                                 what="every survivor to release its hold")
        released = time.monotonic()
        await wait_for_async(lambda: sum(started > released for _, started in done) >= 12, timeout=120,
                             what="traffic after the update")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*agents), 120)

        assert {name: seen for name, seen in errors.items() if name != killed_name and seen} == {}, \
            "the surviving replicas' agents saw errors"
        if watcher.done():
            watcher.result()  # its failure, if it stopped
        assert engine.paused_seen > 0, f"the test never saw the engine paused: it checked nothing {engine.problems[:3]}"
        assert engine.busy_while_paused == [], "requests ran on (or waited in) a paused engine"
        # the weights served are those of the version the server reports
        served = served_logprobs(vllm_server, TOKENS)
        loaded = (served - hf_logprobs(vllm_server.other_checkpoint, TOKENS)).abs().max().item()
        before = (served - hf_logprobs(vllm_server.model_dir, TOKENS)).abs().max().item()
        assert loaded < 2e-3 < before, f"served logprobs differ by {loaded} from the new weights, {before} from the old"

        updates = [event.data for event in await read_events(kafka, kafka.topics.pool, count=1)
                   if isinstance(event, PoolUpdateEvent) and event.data.version == new_version]
        assert {update.status for update in updates} == {"ok"}
        assert {update.applied_by for update in updates} <= {f"gw-{i}" for i in range(REPLICAS)} - {killed_name}
        calls = [event.data for event in await read_events(kafka, kafka.topics.calls, count=len(done))]
        assert all(call.weight_version in (start_version, new_version) for call in calls)
    finally:
        stop.set()
        watcher.cancel()
        for task in agents:
            task.cancel()
        await asyncio.gather(watcher, *agents, return_exceptions=True)
        with contextlib.suppress(AssertionError):  # the session's server back on its first weights for other tests
            await _restore(kafka, vllm_server, replicas)
        for replica in replicas:
            replica.stop()
        await engine.http.aclose()


async def _released(replica: GatewayProcess, version: int) -> bool:
    async with replica.http() as http:
        health = (await http.get("/healthz")).json()
    return not health["holds"] and all(upstream["weight_version"] == version for upstream in health["upstreams"])


async def _restore(kafka, vllm_server, replicas: list[GatewayProcess]) -> None:
    if not any(replica.process and replica.process.poll() is None for replica in replicas):
        return
    version = _version(vllm_server) + 1
    await publish(kafka, weights("tiny", version, vllm_server.model_dir))
    await wait_for_async(lambda: served_version(vllm_server) == str(version), timeout=180,
                         what="the first weights back")


def _version(vllm_server) -> int:
    reported = served_version(vllm_server)
    return 0 if reported == "default" else int(reported)

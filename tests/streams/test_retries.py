"""An agent's SDK retrying a request whose answer it lost: the gateway records which retry a call is,
from the SDK's own headers, and the assembly makes the retry and the lost answer one turn."""

from __future__ import annotations

import asyncio

import openai
import pytest

from samples.assembly import assemble
from tests.support.gateway import OPERATOR_KEY, gateway_settings, read_events, running_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]  # the session-scoped vLLM server starts in the first test
ASCII = {"allowed_token_ids": list(range(32, 127))}  # every token one character: texts re-tokenize exactly


class LosingHop:
    """A TCP hop in front of the gateway that loses the first answer: the request goes through, the
    gateway records the call and answers, and the hop drops the answer and resets the agent's connection
    (what an agent sees when the gateway dies right after recording its call)."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.lost = 0
        self.port: int | None = None

    async def start(self) -> LosingHop:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        lose = self.lost == 0

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, dropping: bool) -> None:
            try:
                while data := await source.read(65536):
                    if dropping:  # the answer arrived, so the call is recorded: the agent never gets it
                        self.lost += 1
                        writer.transport.abort()
                        return
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, upstream_writer, False), pipe(upstream_reader, writer, lose))


async def test_an_sdk_retry_after_a_lost_answer_is_one_turn_of_the_trajectory(kafka, vllm_server):
    async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as gateway:
        hop = await LosingHop(gateway.settings.port).start()
        agent = openai.AsyncOpenAI(api_key=OPERATOR_KEY, max_retries=2,
                                   base_url=f"http://127.0.0.1:{hop.port}/rollouts/r-retry/attempts/a1/v1")
        try:
            question = [{"role": "user", "content": "Say something."}]
            answer = await agent.chat.completions.create(model="tiny", messages=question, max_tokens=8,
                                                         extra_body=ASCII)
            assert hop.lost == 1  # the SDK got the second answer, after a reset
            text = answer.choices[0].message.content
            await agent.chat.completions.create(
                model="tiny", max_tokens=8, extra_body=ASCII,
                messages=[*question, {"role": "assistant", "content": text}, {"role": "user", "content": "More."}])
            async with gateway.http() as http:
                finished = await http.post("/rollouts/r-retry/attempts/a1/finish", json={"exit_code": 0})
                assert finished.status_code == 200, finished.text
        finally:
            await agent.close()
            await hop.stop()
    calls = sorted(await read_events(kafka, kafka.topics.calls, count=3), key=lambda call: call.data.started_at)
    assert [call.data.retry_count for call in calls] == [0, 1, 0]  # x-stainless-retry-count, as the SDK sent it
    assert calls[0].data.prompt_token_ids == calls[1].data.prompt_token_ids  # the same request, token for token
    ends = await read_events(kafka, kafka.topics.rollouts, count=1)
    (trajectory,) = assemble([*calls, *ends])
    assert [turn.call_id for turn in trajectory.data.turns] == [calls[1].id, calls[2].id]
    assert trajectory.data.superseded == 1 and calls[0].id in trajectory.data.lineage
    assert trajectory.data.merged and trajectory.data.merge_mismatches == 0

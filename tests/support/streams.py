"""Rollouts as events, for the streams, replay and analytics tests; and real streams workers."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import agentstream.schemas as s
from agentstream.schemas.kafka import KafkaSettings, Publisher, make_producer
from agentstream.schemas.sessions import session_rollout_id
from agentstream.stack.process import free_port, spawn, stop_pid, tail
from tests.support import faults
from tests.support.wait import wait_for

REPO = Path(__file__).parents[2]
_clock = itertools.count(1_700_000_000_000, 100_000)


@dataclass
class Rollout:
    """Builds the events of one attempt as the controller, gateway and agent would write them."""

    rollout_id: str
    attempt_id: str = "a1"
    reward_fn: str | None = None
    metadata: dict = field(default_factory=dict)
    group_id: str = "g"
    managed: bool = True
    version: int = 0
    time: int = field(default_factory=lambda: next(_clock))
    """event time of the next event (ms); each event advances it by 10 ms"""

    def _ids(self) -> dict:
        return dict(source="test", rollout_id=self.rollout_id, attempt_id=self.attempt_id)

    def _at(self) -> int:
        self.time += 10
        return self.time

    def queued(self, task_id: str = "t1", sample_index: int = 0) -> s.RolloutQueuedEvent:
        task = s.Task(id=task_id, input={"prompt": "p"}, reward_fn=self.reward_fn, metadata=self.metadata)
        return s.RolloutQueuedEvent(**self._ids(), time=self._at(), data=s.RolloutQueued(
            task=task, group_id=self.group_id, sample_index=sample_index, weight_version=self.version,
            model="tiny", managed=self.managed))

    def call(self, prompt: list[int], completion: list[int], text: str = "", status: int = 200,
             retry_count: int | None = None) -> s.CallEvent:
        at = self._at()
        return s.CallEvent(**self._ids(), time=at, data=s.Call(
            api="chat.completions", model="tiny", weight_version=self.version, status=status, started_at=at - 5,
            latency_ms=5.0, request={"messages": []},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]},
            prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-0.5] * len(completion),
            finish_reason="stop", usage=s.Usage(prompt_tokens=len(prompt), completion_tokens=len(completion),
                                                total_tokens=len(prompt) + len(completion)),
            retry_count=retry_count))

    def reward(self, value: float, turns: list[s.TurnReward] = ()) -> s.RewardEvent:
        return s.RewardEvent(**self._ids(), time=self._at(), data=s.Reward(value=value, turns=list(turns)))

    def finished(self, by: str = "controller", after_ms: int = 0) -> s.RolloutFinishedEvent:
        self.time += after_ms
        return s.RolloutFinishedEvent(**self._ids(), time=self._at(), data=s.RolloutFinished(by=by, exit_code=0))

    def failed(self) -> s.RolloutFailedEvent:
        return s.RolloutFailedEvent(**self._ids(), time=self._at(), data=s.RolloutFailed(exit_code=1, error="exit 1"))

    def two_turns(self, merged: bool = True, reward: float | None = 1.0) -> list[s.Event]:
        """queued, two calls (the second's prompt extends the first turn, or rewrites it), reward, finished."""
        second_prompt = [1, 2, 3, 4, 5, 6, 7] if merged else [1, 9, 3, 6, 7]
        events = [self.queued(), self.call([1, 2, 3], [4, 5], "45"), self.call(second_prompt, [8, 9], "89")]
        if reward is not None:
            events.append(self.reward(reward))
        return events + [self.finished()]


class Session:
    """The events a gateway writes for one session: its calls, end and feedback, timed `at` ms after `start`."""

    def __init__(self, session_id: str, start: int = 1_700_000_000_000):
        self.session_id = session_id
        self.rollout_id = session_rollout_id(session_id)
        self.start = start

    def call(self, at: int, prompt: list[int], completion: list[int]) -> s.CallEvent:
        time = self.start + at
        return s.CallEvent(source="gateway", rollout_id=self.rollout_id, time=time, data=s.Call(
            api="chat.completions", model="tiny", session_id=self.session_id, status=200, started_at=time - 5,
            latency_ms=5.0, request={}, prompt_token_ids=prompt, completion_token_ids=completion,
            logprobs=[-0.5] * len(completion), weight_version=0))

    def end(self, at: int) -> s.SessionEndedEvent:
        return s.SessionEndedEvent(source="gateway", rollout_id=self.rollout_id, time=self.start + at,
                                   data=s.SessionEnded(session_id=self.session_id, sender="key:test"))

    def feedback(self, at: int, call: s.CallEvent | None = None, **values) -> s.FeedbackEvent:
        return s.FeedbackEvent(source="gateway", rollout_id=self.rollout_id, time=self.start + at, data=s.Feedback(
            session_id=self.session_id, call_id=call.id if call else None, sender="key:test", **values))


def live(rollout: Rollout) -> Rollout:
    """A rollout whose events carry the current time (for a live worker's wall-clock deadlines)."""
    rollout.time = s.now_ms()
    return rollout


async def publish(kafka: KafkaSettings, events: list[s.Event], raw: list[tuple[str, bytes, bytes]] = ()) -> None:
    """Write events (and raw (topic, key, value) records) in order, each acknowledged."""
    producer = make_producer(kafka)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka.topics)
        for event in events:
            await publisher.publish(event)
        for topic, key, value in raw:
            await producer.send_and_wait(kafka.topics.name(topic), value, key=key)
    finally:
        await producer.stop()


@dataclass
class StreamsWorker:
    """`python -m agentstream.streams worker` as a real process."""

    kafka: KafkaSettings
    data_dir: Path
    log: Path
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    fault: str | None = None
    """a fault of tests/support/faults.py to run it with"""

    def start(self) -> StreamsWorker:
        args = ["worker", "--bootstrap-servers", self.kafka.bootstrap_servers,
                "--topic-prefix", self.kafka.topic_prefix, "--web-port", str(self.port),
                "--data-dir", str(self.data_dir), "--settle-s", "0.2", "--reward-grace-s", "2", *self.args]
        cmd = faults.command(self.fault, "agentstream.streams", *args) if self.fault else [
            sys.executable, "-m", "agentstream.streams", *args]
        self.process = spawn(cmd, self.log, cwd=REPO)
        wait_for(self.ready, timeout=90, what=f"the streams worker to serve (log: {self.log})")
        return self

    def analytics(self, open_attempts: bool = False) -> dict | None:
        try:
            response = httpx.get(f"http://127.0.0.1:{self.port}/analytics", timeout=5,
                                 params={"open": "1"} if open_attempts else None)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def handled(self, base: str) -> int:
        """The records of a source topic it has handled, over its partitions (0 while it does not answer)."""
        view, topic = self.analytics(), self.kafka.topics.name(base)
        return sum(next_offset for key, (next_offset, _) in (view or {"sources": {}})["sources"].items()
                   if key.rpartition(":")[0] == topic)

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the streams worker exited ({self.process.returncode}):\n{tail(self.log)}")
        view = self.analytics()
        return view is not None and bool(view["assembly"]["partitions"])

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(30)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            stop_pid(self.process.pid, grace=30)


class TopicWatch:
    """Everything written to some topics since the beginning, read as it arrives."""

    def __init__(self, kafka: KafkaSettings, *bases: str):
        self.kafka = kafka
        self.topics = [kafka.topics.name(base) for base in bases]
        self.events: list[s.Event] = []
        self.undecodable: list[bytes] = []
        self.consumer = None

    async def __aenter__(self) -> TopicWatch:
        from agentstream.schemas.kafka import make_consumer, partitions_of

        self.consumer = make_consumer(self.kafka, group_id=None)
        await self.consumer.start()
        partitions = [tp for topic in self.topics for tp in await partitions_of(self.kafka, topic)]
        self.consumer.assign(partitions)
        await self.consumer.seek_to_beginning(*partitions)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.consumer.stop()

    async def until(self, condition, timeout: float = 60.0, what: str = "events") -> list[s.Event]:
        """Read until `condition(events)` holds; fail after `timeout` seconds."""
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition(self.events):
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; have "
                                     f"{[(e.type, e.rollout_id) for e in self.events][-20:]}")
            for records in (await self.consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    try:
                        self.events.append(s.decode(record.value))
                    except s.DecodeError:
                        self.undecodable.append(record.value)
        return self.events

    def of_type(self, type_: str) -> list[s.Event]:
        return [event for event in self.events if event.type == type_]

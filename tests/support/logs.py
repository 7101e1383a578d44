"""What the log tools' tests share: a known set of calls and trajectories (SQL, the archive), the CLI run
in-process on a test's topics, and a topic read back (replay, and the loops replay feeds)."""

from __future__ import annotations

import asyncio

from typer.testing import CliRunner

import agentstream.schemas as s
from agentstream.cli import app
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import scan


def call(rollout: str, upstream: str, latency: float, status: int = 200, completion: int = 2) -> s.CallEvent:
    return s.CallEvent(source="test", rollout_id=rollout, attempt_id="a", data=s.Call(
        api="chat.completions", model="tiny", upstream=upstream, weight_version=1, request={"messages": []},
        prompt_token_ids=[1, 2, 3], completion_token_ids=list(range(completion)), logprobs=[-0.1] * completion,
        usage=s.Usage(prompt_tokens=3, completion_tokens=completion, total_tokens=3 + completion),
        status=status, started_at=0, latency_ms=latency))


def trajectory(rollout: str, version: int, reward: float | None) -> s.TrajectoryEvent:
    return s.TrajectoryEvent(source="test", rollout_id=rollout, attempt_id="a", data=s.Trajectory(
        status="finished", reward=reward, reward_missing=reward is None, turns=[], sequences=[], merged=True,
        weight_version_launch=version, finished_at=0, lineage=[]))


KNOWN = [
    call("r1", "http://a", 10.0), call("r1", "http://a", 30.0, completion=5), call("r2", "http://b", 20.0),
    call("r2", "http://b", 40.0, status=502, completion=0), call("r3", "http://a", 20.0),
    trajectory("r1", 0, 0.0), trajectory("r2", 0, 1.0), trajectory("r3", 1, 1.0), trajectory("r4", 1, None),
]


async def cli(kafka: KafkaSettings, monkeypatch, *args: str):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka.bootstrap_servers)
    monkeypatch.setenv("COLUMNS", "200")
    prefix = [] if "--prefix" in args else ["--prefix", kafka.topic_prefix]
    return await asyncio.to_thread(CliRunner().invoke, app, [*args, *prefix])


async def read_topic(kafka: KafkaSettings, base: str) -> list[tuple[int, s.TrajectoryEvent]]:
    return [(record.partition, s.decode(record.value)) async for batch in scan(kafka, kafka.topics.name(base))
            for record in batch]


def without_rewards(trajectory: s.Trajectory, reward_ids: set[str]) -> dict:
    body = trajectory.model_dump()
    for name in ("reward", "reward_missing", "rewards"):
        body.pop(name)
    body["lineage"] = [i for i in body["lineage"] if i not in reward_ids]
    for turn in body["turns"]:
        turn.pop("reward")
    return body

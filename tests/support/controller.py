"""Shared by the controller's tests: task files, settings, and reading the rollouts topic back."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import agentstream.schemas as s
from agentstream.controller.settings import ControllerSettings
from agentstream.schemas.kafka import KafkaSettings, make_consumer, partitions_of

AGENTS = Path(__file__).parent / "controller_agents.py"
SECRET = "test-secret"
GATEWAY = "http://gateway.test:8000"


def write_tasks(path: Path, tasks: list[dict]) -> Path:
    path.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    return path


def agent_command(state: Path) -> str:
    return f"{sys.executable} {AGENTS} {state}"


def controller_settings(kafka: KafkaSettings, tasks: Path, state: Path, **overrides) -> ControllerSettings:
    options = dict(
        bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix, tasks=tasks,
        agent=agent_command(state), token_secret=SECRET, gateway_url=GATEWAY, logs_dir=state / "logs",
        progress=False, concurrency=4, heartbeat_s=5.0, kill_grace_s=1.0,
    )
    options.update(overrides)
    return ControllerSettings(**options)


async def read_rollouts(kafka: KafkaSettings) -> list[s.Event]:
    """Every event on the rollouts topic, per partition in log order."""
    topic = kafka.topics.rollouts
    partitions = await partitions_of(kafka, topic)
    consumer = make_consumer(kafka, group_id=None)
    await consumer.start()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        events = []
        while [tp for tp in partitions if await consumer.position(tp) < end[tp]]:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                events += [s.decode(r.value) for r in records]
        return events
    finally:
        await consumer.stop()


def by_attempt(events: list[s.Event]) -> dict[str, list[s.Event]]:
    """Events per attempt id, in log order (one rollout's events share a partition)."""
    out: dict[str, list[s.Event]] = defaultdict(list)
    for event in events:
        out[event.attempt_id].append(event)
    return out


def attempts_of(events: list[s.Event]) -> dict[str, list[list[s.Event]]]:
    """Per rollout id, its attempts (each a list of events) in attempt-number order."""
    attempts: dict[str, list[list[s.Event]]] = defaultdict(list)
    for attempt_events in by_attempt(events).values():
        attempts[attempt_events[0].rollout_id].append(attempt_events)
    for rollout in attempts.values():
        rollout.sort(key=lambda a: a[0].data.attempt_number)
    return attempts


def types(attempt: list[s.Event]) -> list[str]:
    return [event.type.removeprefix("rollout.") for event in attempt]


def runs_log(state: Path) -> list[list[str]]:
    path = state / "runs.log"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

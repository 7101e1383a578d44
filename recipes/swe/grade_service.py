"""`python -m agentstream.recipes.swe.grade_service --tasks FILE` (also `agentstream grade`): the grader as a service.

It reads `rollout.diff` events from the rollouts topic, grades each diff against its instance (from
the service's own task file, by instance_id: the agent never held the patches or the hidden tests)
in a pool of worker threads, each grading in a fresh sandbox, and publishes a `reward` event with the
details to the rewards topic. It is a process of its own, so a slow grading never holds up trajectory
assembly; inside it, gradings run side by side, so a slow one never holds up the others.

Offsets are committed, per partition, only below the oldest diff whose reward the broker has not yet
acknowledged: a crash grades the rest again, and a reward's id is derived from the diff event's id,
so the repeat is the same event and consumers drop it. A diff for an unknown instance, or a task whose
test patch does not apply, goes to the deadletter topic with the reason. Nothing a diff does stalls a
partition: the grader turns any failure of a grading into reward 0 with the reason, and should anything
still escape it, the diff is deadlettered with that reason and its offset done like any other. A commit the
group refuses (this member paused past its session and was dropped) is logged and the service goes on: it
rejoins, and the diffs since the last commit are graded again.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import CliApp, SettingsConfigDict

from agentstream.recipes.swe import repos, tasks
from agentstream.recipes.swe.grader import REWARD_FN, GradeError, Grader, penalties_from
from agentstream.recipes.swe.instance import Instance
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import Event, Reward, RewardEvent, RolloutDiffEvent
from agentstream.schemas.ids import derived_id
from agentstream.schemas.kafka import KafkaSettings, Publisher, ensure_topics, make_consumer, make_producer

log = logging.getLogger("recipes.swe.grade_service")
SOURCE = "grader"


class GradeSettings(KafkaSettings):
    """Grade coding agents' diffs from the rollouts topic; publish rewards."""

    model_config = SettingsConfigDict(cli_prog_name="python -m agentstream.recipes.swe.grade_service")

    tasks: Path = Field(description="the task file (SWE-bench JSONL) the diffs answer")
    repos_dir: Path = Field(default_factory=repos.default_repos_dir, description="where the task repositories are")
    envs_dir: Path = Field(default_factory=repos.default_envs_dir, description="where the test environments are")
    workers: int = Field(2, ge=1, description="gradings run at once (each in its own sandbox)")
    timeout_s: float = Field(120.0, gt=0, description="wall clock of one grading's test run")
    group_id: str = Field("agentstream-grader", description="consumer group (the topic prefix is put before it)")
    second_opinion: bool = Field(True, description="rerun a reward-1 diff's FAIL_TO_PASS tests, each alone in a "
                                                   "fresh sandbox; pay 1 only when both runs agree")
    reward_penalties: str = Field("default", description="flags that zero the training reward (the recorded grade "
                                                         "stays in details.graded_reward): 'default', 'none', or "
                                                         "a comma-separated list of flag names")

    @field_validator("reward_penalties")
    @classmethod
    def _known_flags(cls, value: str) -> str:
        penalties_from(value)
        return value


def reward_event(diff: RolloutDiffEvent, value: float, details: dict[str, Any]) -> RewardEvent:
    return RewardEvent(id=derived_id("reward", diff.id, REWARD_FN), source=SOURCE, rollout_id=diff.rollout_id,
                       attempt_id=diff.attempt_id, data=Reward(value=value, details=details, reward_fn=REWARD_FN))


class Offsets:
    """Per partition: the offsets in flight; what may be committed is below the oldest of them."""

    def __init__(self) -> None:
        self.pending: dict[TopicPartition, set[int]] = {}
        self.seen: dict[TopicPartition, int] = {}

    def start(self, tp: TopicPartition, offset: int) -> None:
        self.pending.setdefault(tp, set()).add(offset)
        self.seen[tp] = max(self.seen.get(tp, -1), offset)

    def skip(self, tp: TopicPartition, offset: int) -> None:
        self.seen[tp] = max(self.seen.get(tp, -1), offset)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self.pending[tp].discard(offset)

    def committable(self) -> dict[TopicPartition, int]:
        return {tp: min(self.pending.get(tp) or {last + 1}) for tp, last in self.seen.items()}


class GradeService:
    def __init__(self, settings: GradeSettings, instances: list[Instance], grader: Grader | None = None):
        self.settings = settings
        self.instances = tasks.by_id(instances)
        self.grader = grader or Grader(repos_dir=settings.repos_dir, envs_dir=settings.envs_dir,
                                       timeout_s=settings.timeout_s, second_opinion=settings.second_opinion,
                                       penalties=penalties_from(settings.reward_penalties))
        self.executor = ThreadPoolExecutor(settings.workers, thread_name_prefix="grade")
        self.slots = asyncio.Semaphore(settings.workers * 2)
        self.offsets = Offsets()
        self.graded = 0
        self._committed: dict[TopicPartition, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_topics(self.settings)
        topics = self.settings.topics
        consumer = make_consumer(self.settings, topics.rollouts, group_id=f"{self.settings.topic_prefix}{self.settings.group_id}")
        producer = make_producer(self.settings)
        await consumer.start()
        await producer.start()
        publisher = Publisher(producer, topics)
        try:
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=200, max_records=50)
                for tp, records in batches.items():
                    for record in records:
                        await self._take(tp, record, publisher)
                await self._commit(consumer)
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._commit(consumer)
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)
            await producer.stop()
            await consumer.stop()

    async def _take(self, tp: TopicPartition, record: ConsumerRecord, publisher: Publisher) -> None:
        try:
            event: Event = decode(record.value)
        except DecodeError:
            self.offsets.skip(tp, record.offset)  # the streams worker deadletters undecodable events
            return
        if not isinstance(event, RolloutDiffEvent):
            self.offsets.skip(tp, record.offset)
            return
        await self.slots.acquire()  # back-pressure: at most 2 × workers gradings queued or running
        self.offsets.start(tp, record.offset)
        task = asyncio.create_task(self._grade(tp, record, event, publisher))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _grade(self, tp: TopicPartition, record: ConsumerRecord, event: RolloutDiffEvent,
                     publisher: Publisher) -> None:
        try:
            reward, dead = await self._answer(event)
            if reward is not None:
                await publisher.publish(reward)
                self.graded += 1
            else:
                await publisher.deadletter(record, dead or "not graded", SOURCE)
            self.offsets.done(tp, record.offset)
        except Exception:  # only the broker refusing the answer gets here: graded again after a restart
            log.exception("publishing the answer to %s:%d@%d failed; it is graded again after a restart", tp.topic,
                          tp.partition, record.offset)
        finally:
            self.slots.release()

    async def _answer(self, event: RolloutDiffEvent) -> tuple[RewardEvent | None, str | None]:
        """The diff's reward event, or the reason it goes to the deadletter topic. Never raises."""
        instance = self.instances.get(event.data.instance_id)
        if instance is None:
            return None, f"unknown instance {event.data.instance_id!r}: not in {self.settings.tasks}"
        if instance.base_commit != event.data.base_commit:
            return None, f"the diff is against {event.data.base_commit}, the task's base commit is {instance.base_commit}"
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self.executor, self.grader.grade, instance, event.data.diff,
                                                event.data.truncated)
        except GradeError as exc:
            return None, f"the task cannot be graded: {exc}"
        except Exception as exc:
            log.exception("grading %s failed", event.id)
            return None, f"the grader failed on this diff ({type(exc).__name__}: {str(exc)[:400]}); not the task's fault"
        # how the attempt ended goes with its score: a 0 after a context overflow says so
        details = {**result.details, "outcome": event.data.outcome}
        return reward_event(event, result.reward, details), None

    async def _commit(self, consumer: AIOKafkaConsumer) -> None:
        assigned = consumer.assignment()
        offsets = {tp: offset for tp, offset in self.offsets.committable().items()
                   if tp in assigned and self._committed.get(tp) != offset}
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except CommitFailedError as exc:
            # The group went on without this member (a pause past its session timeout: a stalled machine, a
            # long GC): it rejoins at its next fetch, and whoever holds the partitions then reads from the last
            # commit and grades those diffs again; their rewards are the same events, which readers keep once.
            log.warning("offsets %s not committed (%s); the diffs after the last commit are graded again",
                        {f"{tp.topic}:{tp.partition}": o for tp, o in offsets.items()}, exc)
            self._committed.clear()
            return
        self._committed.update(offsets)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        settings = CliApp.run(GradeSettings, cli_args=args)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            where = ".".join(str(part) for part in error["loc"])
            print(f"error: {where + ': ' if where else ''}{error['msg']}", file=sys.stderr)
        return 2
    try:
        instances = tasks.load(settings.tasks, settings.repos_dir)
    except (OSError, tasks.InstanceFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(_serve(settings, instances))


async def _serve(settings: GradeSettings, instances: list[Instance]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("grading %d tasks from %s with %d workers", len(instances), settings.tasks, settings.workers)
    await GradeService(settings, instances).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())

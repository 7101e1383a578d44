"""Follow the log, tally each running canary's arms, and publish its numbers and its decision.

The service reads the `releases` topic from its beginning (which canaries run, `schemas.releases`),
then `calls`, `trajectories` and `rewards` from the start of the oldest running canary (after a restart
it counts everything again: the log is its state). A session belongs to the arm of the version that
served its calls (`Turn.weight_version`); its reward is the mean of its conversations' rewards (the
streams worker's reward policy; a later `reward` event of a conversation replaces its trajectory's).
Every `interval_s` it publishes a `measure` event per canary whose numbers changed, and once the rule
decides (`releases/rule.py`), a `promote` or `rollback` event with them: pool sync acts on it.

A tenant's canary (its release names the tenant: two adapters of the tenant on the same servers) is tallied from
that tenant's calls and sessions alone, those its two adapters (`<tenant>@<version>`) served; the base's from
the base model's. Each is decided apart: another tenant's rewards never move it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from statistics import fmean

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from agentstream.releases.rule import Arm, Verdict, decide
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import CallEvent, Event, Release, ReleaseEvent, RewardEvent, TrajectoryEvent
from agentstream.schemas.kafka import Publisher, make_consumer, make_producer, partitions_of
from agentstream.schemas.releases import ReleaseKey, ReleaseState, adapter_name, decision_id, fold, key_of
from agentstream.schemas.scan import resolve

log = logging.getLogger("releases")


@dataclass
class Tally:
    """One canary's arms, from the events since it started."""

    release: Release
    stable: Arm
    canary: Arm
    segments: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)
    """(rollout id, attempt id) of a conversation -> (session id, version)"""
    rewards: dict[tuple[str, int], dict[tuple[str, str], float]] = field(default_factory=dict)
    """(session id, version) -> each of its conversations' reward"""
    changed: bool = True

    @classmethod
    def of(cls, release: Release) -> Tally:
        return cls(release, Arm(release.stable_version), Arm(release.version))

    def arm(self, version: int | None) -> Arm | None:
        return self.canary if version == self.canary.version else self.stable if version == self.stable.version else None

    def served(self, model: str | None, tenant: str | None) -> bool:
        """Whether a call (or conversation) of `model` for `tenant` is this canary's to count: the base model's for
        the base's canary (a tenant served by the base included), the tenant's own two adapters' for a tenant's."""
        release = self.release
        if release.tenant is None:
            return model in (None, release.model)
        return tenant == release.tenant and model in (
            None, adapter_name(release.tenant, release.version), adapter_name(release.tenant, release.stable_version))

    def call(self, event: CallEvent) -> None:
        call = event.data
        arm = self.arm(call.weight_version)
        if arm is None or not self.served(call.model, call.tenant) or call.started_at < self.release.started_at:
            return
        arm.calls += 1
        if call.status >= 500:
            arm.errors += 1
        elif call.status < 400:
            arm.latencies_ms.append(call.latency_ms)
        self.changed = True

    def trajectory(self, event: TrajectoryEvent) -> None:
        trajectory = event.data
        if trajectory.revision_of is not None:
            return  # its reward is the `reward` event published with it (`reward`): read in one order, not two
        versions = {turn.weight_version for turn in trajectory.turns}
        if (trajectory.session_id is None or not self.served(trajectory.model, trajectory.tenant) or len(versions) != 1
                or (trajectory.started_at or trajectory.finished_at) < self.release.started_at):
            return  # not a session, another model, two versions in one conversation, or from before the canary
        version = versions.pop()
        if version is None or self.arm(version) is None or event.rollout_id is None or event.attempt_id is None:
            return
        self._segment((event.rollout_id, event.attempt_id), trajectory.session_id, version, trajectory.reward)

    def reward(self, event: RewardEvent) -> None:
        key = (event.rollout_id or "", event.attempt_id or "")
        if event.data.trajectory_id is not None and key in self.segments:
            session, version = self.segments[key]
            self._segment(key, session, version, event.data.value)

    def _segment(self, key: tuple[str, str], session: str, version: int, reward: float | None) -> None:
        self.segments[key] = (session, version)
        arm = self.arm(version)
        if reward is None or arm is None:
            return
        rewards = self.rewards.setdefault((session, version), {})
        rewards[key] = reward
        arm.rate(session, fmean(rewards.values()))
        self.changed = True


class Judge:
    def __init__(self, settings: ReleasesSettings):
        self.settings = settings
        self.states: dict[ReleaseKey, ReleaseState] = {}
        self.tallies: dict[tuple[ReleaseKey, int, int], Tally] = {}
        self.publisher: Publisher | None = None

    async def run(self) -> None:
        producer = make_producer(self.settings)
        await producer.start()
        self.publisher = Publisher(producer, self.settings.topics)
        consumer = make_consumer(self.settings, group_id=None)
        await consumer.start()
        try:
            await self._follow(consumer)
        finally:
            await consumer.stop()
            await producer.stop()

    async def _follow(self, consumer: AIOKafkaConsumer) -> None:
        topics = self.settings.topics
        releases = await partitions_of(self.settings, topics.releases)
        consumer.assign(releases)
        await consumer.seek_to_beginning(*releases)
        ends = {TopicPartition(topics.releases, number): end
                for number, (_, end) in (await resolve(self.settings, topics.releases)).items()}
        while [partition for partition, end in ends.items() if await consumer.position(partition) < end]:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    self.observe(record)
        others = [partition for topic in (topics.calls, topics.trajectories, topics.rewards)
                  for partition in await partitions_of(self.settings, topic)]
        consumer.assign([*releases, *others])
        for partition in releases:
            consumer.seek(partition, ends.get(partition, 0))
        running = [tally.release.started_at for tally in self.tallies.values()]
        if running:  # everything since the oldest running canary began
            found = await consumer.offsets_for_times({partition: min(running) for partition in others})
            for partition in others:
                if found.get(partition) is not None:
                    consumer.seek(partition, found[partition].offset)
                else:
                    await consumer.seek_to_end(partition)
        else:
            await consumer.seek_to_end(*others)
        log.info("following the log (%d canaries running)", len(running))
        last = 0.0
        while True:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    self.observe(record)
            if time.monotonic() - last >= self.settings.interval_s:
                last = time.monotonic()
                await self.evaluate()

    def observe(self, record: ConsumerRecord) -> None:
        try:
            event: Event = decode(record.value)
        except DecodeError as exc:
            log.warning("skipping an undecodable record: %s", exc)
            return
        if isinstance(event, ReleaseEvent):
            state = fold(self.states, event)
            if state is not None:
                release = state.current
                key = (key_of(release), release.version, release.started_at)
                if state.active:
                    self.tallies.setdefault(key, Tally.of(release))
                else:
                    self.tallies.pop(key, None)
                    # a replaced canary is not decided any more (another model's or tenant's is not touched)
                for other in [k for k in self.tallies if k[0] == key_of(release) and k != key]:
                    del self.tallies[other]
            return
        for tally in self.tallies.values():
            if isinstance(event, CallEvent):
                tally.call(event)
            elif isinstance(event, TrajectoryEvent):
                tally.trajectory(event)
            elif isinstance(event, RewardEvent):
                tally.reward(event)

    async def evaluate(self) -> None:
        for key, tally in list(self.tallies.items()):
            if not tally.changed:
                continue
            tally.changed = False
            verdict = decide(tally.stable, tally.canary, self.settings)
            await self.publish(tally, verdict)
            if verdict.action is not None:
                (model, tenant), version, _ = key
                log.info("canary of %s%s version %d: %s (%s)", model, f" (tenant {tenant})" if tenant else "", version,
                         verdict.action, verdict.reason)

    async def publish(self, tally: Tally, verdict: Verdict) -> None:
        release = tally.release
        action = verdict.action or "measure"
        data = release.model_copy(update=dict(
            action=action, decided_by="rule", reason=verdict.reason, p_value=verdict.p_value, numbers=verdict.numbers,
            arms=[tally.stable.numbers(), tally.canary.numbers()]))
        event = ReleaseEvent(source=self.settings.source, data=data, **({"id": decision_id(data)} if verdict.action else {}))
        assert self.publisher is not None
        await self.publisher.publish(event)


def run(settings: ReleasesSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(Judge(settings).run())

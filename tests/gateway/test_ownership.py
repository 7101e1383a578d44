"""The writer's lease on a real broker: a replica that loses partitions to a new member of the group is fenced
(its claims taken before are refused, those on the partitions it kept are taken again), and a replica the
group dropped while it still thinks it owns a partition is refused by the broker."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

from agentstream.gateway.ownership import Fenced, Ownership
from agentstream.schemas.kafka import KafkaSettings, make_consumer
from tests.support.wait import wait_for_async


class Arrivals(ConsumerRebalanceListener):
    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        pass


async def member(kafka: KafkaSettings, listener: ConsumerRebalanceListener, **options) -> AIOKafkaConsumer:
    # as pool sync's: the group waits for a member's step in flight (there: the longest reload) to end
    options = {"rebalance_timeout_ms": 60_000, **options}
    consumer = make_consumer(kafka, group_id=f"{kafka.topic_prefix}writers",
                             partition_assignment_strategy=(RangePartitionAssignor,), **options)
    consumer.subscribe([kafka.topics.calls], listener=listener)  # 4 partitions: range gives each member 2
    if isinstance(listener, Ownership):
        listener.consumer = consumer
    await consumer.start()
    return consumer


async def test_a_writer_that_loses_partitions_is_fenced(kafka):
    ownership = Ownership()
    first = await member(kafka, ownership)
    second = None
    try:
        await wait_for_async(lambda: len(first.assignment()) == 4, timeout=60, what="the first member's partitions")
        claims = [ownership.claim(partition, 0) for partition in first.assignment()]
        for claim in claims:
            await claim.check("a step")

        revoked = ownership.revocations
        second = await member(kafka, Arrivals())
        await wait_for_async(lambda: ownership.revocations > revoked, timeout=60, what="the revocation")

        for claim in claims:  # taken before the revocation: void, even for the partitions the writer kept
            with pytest.raises(Fenced):
                await claim.check("the next step")
        await wait_for_async(lambda: len(first.assignment()) == len(second.assignment()) == 2, timeout=60,
                             what="the members' shares")
        for partition in first.assignment():
            await ownership.claim(partition, 0).check("a step of the next event")
        for partition in second.assignment():
            with pytest.raises(Fenced):
                await ownership.claim(partition, 0).check("a step on a partition it lost")
    finally:
        for consumer in (first, second):
            if consumer is not None:
                await consumer.stop()


@pytest.mark.slow  # the broker's session timeout (6 s, its least) before it drops the member
async def test_the_broker_refuses_a_writer_the_group_dropped(kafka):
    ownership = Ownership()
    # a member whose heartbeats stop (a frozen process, a cut from Kafka) while it believes it owns partitions
    first = await member(kafka, ownership, session_timeout_ms=6000, heartbeat_interval_ms=1000)
    second = None
    try:
        await wait_for_async(lambda: len(first.assignment()) == 4, timeout=60, what="the first member's partitions")
        partition = min(first.assignment())
        claim = ownership.claim(partition, 0)
        await claim.check("a step")
        revoked = ownership.revocations
        first._coordinator._heartbeat_task.cancel()  # frozen: it sends nothing more, it learns nothing more
        second = await member(kafka, Arrivals())
        await wait_for_async(lambda: len(second.assignment()) == 4, timeout=60,
                             what="the group to drop the silent member")
        assert partition in first.assignment() and ownership.revocations == revoked, "it should not know it was dropped"
        with pytest.raises(Fenced, match="could not prove"):
            await claim.check("resuming")
    finally:
        for consumer in (first, second):
            if consumer is not None:
                await consumer.stop()

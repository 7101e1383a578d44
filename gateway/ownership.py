"""Which replica writes to the servers: the consumer-group member that owns the partition, fenced by the broker.

Every replica joins one consumer group over the `weights` and `releases` topics; the range assignor gives
partition N of both to the same member, so one replica applies every event of the models keyed to it, in
order. Assignment is a lease, and a lease can be lost mid-update (a rebalance, a replica cut off from
Kafka): so before each step that changes a server, the writer proves it still owns the partition by
committing the offset of the event it applies, which the broker accepts only from the member of the
group's current generation. A writer that fails the check stops where it is (no resume, no relabel); the
new owner reads the same event again and finishes it (`pool_sync` makes each step safe to repeat).

The broker does not wait for a step already in flight (a reload) before the next owner starts (measured:
tests/gateway/test_ownership.py), so the steps are safe to repeat for the same event: both writers load
the same weights and set the same label, and the old one stops at its next check, before its resume.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from agentstream.schemas.errors import ServiceError

CHECK_TIMEOUT_S = 10.0
"""longest a check waits for the broker; past it the writer cannot prove it owns the partition, so it stops"""


class Fenced(ServiceError):
    """This replica no longer owns the partition: the new owner applies the event."""


class Ownership(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka has no type hints
    """The partitions this replica writes for, and the one update it is applying."""

    def __init__(self) -> None:
        self.consumer: AIOKafkaConsumer | None = None
        self.revocations = 0
        """a claim taken before a revocation is void, even if the same partitions come back"""

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        if revoked:  # the first join revokes nothing
            self.revocations += 1

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        pass

    def claim(self, partition: TopicPartition, offset: int) -> Claim:
        """The right to apply the event at `offset` while this replica keeps `partition`."""
        return Claim(self, partition, offset, self.revocations)


@dataclass
class Claim:
    ownership: Ownership
    partition: TopicPartition
    offset: int
    revocations: int

    async def check(self, step: str) -> None:
        """Return if this replica still owns the partition (the broker took a commit from it); else Fenced."""
        consumer = self.ownership.consumer
        if (consumer is None or self.revocations != self.ownership.revocations
                or self.partition not in consumer.assignment()):
            raise Fenced(f"lost {self.partition.topic}[{self.partition.partition}] before {step}")
        try:  # commits the event's own offset: it stays to be read again by whoever owns the partition next
            await asyncio.wait_for(consumer.commit({self.partition: self.offset}), CHECK_TIMEOUT_S)
        except (KafkaError, TimeoutError) as exc:
            raise Fenced(f"could not prove {self.partition.topic}[{self.partition.partition}] is still owned "
                         f"before {step}: {type(exc).__name__}: {exc}") from exc

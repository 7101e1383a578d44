"""The controller's weights follower: a tenant's rollouts are paced by that tenant's adapter versions only."""

from __future__ import annotations

from agentstream.controller.log import TopicReader
from agentstream.controller.pacing import WeightsFollower
from agentstream.schemas.events import Weights, WeightsEvent


def weights(version: int, tenant: str | None, model: str = "tiny") -> WeightsEvent:
    return WeightsEvent(source="trainer", data=Weights(model=model, version=version, uri=f"/ckpt/{tenant}/v{version}",
                                                       step=version, tenant=tenant))


def follow(follower: WeightsFollower, *events: WeightsEvent) -> int | None:
    for event in events:
        follower._apply(event)
    return follower.version


def test_a_tenants_follower_sees_its_own_adapters_versions_only():
    reader: TopicReader = None  # type: ignore[assignment]  # (_apply reads no topic)
    events = [weights(1, "agent-a"), weights(1, "agent-b"), weights(2, "agent-b"), weights(3, "agent-b"),
              weights(7, None), weights(9, "agent-a", model="other")]
    assert follow(WeightsFollower(reader, "tiny", "agent-a"), *events) == 1
    assert follow(WeightsFollower(reader, "tiny", "agent-b"), *events) == 3
    # the shared policy's controller: no tenant's adapter moves its version
    assert follow(WeightsFollower(reader, "tiny"), *events) == 7
    assert follow(WeightsFollower(reader, "tiny", "agent-c"), *events) is None

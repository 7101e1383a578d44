"""A trajectory's tenant is its calls' (#48): a rollout's, a session's, one an operator joined, one of no tenant
(None); a late feedback's revision keeps it."""

from __future__ import annotations

import agentstream.schemas as s
from agentstream.schemas.codec import encode
from agentstream.streams.assembly import Timing
from samples.assembly import assemble
from tests.support.streams import Rollout, Session

TIMING = Timing(settle_ms=100, reward_grace_ms=5_000, session_idle_ms=10_000, feedback_window_ms=5_000)


def of(call: s.CallEvent, tenant: str | None) -> s.CallEvent:
    return call.model_copy(update={"data": call.data.model_copy(update={"tenant": tenant})})


def test_a_rollouts_trajectory_is_its_calls_tenant_and_one_of_no_tenant_is_unchanged():
    rollout, plain = Rollout("r-tenant"), Rollout("r-plain")
    events = [rollout.queued(), of(rollout.call([1, 2], [3]), "agent-a"),
              of(rollout.call([1, 2, 3, 4], [5]), None),  # an operator's call in agent-a's rollout joins it
              rollout.reward(1.0), rollout.finished()]
    (tenanted,) = assemble(events, TIMING)
    (untenanted,) = assemble(plain.two_turns(), TIMING)
    assert tenanted.data.tenant == "agent-a" and len(tenanted.data.turns) == 2
    assert untenanted.data.tenant is None
    validated = s.TrajectoryEvent.model_validate(tenanted.model_dump(), strict=True)
    assert encode(validated) == encode(tenanted)  # (what a rebuild would make, byte for byte)


def test_each_sessions_trajectories_are_its_keys_tenant_and_a_revision_keeps_it():
    a, b = Session("key:aaaaaaaaaaaaaaaa:chat"), Session("key:bbbbbbbbbbbbbbbb:chat")
    events = [of(a.call(1_000, [1, 2], [3]), "agent-a"), of(b.call(1_100, [1, 2], [4]), "agent-b"),
              a.end(2_000), b.end(2_100)]
    first = assemble(events, TIMING, now_ms=a.start + 60_000)
    assert {t.data.session_id: t.data.tenant for t in first} == {a.session_id: "agent-a", b.session_id: "agent-b"}
    revised = assemble([*events, a.feedback(20_000, score=0.5)], TIMING, now_ms=a.start + 60_000)
    assert {t.data.tenant for t in revised if t.data.session_id == a.session_id} == {"agent-a"}

"""Canaries per tenant (#48 item 4), decided by the decision service (`python -m agentstream.releases`) on a real
broker: each tenant's canary is two of its adapters, and the same always-valid rule decides it on that tenant's
own sessions alone. The sessions are written as the streams worker writes them (trajectories of a session, each
conversation on one version); the gateway's side (the canary's release event, the adapters' swap) is
tests/gateway/test_lora.py's on a real vLLM server.

The versions collide on purpose: every tenant's canary is version 2 against 1, and so is the base model's
traffic, so a tally that looked at version numbers alone would mix them."""

from __future__ import annotations

import pytest

from agentstream.releases.rule import Arm, decide
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.events import Release, ReleaseEvent, Trajectory, TrajectoryEvent, Turn
from agentstream.schemas.ids import now_ms
from agentstream.schemas.releases import adapter_name, decision_id
from agentstream.schemas.sessions import session_rollout_id
from tests.support.releases import JUDGE_ARGS, Judge
from tests.support.streams import TopicWatch, publish

pytestmark = pytest.mark.slow

STABLE, CANARY = 1, 2


def canary_of(tenant: str | None, started_at: int) -> ReleaseEvent:
    """The `canary` event the gateway's applier writes once a server loaded the tenant's new adapter."""
    return ReleaseEvent(source="test-gateway", data=Release(
        model="tiny", tenant=tenant, action="canary", version=CANARY, uri=f"/adapters/{tenant}-2",
        stable_version=STABLE, stable_uri=f"/adapters/{tenant}-1", share_bp=5000, servers=["http://server"],
        started_at=started_at, reason="a new adapter version"))


def session(tenant: str | None, name: str, version: int, reward: float) -> TrajectoryEvent:
    """One rated conversation of a session, served by `version` (the tenant's adapter of it, or the base's)."""
    at = now_ms()
    turn = Turn(call_id=f"call-{name}", sequence=0, prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1],
                weight_version=version)
    model = adapter_name(tenant, version) if tenant else "tiny"
    return TrajectoryEvent(source="streams", rollout_id=session_rollout_id(name), attempt_id="segment-0",
                           data=Trajectory(model=model, tenant=tenant, status="finished", turns=[turn], sequences=[],
                                           merged=True, started_at=at, finished_at=at, lineage=[], reward=reward,
                                           session_id=name))


def sessions(tenant: str | None, rewards: dict[int, list[float]], tag: str = "") -> list[TrajectoryEvent]:
    return [session(tenant, f"{tenant or 'base'}{tag}-v{version}-{n}", version, reward)
            for version, values in rewards.items() for n, reward in enumerate(values)]


def spread(mean: float, count: int) -> list[float]:
    return [mean + 0.1 * (n % 3) for n in range(count)]


def decisions(watch: TopicWatch, tenant: str | None) -> list[Release]:
    return [event.data for event in watch.of_type("release")
            if event.data.tenant == tenant and event.data.action in ("promote", "rollback")]


def measured(watch: TopicWatch, tenant: str | None) -> list[Release]:
    return [event.data for event in watch.of_type("release")
            if event.data.tenant == tenant and event.data.action == "measure"]


@pytest.fixture
def judge(kafka, tmp_path):
    started: list[Judge] = []

    def start() -> Judge:
        started.append(Judge(kafka, tmp_path / f"releases-{len(started)}.log").start())
        return started[-1]

    yield start
    for process in started:
        process.stop()


async def test_each_tenants_canary_is_decided_on_its_own_sessions_only(kafka, judge):
    started_at = now_ms() - 1000
    async with TopicWatch(kafka, "releases") as watch:
        await publish(kafka, [canary_of("agent-a", started_at), canary_of("agent-b", started_at),
                              canary_of("agent-c", started_at), canary_of(None, started_at)])
        await publish(kafka, [
            # agent-a's users rate its canary far higher
            *sessions("agent-a", {STABLE: spread(0.2, 6), CANARY: spread(0.8, 6)}),
            # agent-b's rate both its adapters alike: nothing is known yet
            *sessions("agent-b", {STABLE: spread(0.5, 6), CANARY: spread(0.5, 6)}),
            # agent-c's rate its canary far lower
            *sessions("agent-c", {STABLE: spread(0.8, 6), CANARY: spread(0.2, 6)}),
            # the base model's sessions (no tenant; its own canary of version 2) and a fourth tenant's without a
            # canary, on versions 1 and 2 too: if they counted for agent-b, its canary would be promoted
            *sessions(None, {STABLE: spread(0.0, 12), CANARY: spread(0.9, 12)}),
            *sessions("agent-d", {STABLE: spread(0.0, 12), CANARY: spread(0.9, 12)}),
        ])
        judge()
        await watch.until(lambda _: decisions(watch, "agent-a") and decisions(watch, "agent-c") and decisions(watch, None)
                          and [m for m in measured(watch, "agent-b") if m.arms[1].sessions == 6],
                          timeout=120, what="agent-a's and agent-c's decisions, agent-b's measure of every session")

    [promoted] = decisions(watch, "agent-a")
    assert (promoted.action, promoted.decided_by, promoted.version, promoted.stable_version) == (
        "promote", "rule", CANARY, STABLE)
    assert [(arm.sessions, round(arm.mean_reward, 6)) for arm in promoted.arms] == [(6, 0.3), (6, 0.9)]
    assert promoted.p_value is not None and promoted.p_value < 0.01
    [rolled_back] = decisions(watch, "agent-c")
    assert rolled_back.action == "rollback" and "lower" in rolled_back.reason
    assert [arm.sessions for arm in rolled_back.arms] == [6, 6]
    # agent-b: its own 6 sessions an arm, none of the others', and no decision
    assert not decisions(watch, "agent-b")
    assert [(arm.sessions, round(arm.mean_reward, 6)) for arm in measured(watch, "agent-b")[-1].arms] == [
        (6, 0.6), (6, 0.6)]
    # the base's canary: its own sessions alone (the tenants' adapters at versions 1 and 2 are not the base's)
    [base] = decisions(watch, None)
    assert base.action == "promote" and [arm.sessions for arm in base.arms] == [12, 12]
    # no release of agent-d was made up from its traffic
    assert {event.data.tenant for event in watch.of_type("release")} == {None, "agent-a", "agent-b", "agent-c"}
    # a decision's id is the one any publisher of it derives (the event names the tenant)
    ids = {event.id for event in watch.of_type("release") if event.data.action == "promote"}
    assert ids == {decision_id(promoted), decision_id(base)} and len(ids) == 2


async def test_a_restart_of_the_decision_service_mid_way_decides_the_same(kafka, judge):
    """SIGKILLed after it measured half the sessions (too few for the rule), started again after the rest came:
    it counts the first half again from the log and decides on all of them, as one run over all would."""
    started_at = now_ms() - 1000
    first = {STABLE: spread(0.2, 3), CANARY: spread(0.8, 3)}
    second = {STABLE: spread(0.2, 3), CANARY: spread(0.8, 3)}
    async with TopicWatch(kafka, "releases") as watch:
        await publish(kafka, [canary_of("agent-a", started_at), *sessions("agent-a", first, "-early")])
        process = judge()
        await watch.until(lambda _: [m for m in measured(watch, "agent-a") if m.arms[1].sessions == 3], timeout=120,
                          what="the measure of the first sessions")
        assert not decisions(watch, "agent-a")  # 3 sessions an arm: below the rule's 5
        process.kill()
        await publish(kafka, sessions("agent-a", second, "-late"))
        judge()
        await watch.until(lambda _: decisions(watch, "agent-a"), timeout=120, what="the decision after the restart")

    [decision] = decisions(watch, "agent-a")
    # the decision over every session, as the rule makes it from them in one piece
    rules = ReleasesSettings(min_sessions=5, alpha=0.01, min_calls=1000)  # JUDGE_ARGS
    assert JUDGE_ARGS[:6] == ("--min-sessions", "5", "--alpha", "0.01", "--min-calls", "1000")
    arms = [Arm(version, {f"{tag}-{n}": reward for tag, half in (("early", first), ("late", second))
                          for n, reward in enumerate(half[version])}) for version in (STABLE, CANARY)]
    expected = decide(*arms, rules)
    assert decision.action == expected.action == "promote"
    assert decision.p_value == pytest.approx(expected.p_value) and decision.numbers == pytest.approx(expected.numbers)
    assert [arm.sessions for arm in decision.arms] == [6, 6]

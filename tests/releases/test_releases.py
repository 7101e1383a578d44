"""The canary's pure parts: sticky buckets, the release fold every reader shares, routing by arm, and the rule."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from agentstream.gateway.releases import arm_first
from agentstream.releases.rule import Arm, decide
from agentstream.releases.sequential import Bounds, Lift, Moments, log_evidence, p_value, threshold
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.codec import decode, encode
from agentstream.schemas.events import ArmNumbers, ReleaseEvent
from agentstream.schemas.releases import BUCKETS, bucket, canary_servers, fold, in_canary, stable_of, successor
from agentstream.schemas.sessions import session_rollout_id
from tests.support.releases import release


def test_buckets_are_stable_and_split_sessions_by_the_share():
    keys = [session_rollout_id(f"chat-{n}") for n in range(4000)]
    assert [bucket(key) for key in keys] == [bucket(key) for key in keys]
    assert all(0 <= bucket(key) < BUCKETS for key in keys)
    on = sum(in_canary(key, 2500) for key in keys)
    assert 900 < on < 1100  # a quarter, give or take
    assert not any(in_canary(key, 0) for key in keys) and all(in_canary(key, BUCKETS) for key in keys)
    assert not in_canary(None, BUCKETS)  # a call without a sticky key stays stable
    # a larger share keeps every session that was on the canary there
    assert all(in_canary(key, 5000) for key in keys if in_canary(key, 2500))


def test_canary_servers_leave_one_stable():
    assert canary_servers(["http://b", "http://a", "http://c"], 1) == ["http://c"]
    assert canary_servers(["http://b", "http://a"], 5) == ["http://b"]
    assert canary_servers(["http://a"], 1) == []


def test_the_fold_takes_the_first_decision_and_ignores_stale_and_repeated_events():
    states: dict = {}
    started = release("canary")
    assert fold(states, started).active
    assert fold(states, release("measure", p_value=0.5)).measured.p_value == 0.5
    assert fold(states, release("promote", version=3)) is None  # another canary's decision
    assert fold(states, release("rollback", started_at=999)) is None  # an earlier canary of the same version
    assert fold(states, release("promote")).phase == "promoted"
    assert fold(states, release("rollback")) is None  # decided already: the first decision stands
    assert fold(states, started) is None  # the canary's event read again changes nothing
    assert stable_of(states[("tiny", None)]) == (2, "/ckpt/2")
    fold(states, release("canary", version=3, started_at=2000))
    assert states[("tiny", None)].active and fold(states, release("rollback", version=3, started_at=2000)).phase == "rolled back"
    assert stable_of(states[("tiny", None)]) == (1, "/ckpt/1")


def test_a_replaced_canary_that_led_becomes_the_stable_version():
    def measured(stable: float | None, canary: float | None, sessions: int = 30) -> dict:
        states: dict = {}
        fold(states, release("canary"))
        arms = [ArmNumbers(version=1, sessions=sessions, mean_reward=stable),
                ArmNumbers(version=2, sessions=sessions, mean_reward=canary)]
        fold(states, release("measure", arms=arms, numbers={"min_sessions": 30}))
        return states

    promotion = successor(measured(0.5, 0.6)[("tiny", None)])
    assert promotion is not None and (promotion.action, promotion.decided_by) == ("promote", "replaced")
    assert promotion.version == 2 and "leading" in promotion.reason
    states = measured(0.5, 0.6)
    fold(states, ReleaseEvent(source="gateway", data=promotion))
    assert stable_of(states[("tiny", None)]) == (2, "/ckpt/2")  # the next canary starts from it
    assert successor(measured(0.6, 0.5)[("tiny", None)]) is None  # behind: the stable version stays
    assert successor(measured(0.5, 0.5)[("tiny", None)]) is None  # level: no reason to move
    assert successor(measured(0.5, 0.9, sessions=29)[("tiny", None)]) is None  # an arm short of the rule's minimum
    assert successor(measured(None, 0.9)[("tiny", None)]) is None
    states = {}
    fold(states, release("canary"))
    assert successor(states[("tiny", None)]) is None  # never measured
    fold(states, release("rollback"))
    assert successor(states[("tiny", None)]) is None  # decided already


def test_release_events_round_trip():
    event = release("promote", p_value=0.001, numbers={"z": 3.2}, decided_by="cli:ops")
    assert decode(encode(event)) == event


@dataclass(eq=False)
class Server:
    url: str
    weight_version: int | None


def test_sessions_go_to_their_arm_first_and_fail_over_to_the_other():
    a, b, c = Server("http://a", 1), Server("http://b", 2), Server("http://c", 1)
    states: dict = {}
    fold(states, release("canary"))
    state = states[("tiny", None)]
    keys = [session_rollout_id(f"chat-{n}") for n in range(200)]
    for key in keys:
        order = arm_first(state, key, [a, b, c])
        assert sorted(order, key=lambda server: server.url) == [a, b, c]
        assert (order[0] is b) == in_canary(key, 2500)
        if not in_canary(key, 2500):
            assert order[:2] == [a, c]  # the stable arm keeps the rendezvous order
    assert arm_first(state, None, [a, b, c])[-1] is b
    fold(states, release("rollback"))
    assert arm_first(states[("tiny", None)], keys[0], [b, a, c]) == [a, c, b]  # b still serves the canary's version
    b.weight_version = 1
    assert arm_first(states[("tiny", None)], keys[0], [b, a, c]) == [b, a, c]


SETTINGS = ReleasesSettings(min_sessions=5, alpha=0.05, min_calls=10, max_error_rate_increase=0.05,
                            max_latency_ratio=1.5, max_sessions=40)


def arm(version: int, rewards: list[float], calls: int = 20, errors: int = 0, latency: float = 100.0) -> Arm:
    return Arm(version, {f"s{version}-{n}": value for n, value in enumerate(rewards)}, calls, errors,
               [latency] * (calls - errors))


@pytest.mark.parametrize("stable, canary, action, reason", [
    (arm(1, [0.2, 0.3, 0.4] * 2), arm(2, [0.8, 0.9, 1.0] * 2), "promote", "higher"),
    (arm(1, [0.8, 0.9, 1.0] * 2), arm(2, [0.2, 0.3, 0.4] * 2), "rollback", "lower"),
    (arm(1, [0.5, 0.6] * 3), arm(2, [0.5, 0.6] * 3), None, "no decision yet"),
    (arm(1, [0.5, 0.6] * 20), arm(2, [0.5, 0.6] * 20), "rollback", "not better after 40"),
    (arm(1, [0.2] * 4), arm(2, [0.9] * 10), None, "waiting for 5 sessions"),
    (arm(1, [0.2] * 6), arm(2, [0.9] * 6, errors=3), "rollback", "error rate"),
    (arm(1, [0.2] * 6), arm(2, [0.9] * 6, latency=200.0), "rollback", "p95 latency"),
    (arm(1, [0.2] * 6, calls=5), arm(2, [0.9] * 6, calls=5, latency=900.0), "promote", "higher"),  # guards wait
    (arm(1, [0.5] * 6), arm(2, [0.5] * 6), None, "no decision yet: lift +0.000"),
    (arm(1, [0.9] * 6), arm(2, [0.2] * 6), "rollback", "lower"),  # no spread: the means decide
    (arm(1, [0.2] * 6), arm(2, [0.9] * 6), "promote", "higher"),
])
def test_the_rule(stable, canary, action, reason):
    verdict = decide(stable, canary, SETTINGS)
    assert verdict.action == action and reason in verdict.reason, verdict
    assert decide(stable, canary, SETTINGS) == verdict  # deterministic


def test_the_rule_says_what_it_measured():
    verdict = decide(arm(1, [0.2, 0.3, 0.4] * 2), arm(2, [0.8, 0.9, 1.0] * 2), SETTINGS)
    numbers = verdict.numbers
    assert numbers["lift_lower"] > 0 and math.isclose(numbers["lift"], 0.6)
    assert numbers["lift_lower"] < numbers["lift"] < numbers["lift_upper"] and 0 < numbers["power"] <= 1
    assert verdict.p_value is not None and verdict.p_value < SETTINGS.alpha
    settings = SETTINGS.model_copy(update={"min_lift": 0.7})  # better, but known to be less than 0.7 better?
    lower = decide(arm(1, [0.0, 0.1] * 30), arm(2, [0.1, 0.2] * 30), settings)
    assert lower.action == "promote"  # the lower bound clears 0 first
    wide = decide(arm(1, [0.0, 1.0] * 30), arm(2, [0.0, 1.0] * 30), settings)
    assert wide.action == "rollback" and "not 0.7 higher" in wide.reason


def test_the_confidence_sequence():
    # the bound is where the evidence reaches 1/alpha, and it widens with a smaller alpha
    for information in (1.0, 100.0, 1e4, 1e8):
        c = threshold(information, 0.1, 0.05)
        assert math.isclose(log_evidence(c, information, 0.1), math.log(20), rel_tol=1e-8)
        assert threshold(information, 0.1, 0.01) > c
    # the lower bound moves towards the lift as sessions come, and the power with them
    narrow, wide = (Bounds.of(Lift.of(Moments(n, 0.5, 0.25 * (n - 1)), Moments(n, 0.6, 0.25 * (n - 1))), 0.1, 0.05)
                    for n in (5000, 50))
    assert wide.lower < narrow.lower < 0.1 < narrow.upper < wide.upper and narrow.power > wide.power
    # far in the tail the p-value is small, not 0 (decision events print it); a lead below 0 is no evidence
    assert 0 < p_value(1e3, 1e3, 0.1) < 1e-20 and p_value(-50.0, 1e3, 0.1) == 1.0


def test_one_arm_without_spread_does_not_make_the_lift_certain():
    """All 30 canary sessions thumbs up (a 4 % chance at a 0.9 rate) against a stable arm at 0.9: the fixed-horizon
    test took the standard error from the stable arm alone and promoted (z 5); the pooled variance does not."""
    stable = arm(2, [1.0] * 243 + [0.0] * 27)
    verdict = decide(stable, arm(3, [1.0] * 30), SETTINGS.model_copy(update={"max_sessions": 0}))
    assert verdict.action is None and verdict.numbers["lift_lower"] < 0, verdict


def test_the_arms_sums_follow_replaced_rewards():
    rng = random.Random(0)
    growing = Arm(1)
    for n in range(200):
        growing.rate(f"s{n % 50}", 1e6 + rng.random())  # later ratings replace earlier ones; large and alike
    whole = Arm(1, dict(growing.rewards))
    got, want = growing.moments(), whole.moments()
    assert got.n == want.n == 50
    assert got.mean == pytest.approx(want.mean, rel=1e-12) and got.squares == pytest.approx(want.squares, rel=1e-6)
    assert growing.numbers().reward_std == pytest.approx(whole.numbers().reward_std, rel=1e-6)
    assert 0.2 < growing.numbers().reward_std < 0.4  # the spread of uniform draws, not lost to 1e6


def test_the_tally_puts_sessions_on_the_version_that_served_them():
    from agentstream.releases.judge import Tally
    from agentstream.schemas.events import Call, CallEvent, Reward, RewardEvent, Trajectory, TrajectoryEvent, Turn

    tally = Tally.of(release("canary", started_at=1000).data)

    def conversation(session: str, attempt: str, versions: list[int], reward: float | None, at: int = 2000):
        turns = [Turn(call_id=f"c{n}", sequence=0, prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1],
                      weight_version=version) for n, version in enumerate(versions)]
        tally.trajectory(TrajectoryEvent(source="streams", rollout_id=session_rollout_id(session), attempt_id=attempt,
                                         data=Trajectory(status="finished", turns=turns, sequences=[], merged=True,
                                                         started_at=at, finished_at=at, lineage=[], reward=reward,
                                                         session_id=session, reward_missing=reward is None)))

    def call(version: int, status: int = 200, latency: float = 50.0, at: int = 2000):
        tally.call(CallEvent(source="gateway", data=Call(api="chat.completions", model="tiny", weight_version=version,
                                                         request={}, status=status, started_at=at, latency_ms=latency)))

    conversation("a", "segment-0", [2, 2], 1.0)
    conversation("a", "segment-1", [2], 0.0)  # the session's reward: the mean of its conversations'
    conversation("b", "segment-0", [1], None)  # no feedback yet ...
    tally.reward(RewardEvent(source="streams", rollout_id=session_rollout_id("b"), attempt_id="segment-0",
                             data=Reward(value=0.25, trajectory_id="t")))  # ... then it came
    conversation("c", "segment-0", [1, 2], 1.0)  # two versions in one conversation: neither arm's
    conversation("d", "segment-0", [1], 1.0, at=999)  # from before the canary
    conversation("e", "segment-0", [7], 1.0)  # a version of neither arm
    for version, status, latency in ((1, 200, 40.0), (2, 200, 60.0), (2, 503, 5.0), (2, 400, 1.0)):
        call(version, status, latency)
    call(2, at=999)

    assert tally.canary.rewards == {"a": 0.5} and tally.stable.rewards == {"b": 0.25}
    assert (tally.canary.calls, tally.canary.errors, tally.canary.latencies_ms) == (3, 1, [60.0])
    assert (tally.stable.calls, tally.stable.errors) == (1, 0)
    numbers = tally.canary.numbers()
    assert (numbers.version, numbers.sessions, numbers.mean_reward, numbers.p95_latency_ms) == (2, 1, 0.5, 60.0)

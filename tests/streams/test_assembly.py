"""Trajectory assembly as a pure fold: merging, endings, rewards, duplicates and late events."""

from __future__ import annotations

import pytest

import agentstream.schemas as s
from agentstream.schemas.codec import encode
from agentstream.streams.assembly import Assembly, Timing, finalize_at
from samples.assembly import assemble
from tests.support.streams import Rollout

TIMING = Timing(settle_ms=100, reward_grace_ms=5_000, idle_timeout_ms=60_000, retention_ms=600_000)


def feed(assembly: Assembly, events: list[s.Event]) -> list[str | None]:
    return [assembly.add(event, encode(event), 0) for event in events]


def settle_all(assembly: Assembly, now_ms: int):
    return assembly.settle_due(now_ms)


def test_turns_that_extend_each_other_merge_into_one_masked_sequence():
    rollout = Rollout("r-merge")
    events = rollout.two_turns(merged=True, reward=0.5)
    (trajectory,) = assemble(events, TIMING)
    data = trajectory.data
    assert trajectory.id == s.derived_id("trajectory", "r-merge", "a1") and trajectory.attempt_id == "a1"
    assert data.merged and data.merge_mismatches == 0 and len(data.sequences) == 1
    (sequence,) = data.sequences
    assert sequence.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sequence.mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert sequence.logprobs == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5, -0.5]
    assert sequence.weight_versions == [None, None, None, 0, 0, None, None, 0, 0]
    assert sequence.prompt_length == 3 and sequence.turns == [0, 1]
    assert [turn.call_id for turn in data.turns] == [events[1].id, events[2].id]
    assert data.status == "finished" and data.reward == 0.5 and not data.reward_missing
    assert (data.task_id, data.group_id, data.model, data.weight_version_launch) == ("t1", "g", "tiny", 0)
    assert data.lineage == [event.id for event in events]
    assert data.finished_at == events[-1].time and data.started_at == events[0].time


def test_a_completion_that_went_on_across_a_weight_update_records_each_tokens_version():
    """Partial rollouts: the second turn's first token was sampled by version 0, the second by version 1."""
    rollout = Rollout("r-partial")
    events = rollout.two_turns(merged=True, reward=0.5)
    events[2].data.weight_segments = [s.WeightSegment(version=0, start=0), s.WeightSegment(version=1, start=1)]
    (trajectory,) = assemble(events, TIMING)
    (sequence,) = trajectory.data.sequences
    assert sequence.weight_versions == [None, None, None, 0, 0, None, None, 0, 1]
    assert trajectory.data.turns[1].weight_segments == events[2].data.weight_segments
    assert trajectory.data.turns[0].weight_segments == []


def test_token_versions_spread_segments_over_the_completion():
    segments = [s.WeightSegment(version=2, start=0), s.WeightSegment(version=3, start=2),
                s.WeightSegment(version=5, start=4)]
    assert s.token_versions(2, segments, 6) == [2, 2, 3, 3, 5, 5]
    assert s.token_versions(2, segments, 3) == [2, 2, 3]
    assert s.token_versions(7, [], 3) == [7, 7, 7]


def test_a_turn_that_rewrites_history_starts_a_new_sequence_and_counts_as_a_mismatch():
    (trajectory,) = assemble(Rollout("r-split").two_turns(merged=False), TIMING)
    data = trajectory.data
    assert not data.merged and data.merge_mismatches == 1
    assert [seq.token_ids for seq in data.sequences] == [[1, 2, 3, 4, 5], [1, 9, 3, 6, 7, 8, 9]]
    assert [seq.mask for seq in data.sequences] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
    assert [turn.sequence for turn in data.turns] == [0, 1]


def test_failed_calls_are_lineage_not_turns_and_per_turn_rewards_land_on_their_turns():
    rollout = Rollout("r-turns")
    first, failed, second = rollout.call([1], [2], "a"), rollout.call([1], [], status=500), rollout.call([1, 2, 3], [4])
    reward = rollout.reward(1.0, [s.TurnReward(call_id=second.id, value=0.9), s.TurnReward(turn=0, value=0.1)])
    (trajectory,) = assemble([rollout.queued(), first, failed, second, reward, rollout.finished()], TIMING)
    assert [turn.call_id for turn in trajectory.data.turns] == [first.id, second.id]
    assert [turn.reward for turn in trajectory.data.turns] == [0.1, 0.9]
    assert failed.id in trajectory.data.lineage


def test_duplicates_are_dropped_and_events_for_a_settled_attempt_are_late():
    rollout = Rollout("r-dup")
    events = rollout.two_turns()
    assembly = Assembly({}, {}, TIMING)
    assert feed(assembly, events + events[1:3]) == [None] * 7
    (trajectory,) = settle_all(assembly, events[-1].time + TIMING.settle_ms).trajectories
    assert len(trajectory.data.turns) == 2 and assembly.counts["duplicates"] == 2
    assert feed(assembly, [events[1]]) == [None]  # a duplicate after settling is still just a duplicate
    late_call = rollout.call([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11])
    (reason,) = feed(assembly, [late_call])
    assert reason.startswith("late: attempt a1 of rollout r-dup was settled") and trajectory.id in reason


def test_an_event_timed_after_the_settle_time_is_late_even_when_it_arrives_first():
    rollout = Rollout("r-straggler")
    events = rollout.two_turns()
    straggler = rollout.call([9], [9])
    straggler.time = events[-1].time + TIMING.settle_ms + 1
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, events + [straggler])
    settled = settle_all(assembly, straggler.time + TIMING.settle_ms)
    assert straggler.id not in settled.trajectories[0].data.lineage
    ((raw, reason),) = settled.late
    assert s.decode(raw).id == straggler.id and reason.startswith("late: its time is after")


def test_a_finished_attempt_waits_for_its_reward_up_to_the_grace_period():
    rollout = Rollout("r-grace")
    events = rollout.two_turns(reward=None)
    end = events[-1].time
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, events)
    assert assembly.due(end + TIMING.settle_ms) == []  # still waiting for the reward
    reward = rollout.reward(0.7)
    feed(assembly, [reward])
    assert assembly.due(reward.time + TIMING.settle_ms) == ["r-grace"]
    (trajectory,) = settle_all(assembly, reward.time + TIMING.settle_ms).trajectories
    assert trajectory.data.reward == 0.7

    silent = Rollout("r-silent")
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, silent.two_turns(reward=None))
    attempt = assembly.rollouts["r-silent"]["attempts"]["a1"]
    assert finalize_at(attempt, TIMING) == attempt["end"]["time"] + TIMING.reward_grace_ms
    (trajectory,) = settle_all(assembly, attempt["end"]["time"] + TIMING.reward_grace_ms).trajectories
    assert trajectory.data.reward is None and trajectory.data.reward_missing


def test_a_reward_grace_shorter_than_the_settle_time_does_not_settle_before_it():
    rollout = Rollout("r-short-grace")
    *_, finished = rollout.two_turns(reward=None)
    attempt = {"end": {"time": finished.time, "type": "rollout.finished"}, "awaits_reward": True, "last": 0}
    assert finalize_at(attempt, Timing(settle_ms=5_000, reward_grace_ms=2_000)) == finished.time + 5_000


def test_a_managed_attempt_ends_with_the_controller_an_unmanaged_one_with_the_agent():
    managed = Rollout("r-managed")
    events = [managed.queued(), managed.call([1], [2]), managed.reward(1.0), managed.finished(by="agent")]
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, events)
    assert assembly.due(events[-1].time + TIMING.reward_grace_ms) == []
    controller_end = managed.finished(by="controller")
    feed(assembly, [controller_end])
    (trajectory,) = settle_all(assembly, controller_end.time + TIMING.settle_ms).trajectories
    assert trajectory.data.finished_at == controller_end.time and events[-1].id in trajectory.data.lineage

    unmanaged = Rollout("r-unmanaged", managed=False)
    events = [unmanaged.queued(), unmanaged.call([1], [2]), unmanaged.reward(1.0), unmanaged.finished(by="agent")]
    (trajectory,) = assemble(events, TIMING)
    assert trajectory.data.finished_at == events[-1].time


def test_a_rollout_with_no_queued_event_and_no_attempt_ids_still_assembles():
    """Traffic of a harness that names only its rollout (a header), then posts a reward and a finish."""
    from agentstream.streams.assembly import NO_ATTEMPT

    rollout = Rollout("r-bare", managed=False)
    events = [rollout.call([1, 2], [3]), rollout.reward(1.0), rollout.finished(by="agent")]
    for event in events:
        event.attempt_id = None
    (trajectory,) = assemble(events, TIMING)
    assert trajectory.attempt_id == NO_ATTEMPT and trajectory.data.turns[0].call_id == events[0].id
    assert trajectory.data.task_id is None and trajectory.data.reward == 1.0


def test_silent_attempts_are_abandoned_after_the_idle_timeout():
    rollout = Rollout("r-idle")
    events = [rollout.queued(), rollout.call([1], [2])]
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, events)
    assert assembly.due(events[-1].time + TIMING.idle_timeout_ms - 1) == []
    (trajectory,) = settle_all(assembly, events[-1].time + TIMING.idle_timeout_ms).trajectories
    assert trajectory.data.status == "abandoned" and not trajectory.data.reward_missing
    assert trajectory.data.finished_at == events[-1].time + TIMING.idle_timeout_ms


def test_failed_attempts_settle_at_once_without_a_computed_reward():
    rollout = Rollout("r-failed", reward_fn="streams.rewards:exact_match", metadata={"answer": "4"})
    events = [rollout.queued(), rollout.call([1], [2], "4"), rollout.failed()]
    (trajectory,) = assemble(events, TIMING, now_ms=events[-1].time + TIMING.settle_ms)
    assert trajectory.data.status == "failed" and trajectory.data.reward is None


def test_a_reward_function_scores_the_answer_as_a_reward_event_in_the_trajectory():
    rollout = Rollout("r-fn", reward_fn="streams.rewards:exact_match", metadata={"answer": "89"})
    events = rollout.two_turns(reward=None)
    assembly = Assembly({}, {}, TIMING, source="streams-test")
    feed(assembly, events)
    settled = settle_all(assembly, events[-1].time + TIMING.settle_ms)  # no grace: the function gives the reward
    (reward,), (trajectory,) = settled.rewards, settled.trajectories
    assert reward.data.value == 1.0 and reward.data.reward_fn == "streams.rewards:exact_match"
    assert reward.id == s.derived_id("reward", trajectory.id, "streams.rewards:exact_match")
    assert reward.source == "streams-test" and reward.rollout_id == "r-fn"
    assert trajectory.data.reward == 1.0 and trajectory.data.rewards[-1].event_id == reward.id
    assert trajectory.data.lineage[-1] == reward.id
    assert feed(assembly, [reward]) == [None] and assembly.counts["duplicates"] == 1  # it comes back: dropped


def test_a_failing_reward_function_leaves_the_reward_missing_and_says_why():
    rollout = Rollout("r-fn-bad", reward_fn="streams.rewards:exact_match")  # no metadata["answer"]
    events = rollout.two_turns(reward=None)
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, events)
    settled = settle_all(assembly, events[-1].time + TIMING.settle_ms)
    assert settled.rewards == [] and settled.trajectories[0].data.reward_missing
    ((raw, reason),) = settled.unscored
    assert s.decode(raw).type == "trajectory" and "has no metadata['answer']" in reason


def test_settled_attempts_are_forgotten_after_the_retention():
    rollout = Rollout("r-forget")
    events = rollout.two_turns()
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, events)
    settle_all(assembly, events[-1].time + TIMING.settle_ms)
    assert assembly.events == {} and "r-forget" in assembly.rollouts
    settle_all(assembly, events[-1].time + TIMING.settle_ms + TIMING.retention_ms)
    assert assembly.rollouts == {}


def test_settling_twice_from_the_same_log_gives_the_same_events():
    """What a worker that died before committing does: the same trajectory and reward, same ids."""
    rollout = Rollout("r-twice", reward_fn="streams.rewards:numeric_answer", metadata={"answer": 89})
    events = rollout.two_turns(reward=None)
    first, second = (assemble(events, TIMING) for _ in range(2))
    assert [encode(t) for t in first] == [encode(t) for t in second]


def test_an_attempt_settled_again_after_a_crash_is_built_from_what_it_was_decided_on():
    """The worker's kill -9 case: a trajectory published without a reward still on its way (past the
    grace), the worker killed before the settled marker was written. The state restored holds what
    the trajectory was decided on; the reward read again after the restart is late, and the repeat
    is the same bytes (not a second trajectory with the reward in it)."""
    import copy

    rollout = Rollout("r-decided")
    *early, reward, finished = rollout.two_turns(reward=1.0)
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, early + [finished])
    now = finished.time + TIMING.reward_grace_ms
    first = assembly.settle("r-decided", now)
    assembly.decide(first)
    restored = Assembly(copy.deepcopy(assembly.rollouts), dict(assembly.events), TIMING)  # killed here

    assert feed(restored, [reward, finished]) == [None, None]  # read again: the reward, and a duplicate
    again = restored.settle("r-decided", now + 1_000)
    assert [encode(t) for t in again.trajectories] == [encode(t) for t in first.trajectories]
    assert first.trajectories[0].data.reward_missing
    assert [raw for raw, _ in again.late] == [encode(reward)]

    undecided = Assembly(copy.deepcopy(assembly.rollouts), dict(assembly.events), TIMING)
    undecided.rollouts["r-decided"]["attempts"]["a1"].pop("decided")  # as the worker did before it decided first
    feed(undecided, [reward])
    assert undecided.settle("r-decided", now + 1_000).trajectories[0].data.reward == 1.0  # the different repeat


def test_an_attempt_decided_before_a_crash_waits_for_its_events_to_be_read_again():
    rollout = Rollout("r-waits")
    events = rollout.two_turns(reward=1.0)
    assembly = Assembly({}, {}, TIMING)
    feed(assembly, events)
    now = events[-1].time + TIMING.settle_ms
    first = assembly.settle("r-waits", now)
    assembly.decide(first)
    events_written = {k: v for k, v in assembly.events.items() if k != events[2].id}  # killed before this one
    restored = Assembly(dict(assembly.rollouts), events_written, TIMING)
    assert restored.settle("r-waits", now).trajectories == []  # not without the call it was decided on
    feed(restored, [events[2]])
    assert [encode(t) for t in restored.settle("r-waits", now).trajectories] == [encode(t) for t in first.trajectories]


@pytest.mark.parametrize("answer,function,metadata,expected", [
    ("  Paris ", "exact_match", {"answer": "paris"}, 1.0),
    ("Lyon", "exact_match", {"answer": "paris"}, 0.0),
    ("so it is 1,234.5", "numeric_answer", {"answer": "1234.5"}, 1.0),
    ("3 then 4", "numeric_answer", {"answer": 3}, 0.0),
    ("no number", "numeric_answer", {"answer": 3}, 0.0),
    ("The answer: B.", "regex_match", {"pattern": r"answer: [AB]\b"}, 1.0),
    ("12ab", "character_share", {"characters": "0123456789"}, 0.5),
    ("", "character_share", {"characters": "0123456789"}, 0.0),
])
def test_the_shipped_reward_functions(answer, function, metadata, expected):
    from agentstream.streams import rewards

    rollout = Rollout("r", metadata=metadata)
    call = rollout.call([1], [2], answer)
    sample = rewards.Sample(rollout.queued().data.task, s.Trajectory(status="finished", turns=[], sequences=[],
                                                                     merged=True, finished_at=0, lineage=[]),
                            [call.data])
    assert rewards.score(f"streams.rewards:{function}", sample).value == pytest.approx(expected)


@pytest.mark.parametrize("name,message", [
    ("exact_match", "write it as module:function"),
    ("no_such_module:f", "cannot import 'no_such_module'"),
    ("streams.rewards:nope", "has no function 'nope'"),
])
def test_bad_reward_function_names_say_what_is_wrong(name, message):
    from agentstream.streams import rewards

    with pytest.raises(rewards.RewardError, match=message):
        rewards.load(name)


def test_an_sdk_retry_of_a_lost_answer_is_one_turn_and_counts_as_superseded():
    rollout = Rollout("r-retry")
    lost = rollout.call([1, 2, 3], [4, 5], "45")  # recorded, but the agent never got it
    again = rollout.call([1, 2, 3], [6, 7], "67", retry_count=1)  # its SDK's retry, headers say so
    events = [rollout.queued(), lost, again, rollout.call([1, 2, 3, 6, 7, 8], [9], "9"), rollout.finished()]
    (trajectory,) = assemble(events, TIMING)
    data = trajectory.data
    assert [turn.call_id for turn in data.turns] == [again.id, events[3].id]
    assert data.merged and data.merge_mismatches == 0 and data.superseded == 1
    assert data.sequences[0].token_ids == [1, 2, 3, 6, 7, 8, 9] and lost.id in data.lineage


def test_a_repeat_without_retry_headers_is_superseded_when_the_agent_went_on_with_the_later_answer():
    rollout = Rollout("r-repeat")
    events = [rollout.queued(), rollout.call([1, 2, 3], [4, 5]), rollout.call([1, 2, 3], [6, 7]),
              rollout.call([1, 2, 3, 6, 7, 8], [9]), rollout.finished()]
    data = assemble(events, TIMING)[0].data
    assert [turn.call_id for turn in data.turns] == [events[2].id, events[3].id]
    assert data.merged and data.superseded == 1


def test_sampling_the_same_prompt_twice_and_using_both_answers_keeps_both_turns():
    rollout = Rollout("r-twice")
    first, second = rollout.call([1, 2, 3], [4, 5]), rollout.call([1, 2, 3], [6, 7])
    # the next prompt holds both answers; the one after goes on from the second alone
    both = rollout.call([1, 2, 3, 4, 5, 6, 7, 8], [9])
    branch = rollout.call([1, 2, 3, 6, 7, 8], [10])
    data = assemble([rollout.queued(), first, second, both, branch, rollout.finished()], TIMING)[0].data
    assert [turn.call_id for turn in data.turns] == [first.id, second.id, both.id, branch.id]
    assert data.superseded == 0


def test_a_repeat_with_no_evidence_either_way_keeps_both_turns():
    rollout = Rollout("r-no-evidence")
    first, second = rollout.call([1, 2, 3], [4, 5]), rollout.call([1, 2, 3], [6, 7], retry_count=0)
    data = assemble([rollout.queued(), first, second, rollout.finished()], TIMING)[0].data
    assert [turn.call_id for turn in data.turns] == [first.id, second.id]
    assert data.superseded == 0 and data.merge_mismatches == 1


def test_a_built_trajectory_is_what_validating_it_gives_byte_for_byte():
    """`build` constructs the trajectory from validated parts without validating again: it must be
    exactly the model validation would make (types, defaults), or a rebuild's bytes would drift."""
    rollout = Rollout("r-valid", reward_fn="streams.rewards:numeric_answer", metadata={"answer": 89})
    first, failed, again = rollout.call([1], [2], "a"), rollout.call([1], [], status=500), rollout.call([1], [5], "b",
                                                                                                       retry_count=1)
    reward = rollout.reward(1.0, [s.TurnReward(call_id=again.id, value=0.9), s.TurnReward(turn=0, value=1)])
    histories = [Rollout("r-merged").two_turns(merged=True), Rollout("r-split").two_turns(merged=False),
                 [rollout.queued(), first, failed, again, rollout.call([1, 9], [3], "89"), reward, rollout.finished()],
                 [Rollout("r-failed").queued(), Rollout("r-failed").failed()]]
    trajectories = [trajectory for events in histories for trajectory in assemble(events, TIMING)]
    assert len(trajectories) == 4
    for trajectory in trajectories:
        validated = s.TrajectoryEvent.model_validate(trajectory.model_dump(), strict=True)
        assert validated == trajectory and encode(validated) == encode(trajectory)


def test_the_next_due_time_is_the_next_attempts_not_one_already_settled():
    """The worker's timer sleeps until `next_due`: a head of the index left from an attempt settled
    since must not read as "due now" (the timer then waited a whole tick, not until the next)."""
    assembly = Assembly({}, {}, TIMING)
    first, second = Rollout("r-first"), Rollout("r-second")
    feed(assembly, [first.queued(), first.reward(1.0), first.finished()])
    later = [second.queued(), second.reward(1.0), second.finished(after_ms=5_000)]
    feed(assembly, later)
    now = finalize_at(assembly.rollouts["r-first"]["attempts"]["a1"], TIMING)
    settled = settle_all(assembly, now)
    assert [t.rollout_id for t in settled.trajectories] == ["r-first"]
    assert assembly.next_due([0]) == finalize_at(assembly.rollouts["r-second"]["attempts"]["a1"], TIMING) > now


def test_a_computed_reward_added_to_a_built_trajectory_is_what_building_with_it_makes():
    """`with_reward` (a scored attempt's trajectory, its turns not made again) must be `build` with the reward
    event, byte for byte: per-turn rewards overridden in time order, the lineage, the start."""
    from agentstream.streams.trajectory import Ending, build, with_reward

    rollout = Rollout("r-with-reward", reward_fn="streams.rewards:exact_match", metadata={"answer": "b"})
    first, second = rollout.call([1], [2], "a"), rollout.call([1, 2, 7], [5], "b")
    posted = rollout.reward(0.5, [s.TurnReward(call_id=first.id, value=0.1), s.TurnReward(turn=1, value=0.2)])
    finished = rollout.finished()
    events = [rollout.queued(), second, first, posted, finished]
    ending = Ending("finished", finished.time, reward_expected=True)
    for at, turns in [(finished.time, [s.TurnReward(turn=0, value=0.9)]),  # after the posted reward: it wins
                      (posted.time - 1, [s.TurnReward(call_id=second.id, value=0.7)]),  # before it: overridden
                      (0, [])]:  # before every event: the trajectory starts with it
        computed = s.RewardEvent(id=s.derived_id("reward", str(at)), time=at, source="t", rollout_id=rollout.rollout_id,
                                 attempt_id="a1", data=s.Reward(value=1.0, turns=turns, reward_fn="f"))
        expected = build(rollout.rollout_id, "a1", [*events, computed], ending, "streams")
        made = with_reward(build(rollout.rollout_id, "a1", events, ending, "streams"), events, computed, ending)
        assert encode(made) == encode(expected) and made == expected
        assert made.model_fields_set == expected.model_fields_set
        assert made.data.model_fields_set == expected.data.model_fields_set
    assert [turn.reward for turn in expected.data.turns] == [0.1, 0.2]  # (the last case: the posted reward's)

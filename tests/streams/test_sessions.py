"""Sessions in the fold: conversations split by ends and idleness, feedback turned into rewards by the
policy (at settling, and later), per-call feedback on its turn, the same decisions in any read order."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import pytest

import agentstream.schemas as s
from agentstream.schemas.codec import decode, encode
from agentstream.streams.assembly import Assembly, Settled, Timing
from agentstream.streams.trajectory import revision_id
from tests.support.streams import Session

TIMING = Timing(settle_ms=100, session_idle_ms=10_000, feedback_window_ms=5_000, session_retention_ms=100_000)


def fold(events: Seq[s.Event], now: int, policy: str = "streams.policies:latest",
         assembly: Assembly | None = None, offsets: dict[str, int] | None = None) -> tuple[Assembly, Settled]:
    """Add the events in this order, settling whatever is due before each one's time (as a watermark would);
    with `offsets`, each event's offset in its topic (as the worker gives them)."""
    assembly = assembly or Assembly({}, {}, TIMING, policy=policy)
    out = Settled("all")
    for event in [*events, None]:
        at = now if event is None else event.time - 1
        out.extend(assembly.settle_due(at))
        if event is not None:
            assert assembly.add(event, encode(event), 0, (offsets or {}).get(event.id)) is None
    return assembly, out


def conversation(session: Session) -> tuple[list[s.Event], dict[str, s.CallEvent]]:
    """Two conversations: two merged turns ended by the client, with feedback about the second turn and about
    the whole; then, after a call in flight at the end, one more turn that ends by idleness without feedback."""
    first = session.call(1_000, [1, 2], [3])
    second = session.call(2_000, [1, 2, 3, 4], [5, 6])
    in_flight = session.call(3_550, [1, 2, 3, 4, 5, 6, 7], [8])
    later = session.call(3_700, [9], [10, 11])
    events = [first, second, session.feedback(3_000, second, thumbs="down"),
              session.feedback(3_200, thumbs="up", user="u-1"), session.end(3_500), in_flight, later]
    return events, {"first": first, "second": second, "in_flight": in_flight, "later": later}


def test_a_session_splits_into_conversations_and_feedback_lands_on_its_turn():
    session = Session("chat-1")
    events, calls = conversation(session)
    assembly, out = fold(events, session.start + 60_000)
    ended, idle = out.trajectories
    assert (ended.rollout_id, ended.attempt_id, idle.attempt_id) == (session.rollout_id, "segment-0", "segment-1")
    assert ended.id == s.derived_id("trajectory", session.rollout_id, "segment-0")
    assert ended.data.session_id == idle.data.session_id == "chat-1"
    # the call in flight at the end (within --settle-s) joins the ended conversation; the one after opens the next
    assert [turn.call_id for turn in ended.data.turns] == [calls["first"].id, calls["second"].id, calls["in_flight"].id]
    assert [turn.call_id for turn in idle.data.turns] == [calls["later"].id]
    assert ended.data.merged and ended.data.sequences[0].token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    # per-turn: the thumbs down on the second call is that turn's reward; the thumbs up on the whole its outcome
    assert [turn.reward for turn in ended.data.turns] == [None, 0.0, None]
    assert ended.data.reward == 1.0 and not ended.data.reward_missing
    (record,) = ended.data.rewards
    assert record.reward_fn == "streams.policies:latest"
    assert [turn.completion_start for turn in ended.data.turns] == [2, 4, 7]  # each turn's span in its sequence
    assert ended.data.end_reason == "ended by the client" and idle.data.end_reason == "no call for 10 s"
    assert ended.data.finished_at == session.start + 3_500
    # nobody rated the second conversation within the window: emitted without a reward, counted, not guessed
    assert idle.data.reward is None and idle.data.reward_missing
    assert assembly.counts["sessions"] == 2 and assembly.counts["sessions_without_feedback"] == 1
    assert [reward.attempt_id for reward in out.rewards] == ["segment-0"]


def test_the_same_trajectories_and_rewards_whatever_order_the_topics_are_read_in():
    """A worker reads calls, rollouts and rewards side by side: only each topic's own order is fixed. An end read
    after calls that came later than it moves them to the next conversation."""
    session = Session("chat-order")
    events, _ = conversation(session)
    late_feedback = session.feedback(40_000, score=0.25)
    events.append(late_feedback)
    expected = None
    rng = random.Random(7)
    for _ in range(30):
        by_topic = {topic: [e for e in events if e.topic == topic] for topic in ("calls", "rollouts", "rewards")}
        order: list[s.Event] = []
        while any(by_topic.values()):
            topic = rng.choice([t for t, queue in by_topic.items() if queue])
            order.append(by_topic[topic].pop(0))
        assembly = Assembly({}, {}, TIMING)
        out = Settled("all")
        for event in order:  # no settling until everything is read: a worker catching up
            assert assembly.add(event, encode(event), 0) is None
        for now in (session.start + 30_000, session.start + 60_000):
            out.extend(assembly.settle_due(now))
        got = ([encode(t) for t in out.trajectories], [encode(r) for r in out.rewards])
        expected = expected or got
        assert got == expected, [e.type for e in order]
    assert len(expected[0]) == 3  # two conversations, and the first one's revision with its late feedback


def read_side_by_side(events: Seq[s.Event], now: int, rng: random.Random, horizon_ms: int | None = None) -> Settled:
    """As a worker catching up reads them: each topic in its own order, the topics in a random interleaving, and
    whatever is due by the watermark (the time read up to on every topic not read to its end) settled between."""
    by_topic = {topic: [e for e in events if e.topic == topic] for topic in ("calls", "rollouts", "rewards")}
    read_up_to = dict.fromkeys(by_topic, 0)
    assembly, out = Assembly({}, {}, TIMING, horizon_ms=horizon_ms), Settled("all")
    while any(by_topic.values()):
        topic = rng.choice([t for t, queue in by_topic.items() if queue])
        event = by_topic[topic].pop(0)
        assert assembly.add(event, encode(event), 0) is None
        read_up_to[topic] = event.time
        out.extend(assembly.settle_due(min([now, *(read_up_to[t] for t, queue in by_topic.items() if queue)])))
    out.extend(assembly.settle_due(now))
    return out


def test_the_outcome_is_the_event_times_not_the_order_the_topics_were_read_in():
    """Three conversations: the second's end and feedback are on topics a catching-up worker may read before the
    second's calls (the rollouts topic fetched ahead after a restart); its feedback within the window belongs in
    its trajectory, the later feedback in a revision. Read side by side, settling by the watermark between reads,
    every order makes what a rebuild merging the topics by time makes."""
    session = Session("chat-event-time")
    first = [session.call(1_000, [1], [2]), session.call(2_000, [1, 2, 3], [4]), session.end(3_000),
             session.feedback(3_500, thumbs="up")]
    second_calls = [session.call(20_000, [9], [10]), session.call(21_000, [9, 10, 11], [12])]
    second = [*second_calls, session.end(22_000), session.feedback(22_500, second_calls[1], thumbs="down"),
              session.feedback(22_550, score=0.25), session.feedback(40_000, score=0.75)]
    third = [session.call(50_000, [20], [21])]
    events = [*first, *second, *third]
    now = session.start + 120_000
    _, by_time = fold(sorted(events, key=lambda e: (e.time, e.id)), now)
    ended, ended_too, revision, idle = sorted(by_time.trajectories, key=lambda t: t.time)
    assert [t.data.end_reason for t in (ended, ended_too, idle)] == [
        "ended by the client", "ended by the client", "no call for 10 s"]
    assert [turn.call_id for turn in ended_too.data.turns] == [call.id for call in second_calls]
    assert ended_too.data.reward == 0.25 and [turn.reward for turn in ended_too.data.turns] == [None, 0.0]
    assert revision.data.revision_of == ended_too.id and revision.data.reward == 0.75
    expected = sorted(encode(t) for t in by_time.trajectories)
    rng = random.Random(46)
    for n in range(40):  # (half of them with a due index of 5 s ahead: the rest found by passes over the state)
        got = read_side_by_side(events, now, rng, horizon_ms=5_000 if n % 2 else None)
        assert sorted(encode(t) for t in got.trajectories) == expected
        assert got.late == []


def test_feedback_after_the_window_becomes_a_reward_event_naming_the_trajectory():
    session = Session("chat-late")
    call = session.call(1_000, [1], [2])
    kept = Timing(**{**TIMING.__dict__, "session_retention_ms": 7 * 24 * 3_600_000})
    assembly, out = fold([call, session.end(2_000)], session.start + 20_000, assembly=Assembly({}, {}, kept))
    (trajectory,) = out.trajectories
    assert trajectory.data.reward_missing and assembly.counts["sessions_without_feedback"] == 1
    # days later: a thumbs up on the call, then a score for the whole (the latest of each counts)
    day = 24 * 3_600_000
    thumbs, score = session.feedback(day, call, thumbs="up"), session.feedback(day + 1_000, score=0.5)
    _, later = fold([thumbs, score], session.start + day + 10_000, assembly=assembly)
    assert later.late == []
    first, second = later.rewards
    assert first.data.trajectory_id == second.data.trajectory_id == trajectory.id
    # each reward comes with a revision of the trajectory: the same turns and sequences, that reward, a new id
    # derived from the trajectory and the reward, so a repeat after a crash is the same event
    revisions = later.trajectories
    assert [r.id for r in revisions] == [revision_id(trajectory.id, first.id), revision_id(trajectory.id, second.id)]
    for revision, reward in zip(revisions, (first, second)):
        assert revision.data.revision_of == trajectory.id and revision.time == reward.time
        assert (revision.rollout_id, revision.attempt_id) == (trajectory.rollout_id, trajectory.attempt_id)
        assert revision.data.sequences == trajectory.data.sequences
        assert [t.call_id for t in revision.data.turns] == [t.call_id for t in trajectory.data.turns]
        assert revision.data.reward == reward.data.value and not revision.data.reward_missing
        assert revision.data.rewards[-1].event_id == reward.id and revision.data.session_id == "chat-late"
    assert [t.reward for t in revisions[1].data.turns] == [1.0]  # the thumbs up on the call, on its turn
    assert assembly.counts["revisions"] == 2 and assembly.counts["sessions"] == 1
    assert (first.rollout_id, first.attempt_id) == (trajectory.rollout_id, trajectory.attempt_id)
    assert (first.data.value, [t.value for t in first.data.turns]) == (1.0, [1.0])  # only the call's: its mean
    assert (second.data.value, [t.call_id for t in second.data.turns]) == (0.5, [call.id])
    assert first.id != second.id and first.time == session.start + day
    # repeated (a retried post with the same id, a worker reading again): nothing more
    _, again = fold([score], session.start + day + 20_000, assembly=assembly)
    assert again.rewards == [] and assembly.counts["duplicates"] == 1
    # the reward events read back from the log are the policy's output, not new input
    _, read_back = fold(later.rewards, session.start + day + 30_000, assembly=assembly)
    assert read_back.rewards == [] and read_back.trajectories == []
    assert assembly.counts["late_feedback_rewards"] == 2
    # what the revisions are built from is held until the conversation is forgotten, then let go
    assert call.id in assembly.events
    # forgotten after --session-retention-s: feedback then rewards nothing, and says so
    week = 8 * day
    _, forgotten = fold([session.feedback(week, score=1.0)], session.start + week + 60_000, assembly=assembly)
    assert forgotten.rewards == [] and "no calls of session chat-late are known" in forgotten.late[0][1]
    assert call.id not in assembly.events


def test_another_policy_gives_the_same_sequences_with_new_rewards():
    session = Session("chat-policy")
    events, _ = conversation(session)
    events[3] = session.feedback(3_200, thumbs="down")  # the whole first conversation: disliked
    _, latest = fold(events, session.start + 60_000)
    _, signed = fold(events, session.start + 60_000, policy="streams.policies:signed_thumbs")
    for a, b in zip(latest.trajectories, signed.trajectories, strict=True):
        assert a.id == b.id and a.data.sequences == b.data.sequences and a.data.turns[0] == b.data.turns[0]
    assert latest.trajectories[0].data.reward == 0.0 and signed.trajectories[0].data.reward == -1.0
    assert [t.reward for t in signed.trajectories[0].data.turns] == [None, -1.0, None]
    assert signed.trajectories[0].data.rewards[0].reward_fn == "streams.policies:signed_thumbs"


def test_feedback_for_an_unknown_session_is_set_aside_with_why():
    session = Session("never-seen")
    _, out = fold([session.feedback(1_000, score=1.0)], session.start + 60_000)
    assert out.trajectories == [] and out.rewards == []
    ((raw, reason),) = out.late
    assert decode(raw).data.session_id == "never-seen" and "no calls of session never-seen are known" in reason


def failing_policy(session):
    raise KeyError("label")


def test_a_failing_policy_sets_the_feedback_aside_and_the_trajectory_goes_without_a_reward():
    session = Session("chat-fails")
    events = [session.call(1_000, [1], [2]), session.feedback(1_500, label="good"), session.end(2_000)]
    _, out = fold(events, session.start + 60_000, policy=f"{__name__}:failing_policy")
    (trajectory,) = out.trajectories
    assert trajectory.data.reward is None and out.rewards == []
    ((raw, reason),) = out.unscored
    assert decode(raw).type == "feedback" and "reward policy" in reason and "KeyError" in reason


@pytest.mark.parametrize("body", [dict(label="resolved"), dict(score=0.7), dict(thumbs="up")])
def test_the_default_policy_scores_scores_and_thumbs_and_leaves_labels_alone(body):
    session = Session("chat-values")
    events = [session.call(1_000, [1], [2]), session.feedback(1_500, **body), session.end(2_000)]
    _, out = fold(events, session.start + 60_000)
    (trajectory,) = out.trajectories
    assert trajectory.data.reward == {"label": None, "score": 0.7, "thumbs": 1.0}[next(iter(body))]


def test_a_call_recorded_without_logprobs_is_marked_on_its_turn():
    session = Session("chat-nologprobs")
    with_logprobs, without, short = (session.call(1_000, [1], [2]), session.call(2_000, [1, 2, 3], [4, 5]),
                                     session.call(3_000, [1, 2, 3, 4, 5, 6], [7, 8]))
    without.data.logprobs = None
    short.data.logprobs = [-0.1]  # not one per completion token: as good as none
    _, out = fold([with_logprobs, without, short, session.end(4_000)], session.start + 60_000)
    (trajectory,) = out.trajectories
    assert [turn.logprobs_missing for turn in trajectory.data.turns] == [False, True, True]
    assert [turn.logprobs for turn in trajectory.data.turns] == [[-0.5], [0.0, 0.0], [0.0, 0.0]]


def test_the_policys_rewards_read_back_twice_are_no_input_to_another_policy():
    """A worker that died after publishing a conversation's reward publishes it again: a rebuild under another
    policy reads both copies before it settles the conversation, and neither is an event of it."""
    session = Session("chat-twice")
    events = [session.call(1_000, [1], [2]), session.end(2_000), session.feedback(2_100, thumbs="down")]
    _, live = fold(events, session.start + 60_000)
    (reward,) = live.rewards
    assert reward.data.value == 0.0
    by_time = sorted([*events, reward, reward], key=lambda e: e.time)  # (its time is the end's: read before settling)
    assembly, rebuilt = fold(by_time, session.start + 60_000, policy="streams.policies:signed_thumbs")
    (trajectory,) = rebuilt.trajectories
    assert trajectory.data.reward == -1.0 and reward.id not in trajectory.data.lineage
    assert {r.reward_fn for r in trajectory.data.rewards} == {"streams.policies:signed_thumbs"}
    assert assembly.counts["duplicates"] == 1


def test_a_settled_conversation_keeps_its_calls_offsets_and_a_revision_reads_the_calls_back():
    """Given the calls' offsets (as the worker reads them), a settled conversation's state holds references, not
    its calls; later feedback's revision reads them back by offset and is the same bytes as one built from calls
    kept whole. A log that no longer holds them (or holds another event there) makes no revision: the reward is
    still published, the feedback deadlettered with why, and counted. Never a revision from other calls."""
    session = Session("chat-lean")
    calls = [session.call(1_000, [1, 2], [3]), session.call(2_000, [1, 2, 3, 4], [5, 6])]
    early = [*calls, session.end(3_000), session.feedback(3_500, thumbs="up")]
    later = session.feedback(40_000, score=0.25)
    offsets = {call.id: offset for offset, call in enumerate(calls, start=100)}  # in the calls topic's partition 0
    log = {offset: encode(call) for offset, call in enumerate(calls, start=100)}
    now = session.start + 60_000
    _, whole = fold([*early, later], now)  # no offsets: the calls kept whole (as a rebuild keeps them)
    assert len(whole.trajectories) == 2 and whole.trajectories[1].data.revision_of == whole.trajectories[0].id

    def lean(log: dict[int, bytes]) -> tuple[Assembly, list[list], Settled]:
        asked: list[list] = []

        def recall(refs: list) -> dict[str, bytes]:
            asked.append(refs)
            return {event_id: log[offset] for _, offset, event_id in refs if offset in log}
        assembly, settled = fold(early, session.start + 30_000, assembly=Assembly({}, {}, TIMING, recall=recall),
                                 offsets=offsets)
        (attempt,) = assembly.rollouts[session.rollout_id]["attempts"].values()
        assert attempt["settled"]["trajectory"] == whole.trajectories[0].id
        assert [entry[2] for entry in attempt["calls"]] == [100, 101]
        assert not any(call.id in assembly.events for call in calls), "a settled conversation kept its calls"
        assert asked == []  # nothing read back for the first trajectory
        _, out = fold([later], now, assembly=assembly)
        settled.extend(out)
        return assembly, asked, settled

    assembly, asked, settled = lean(log)
    assert asked == [[(0, 100, calls[0].id), (0, 101, calls[1].id)]]
    assert [encode(t) for t in settled.trajectories] == [encode(t) for t in whole.trajectories]
    assert settled.unrevised == [] and assembly.recalled == {}

    for gone in ({}, {100: log[100], 101: encode(session.call(2_500, [7], [8]))}):  # deleted; another event there
        assembly, asked, settled = lean(gone)
        assert len(asked) == 1 and [t.id for t in settled.trajectories] == [whole.trajectories[0].id]
        assert [r.id for r in settled.rewards] == [r.id for r in whole.rewards]  # the reward names the trajectory
        ((raw, reason),) = settled.unrevised
        assert decode(raw).id == later.id and assembly.counts["revisions_unavailable"] == 1
        assert f"no revision of trajectory {whole.trajectories[0].id}" in reason
        assert ("offsets 100, 101" if not gone else "offsets 101") in reason and "--session-retention-s" in reason


HOUR = 3_600_000


def test_the_due_index_holds_the_open_conversations_not_the_ones_kept_for_later_feedback():
    """5,000 settled conversations kept for --session-retention-s (30 days) and 10 open ones: with a horizon of an
    hour, the index of when each is due holds the open ones only (the kept ones are due in 30 days: a pass over
    the state finds them once a horizon), and the fold decides as one that indexes them all."""
    kept = Timing(**{**TIMING.__dict__, "session_retention_ms": 30 * 24 * HOUR})
    start, events = 1_700_000_000_000, []
    for i in range(5_000):
        session = Session(f"chat-kept-{i}", start + 10 * i)
        events += [session.call(1_000, [1], [2]), session.end(2_000)]
    opened = [Session(f"chat-open-{i}", start + 60_000) for i in range(10)]
    events += [session.call(1_000, [1], [2]) for session in opened]
    now = start + 70_000  # every kept conversation settled (ended + the feedback window), none of the open ones
    bounded, out = fold(events, now, assembly=Assembly({}, {}, kept, horizon_ms=HOUR))
    everything, expected = fold(events, now, assembly=Assembly({}, {}, kept))
    assert bounded.counts["sessions"] == 5_000 and len(bounded.rollouts) == 5_010
    assert (bounded.indexed(), everything.indexed()) == (10, 5_010)
    assert [encode(t) for t in out.trajectories] == [encode(t) for t in expected.trajectories]
    assert bounded.next_due([0]) == everything.next_due([0]) == start + 60_000 + 1_000 + 10_000 + 5_000


def test_what_is_due_beyond_the_horizon_settles_on_time():
    """Later feedback two hours after its conversation settled, and the conversation forgotten three hours after:
    both past an index of one hour ahead, found by its passes over the state, at the times an index of everything
    finds them (`next_due` says when, exactly, for the worker's timer)."""
    kept = Timing(**{**TIMING.__dict__, "session_retention_ms": 3 * HOUR})
    session, other = Session("chat-beyond"), Session("chat-beyond-other")
    call = session.call(1_000, [1], [2])
    early = [call, session.end(2_000), other.call(1_500, [3], [4]), other.end(2_500)]
    late = session.feedback(2 * HOUR, call, thumbs="up")
    settled_at = session.start + 2_000 + TIMING.feedback_window_ms
    forgotten_at = settled_at + 3 * HOUR
    for horizon_ms in (HOUR, None):
        assembly, out = fold(early, session.start + 60_000, assembly=Assembly({}, {}, kept, horizon_ms=horizon_ms))
        assert len(out.trajectories) == 2 and assembly.indexed() == (0 if horizon_ms else 2)
        assert assembly.next_due([0]) == settled_at + 3 * HOUR  # the first to be forgotten, beyond the horizon
        _, revised = fold([late], late.time + TIMING.settle_ms, assembly=assembly)  # 2 h on: a pass found it
        (revision,) = revised.trajectories
        (first,) = [t for t in out.trajectories if t.rollout_id == session.rollout_id]
        assert revision.data.revision_of == first.id and revision.data.reward == 1.0
        assert assembly.next_due([0]) == forgotten_at  # (kept from its first settling, whatever came later)
        assert assembly.settle_due(forgotten_at - 1).forgotten == []
        assert assembly.settle_due(forgotten_at).forgotten == ["segment-0"]
        assert assembly.rollouts[session.rollout_id]["attempts"] == {}  # (its numbering kept: never due again)
        assert assembly.settle_due(forgotten_at + 500).forgotten == ["segment-0"]  # the other one's
        assert assembly.counts["due_index_passes"] == (4 if horizon_ms else 0)  # at the start, 2 h, 3 h, 3 h + 7 s


class Read(dict):
    """The rollouts' states, counting those read by key (a pass reads each so)."""

    reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return super().__getitem__(key)


def test_the_pass_over_the_state_runs_in_slices_no_larger_than_asked():
    """The pass that extends the index begins half a horizon before the index runs out and reads at most `limit`
    states a call (between a worker's batches), resuming after the last key it read; done, the index is what one
    pass at once makes of it."""
    kept = Timing(**{**TIMING.__dict__, "session_retention_ms": 30 * 24 * HOUR})
    start, events = 1_700_000_000_000, []
    for i in range(2_500):
        session = Session(f"chat-slices-{i}", start + 10 * i)
        events += [session.call(1_000, [1], [2]), session.end(2_000)]
    rollouts = Read()
    now = start + 70_000
    assembly, _ = fold(events, now, assembly=Assembly(rollouts, {}, kept, horizon_ms=HOUR))
    assembly.reindex(now)  # (the index reaches an hour past now)
    passes, sliced = assembly.counts["due_index_passes"], assembly.counts["due_index_slices"]
    rollouts.reads = 0
    assert not assembly.look_ahead(now + HOUR // 2 - 1, 300) and rollouts.reads == 0  # not begun yet
    slices = []
    while True:
        rollouts.reads = 0
        under_way = assembly.look_ahead(now + HOUR // 2, 300)
        slices.append(rollouts.reads)
        if not under_way:
            break
    assert slices == [300] * 8 + [100] and assembly.counts["due_index_passes"] == passes + 1
    assert assembly.counts["due_index_slices"] == sliced + 9  # (what /analytics shows: assembly.due_index_slices)
    at_once = Assembly(dict(rollouts), {}, kept, horizon_ms=HOUR)
    at_once.reindex(now + HOUR // 2)
    assert assembly.indexed() == at_once.indexed() == 0
    assert assembly.next_due([0]) == at_once.next_due([0]) == start + 2_000 + TIMING.feedback_window_ms + 30 * 24 * HOUR
    assert not assembly.look_ahead(now + HOUR, 300)  # the next one begins half a horizon before 2 h past now


def sessions_over_a_minute(rng: random.Random) -> list[s.Event]:
    """Twelve sessions' calls, ends and feedback (some after their conversation settled: a revision) over a
    minute, in time order."""
    events = []
    for i in range(12):
        session = Session(f"chat-mid-pass-{i}", 1_700_000_000_000 + rng.randrange(20_000))
        at = 0
        for _ in range(rng.randrange(1, 4)):
            at += rng.randrange(500, 12_000)
            call = session.call(at, [1], [2])
            events.append(call)
            if rng.random() < 0.5:
                events.append(session.feedback(at + rng.choice([300, 8_000, 25_000]), call, thumbs="up"))
        if rng.random() < 0.6:
            events.append(session.end(at + rng.randrange(100, 3_000)))
    return sorted(events, key=lambda e: (e.time, e.id))


def test_a_state_changed_while_a_pass_is_under_way_is_still_settled_on_time():
    """Passes of slices of one or two states run between the events (a horizon of 5 s, so each spans several
    events; three partitions): rollouts are added and changed ahead of a pass and behind it, nearer than its horizon and beyond it.
    At every step the bounded index finds due exactly what an index of everything finds, its `next_due` is never
    later than the truth, and the trajectories are the same bytes."""
    for seed in range(20):
        rng = random.Random(seed)
        events = sessions_over_a_minute(rng)
        bounded, everything = Assembly({}, {}, TIMING, horizon_ms=5_000), Assembly({}, {}, TIMING)
        got, expected, slices = Settled("all"), Settled("all"), 0
        for event in [*events, None]:
            at = events[-1].time + 200_000 if event is None else event.time - 1
            while rng.random() < 0.7:
                slices += bounded.look_ahead(at, rng.choice([1, 2]))
            for partition in range(3):
                truth, found = everything.next_due([partition]), bounded.next_due([partition])
                assert (found is None) == (truth is None) and (truth is None or found <= truth), seed
            assert bounded.due(at) == everything.due(at), seed
            got.extend(bounded.settle_due(at))
            expected.extend(everything.settle_due(at))
            if event is not None:
                partition = int(event.rollout_id[-1], 16) % 3
                assert bounded.add(event, encode(event), partition) is None
                assert everything.add(event, encode(event), partition) is None
        assert [encode(t) for t in got.trajectories] == [encode(t) for t in expected.trajectories], seed
        assert [encode(r) for r in got.rewards] == [encode(r) for r in expected.rewards]
        assert slices > 20 and bounded.indexed() < everything.indexed()


def test_a_rebalance_mid_pass_restarts_the_index_from_nothing():
    """A worker's recovery (after every rebalance) restarts the index, whatever pass was under way: until its own
    pass is done nothing is known, so asking what is next due finishes it first, never answers from half an index."""
    kept = Timing(**{**TIMING.__dict__, "session_retention_ms": 30 * 24 * HOUR})
    start, events = 1_700_000_000_000, []
    for i in range(50):
        session = Session(f"chat-rebalance-{i}", start + 10 * i)
        events += [session.call(1_000, [1], [2]), session.end(2_000)]
    opened = Session("chat-rebalance-open", start + 60_000)
    events.append(opened.call(1_000, [1], [2]))
    now = start + 70_000
    assembly, _ = fold(events, now, assembly=Assembly({}, {}, kept, horizon_ms=HOUR))
    at_once = Assembly(dict(assembly.rollouts), {}, kept, horizon_ms=HOUR)
    at_once.reindex(now)
    assembly.reindex(now - HOUR // 2)
    assert assembly.look_ahead(now, 7) and assembly.look_ahead(now, 7)  # a pass under way
    assembly.restart(now)
    assert assembly.indexed() == 0
    assert assembly.look_ahead(now, 7)  # the rebuild under way: 7 of 51 read
    assert assembly.next_due([0]) == at_once.next_due([0]) == start + 60_000 + 1_000 + 10_000 + 5_000
    assert assembly.indexed() == at_once.indexed() == 1 and not assembly.look_ahead(now, 7)

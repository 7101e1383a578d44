"""`python -m agentstream.streams worker` as a real process against the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.partitioner import DefaultPartitioner

import agentstream.schemas as s
from agentstream.schemas.codec import encode
from agentstream.schemas.kafka import Publisher, make_consumer, make_producer, partitions_of
from tests.support.streams import Rollout, StreamsWorker, TopicWatch, live, publish
from tests.support.wait import wait_for, wait_for_async

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def worker_factory(kafka, tmp_path):
    workers: list[StreamsWorker] = []

    def make(name: str = "w1", *args: str, fault: str | None = None) -> StreamsWorker:
        worker = StreamsWorker(kafka, tmp_path / name, tmp_path / f"{name}.log", args, fault=fault)
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.stop()


def trajectories_by_rollout(events: list[s.Event]) -> dict[str, list[s.TrajectoryEvent]]:
    out: dict[str, list[s.TrajectoryEvent]] = {}
    for event in events:
        if event.type == "trajectory":
            out.setdefault(event.rollout_id, []).append(event)
    return out


def assert_once_each(events: list[s.Event], rollout_ids: set[str]) -> None:
    """Every rollout has one trajectory id; a repeat (re-emitted after a crash) is the same event."""
    found = trajectories_by_rollout(events)
    assert set(found) == rollout_ids, f"missing: {sorted(rollout_ids - set(found))}"
    for rollout_id, copies in found.items():
        assert len({copy.id for copy in copies}) == 1, f"{rollout_id}: several trajectory ids"
        assert len({encode(copy) for copy in copies}) == 1, f"{rollout_id}: repeats differ in {differing(copies)}"


def differing(copies: list[s.TrajectoryEvent]) -> dict:
    """The trajectory fields whose values differ between copies, with their values."""
    dumps = [copy.data.model_dump() for copy in copies]
    return {name: [dump[name] for dump in dumps] for name in dumps[0] if any(d[name] != dumps[0][name] for d in dumps)}


async def test_worker_assembles_rollouts_and_deadletters_what_it_cannot_use(kafka, worker_factory):
    worker = worker_factory().start()
    merged, split = live(Rollout("r-merged")), live(Rollout("r-split"))
    scored = live(Rollout("r-scored", reward_fn="streams.rewards:exact_match", metadata={"answer": "89"}))
    events = merged.two_turns(merged=True) + split.two_turns(merged=False) + scored.two_turns(reward=None)
    duplicates = [events[1], events[2]]
    garbage = [("calls", b"r-merged", b"{not json"), ("rewards", b"r-merged", b'{"type": "reward"}')]
    async with TopicWatch(kafka, "trajectories", "rewards", "deadletter") as watch:
        await publish(kafka, events + duplicates, raw=garbage)
        # two topics, read in either order: the computed reward may arrive after its trajectory
        await watch.until(lambda seen: len(trajectories_by_rollout(seen)) == 3 and any(
            e.type == "reward" and e.source == "streams" for e in seen), what="three trajectories and the computed reward")
        by_rollout = {rid: copies[0].data for rid, copies in trajectories_by_rollout(watch.events).items()}
        assert by_rollout["r-merged"].merged and by_rollout["r-merged"].sequences[0].token_ids == list(range(1, 10))
        assert not by_rollout["r-split"].merged and by_rollout["r-split"].merge_mismatches == 1
        assert len(by_rollout["r-merged"].turns) == 2  # the duplicated calls counted once

        computed = [e for e in watch.of_type("reward") if e.source == "streams"]
        assert [(e.rollout_id, e.data.value, e.data.reward_fn) for e in computed] == [
            ("r-scored", 1.0, "streams.rewards:exact_match")]
        assert by_rollout["r-scored"].reward == 1.0 and computed[0].id in by_rollout["r-scored"].lineage

        late = merged.call([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11])
        await publish(kafka, [late])
        await watch.until(lambda seen: len([e for e in seen if e.type == "deadletter"]) == 3, what="deadletters")
        reasons = {e.data.reason.split(":")[0]: e.data for e in watch.of_type("deadletter")}
        assert set(reasons) == {"undecodable", "late"}
        assert reasons["late"].value == encode(late).decode() and reasons["late"].topic == kafka.topics.calls
        assert sum(e.data.reason.startswith("undecodable") for e in watch.of_type("deadletter")) == 2

        after = live(Rollout("r-after"))
        await publish(kafka, after.two_turns())  # the worker kept going
        await watch.until(lambda seen: "r-after" in trajectories_by_rollout(seen), what="a later trajectory")
    counts = worker.analytics()["assembly"]
    # duplicates: the two repeated calls, and the computed reward as it comes back from the rewards topic
    assert counts["duplicates"] == 3 and counts["undecodable"] == 2 and counts["late"] == 1


async def test_a_reward_that_never_comes_is_marked_missing_after_the_grace_period(kafka, worker_factory):
    worker_factory().start()
    rollout = live(Rollout("r-waiting"))
    events = rollout.two_turns(reward=None)
    async with TopicWatch(kafka, "trajectories") as watch:
        await publish(kafka, events)
        (trajectory,) = await watch.until(bool, what="the trajectory")
    assert trajectory.data.reward_missing and trajectory.data.reward is None
    assert trajectory.time == events[-1].time


async def test_sigkill_in_the_middle_of_a_stream_loses_and_duplicates_nothing(kafka, worker_factory):
    worker = worker_factory("crashing").start()
    rollouts = [live(Rollout(f"r-crash-{i}", reward_fn="streams.rewards:numeric_answer", metadata={"answer": 89}))
                for i in range(60)]
    first, second = rollouts[:30], rollouts[30:]
    async with TopicWatch(kafka, "trajectories", "rewards") as watch:
        await publish(kafka, [event for rollout in first for event in rollout.two_turns(reward=None)])
        await watch.until(lambda seen: len(trajectories_by_rollout(seen)) >= 5, what="some trajectories")
        worker.kill()  # mid-stream: some attempts settled, some not, offsets not all committed
        await publish(kafka, [event for rollout in second for event in rollout.two_turns(reward=None)])
        worker.start()
        ids = {rollout.rollout_id for rollout in rollouts}
        # rewards and trajectories are two topics: the watch may read either one first
        await watch.until(lambda seen: set(trajectories_by_rollout(seen)) == ids
                          and {e.rollout_id for e in seen if e.type == "reward"} == ids, timeout=120,
                          what="a trajectory and a computed reward for every rollout")
        assert_once_each(watch.events, ids)
        computed = Counter(e.rollout_id for e in watch.of_type("reward"))
        assert set(computed) == ids
        bad = {rid: [(c.data.reward, c.data.lineage, [t.call_id for t in c.data.turns]) for c in copies]
               for rid, copies in trajectories_by_rollout(watch.events).items() if any(c.data.reward != 1.0 for c in copies)}
        assert not bad, bad


async def test_the_consumer_group_commits_what_the_worker_handled(kafka, worker_factory):
    """The worker takes its records past Faust's streams (an inbox) but acknowledges each to Faust: the
    group's committed offsets reach the sources' ends, so a restarted worker does not read them from
    the start."""
    worker_factory().start()
    rollouts = [live(Rollout(f"r-commit-{i}")) for i in range(12)]
    async with TopicWatch(kafka, "trajectories") as watch:
        await publish(kafka, [event for rollout in rollouts for event in rollout.two_turns()])
        await watch.until(lambda seen: len(trajectories_by_rollout(seen)) == 12, what="every trajectory")
    sources = [tp for base in ("rollouts", "calls", "rewards") for tp in await partitions_of(kafka, kafka.topics.name(base))]
    reader = make_consumer(kafka, group_id=None)
    await reader.start()
    try:
        ends = {tp: end for tp, end in (await reader.end_offsets(sources)).items() if end}
    finally:
        await reader.stop()
    assert ends
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        async def committed_to_the_ends() -> bool:
            offsets = await admin.list_consumer_group_offsets(f"{kafka.topic_prefix}agentstream-streams")
            return all(tp in offsets and offsets[tp].offset >= end for tp, end in ends.items())

        await wait_for_async(committed_to_the_ends, timeout=30, what="the group's offsets at the sources' ends")
    finally:
        await admin.close()


async def test_two_workers_share_the_partitions_and_emit_each_trajectory_once(kafka, worker_factory):
    one, two = worker_factory("one").start(), worker_factory("two").start()

    def split() -> bool:
        mine, theirs = (set(w.analytics()["assembly"]["partitions"]) for w in (one, two))
        return bool(mine) and bool(theirs) and not mine & theirs and mine | theirs == set(range(kafka.partitions))

    wait_for(split, timeout=90, what="the two workers to split the partitions")
    rollouts = [live(Rollout(f"r-pair-{i}")) for i in range(40)]
    async with TopicWatch(kafka, "trajectories") as watch:
        await publish(kafka, [event for rollout in rollouts for event in rollout.two_turns()])
        ids = {rollout.rollout_id for rollout in rollouts}
        await watch.until(lambda seen: set(trajectories_by_rollout(seen)) == ids, what="every trajectory")
        assert_once_each(watch.events, ids)
        assert len(watch.events) == len(ids)  # no rebalance happened: not even a repeat
    made = [w.analytics()["assembly"].get("trajectories", 0) for w in (one, two)]
    assert sum(made) == 40 and all(made), made


async def test_windowed_analytics_are_served_and_published(kafka, worker_factory):
    worker = worker_factory().start()
    version_one = [live(Rollout(f"r-v1-{i}", version=1)) for i in range(3)]
    version_two = [live(Rollout(f"r-v2-{i}", version=2)) for i in range(2)]
    events = [e for r in version_one for e in r.two_turns(reward=0.25)]
    events += [e for r in version_two for e in r.two_turns(reward=0.75)]
    failed_call = version_two[0].call([1], [], status=500)
    async with TopicWatch(kafka, "metrics") as watch:
        await publish(kafka, events + [failed_call])

        def rows():
            view = worker.analytics()
            by_version = {row["weight_version"]: row for row in view["windows"]["60"]}
            return by_version if sum(row["trajectories"] for row in by_version.values()) == 5 else None

        by_version = wait_for(rows, timeout=60, what="five trajectories in the 60 s windows")
        assert by_version[1]["calls"] == 6 and by_version[1]["reward_mean"] == 0.25
        assert by_version[2]["calls"] == 5 and by_version[2]["errors"] == 1 and by_version[2]["reward_mean"] == 0.75
        assert by_version[2]["error_rate"] == pytest.approx(0.2)
        assert by_version[1]["tokens_in"] == 3 * (3 + 7) and by_version[1]["tokens_out"] == 3 * 4
        assert 4 <= by_version[1]["latency_p50_ms"] <= 6.25  # every call took 5 ms; buckets are 25 % wide

        def published(seen):
            latest = {}
            for event in seen:
                key = (event.data.window_s, event.data.window_start, tuple(sorted(event.data.group.items())))
                latest[key] = event.data
            return sum(m.values.get("trajectories", 0) for m in latest.values() if m.window_s == 10) == 5

        await watch.until(published, what="the windows on the metrics topic")


async def test_an_sdk_retry_is_one_turn_and_sampling_twice_on_purpose_keeps_both(kafka, worker_factory):
    worker_factory().start()
    retried, twice = live(Rollout("r-sdk-retry")), live(Rollout("r-sampled-twice"))
    lost = retried.call([1, 2, 3], [4, 5], "45")  # recorded by the gateway; the agent never got it
    again = retried.call([1, 2, 3], [6, 7], "67", retry_count=1)  # x-stainless-retry-count: 1
    events = [retried.queued(), lost, again, retried.call([1, 2, 3, 6, 7, 8], [9], "9"), retried.finished()]
    first, second = twice.call([1, 2, 3], [4, 5]), twice.call([1, 2, 3], [6, 7], retry_count=0)
    events += [twice.queued(), first, second, twice.call([1, 2, 3, 4, 5, 6, 7, 8], [9]), twice.finished()]
    async with TopicWatch(kafka, "trajectories") as watch:
        await publish(kafka, events)
        await watch.until(lambda seen: len(trajectories_by_rollout(seen)) == 2, what="two trajectories")
    found = {rid: copies[0].data for rid, copies in trajectories_by_rollout(watch.events).items()}
    one = found["r-sdk-retry"]
    assert [turn.call_id for turn in one.turns] == [again.id, events[3].id] and lost.id in one.lineage
    assert one.merged and one.superseded == 1 and one.sequences[0].token_ids == [1, 2, 3, 6, 7, 8, 9]
    both = found["r-sampled-twice"]
    assert [turn.call_id for turn in both.turns][:2] == [first.id, second.id] and both.superseded == 0


@pytest.mark.timeout(900)
async def test_a_burst_with_the_worker_killed_twice_settles_every_attempt_once(kafka, worker_factory):
    """20,000 events (4,000 attempts) while the worker is SIGKILLed twice and restarted. The deadlines
    are for a machine shared by many (each phase takes seconds on a quiet one)."""
    # settle 5 s: the burst's events reach the broker a little after their time (built, then published,
    # 500 at a time), and a worker must not settle an attempt while its events are on their way. The
    # burst is published from a thread of its own: on this loop, decoding what the watch reads held the
    # producer up for seconds on a loaded machine, past the settle time (calls deadlettered as late)
    worker = worker_factory("burst", "--settle-s", "5").start()
    ids = {f"r-burst-{i}" for i in range(4000)}

    async def burst() -> int:
        # one producer for the whole burst: one started per chunk put its start-up between an
        # event's time and its arrival, seconds on a loaded machine
        producer = make_producer(kafka, linger_ms=20)
        await producer.start()
        try:
            publisher, sent = Publisher(producer, kafka.topics), 0
            for chunk in range(0, 4000, 100):
                rollouts = [live(Rollout(f"r-burst-{i}")) for i in range(chunk, chunk + 100)]
                pending = [await publisher.send(event) for rollout in rollouts for event in rollout.two_turns()]
                await asyncio.gather(*pending)
                sent += len(pending)
            return sent
        finally:
            await producer.stop()

    async with TopicWatch(kafka, "trajectories", "deadletter") as watch:
        publishing = asyncio.get_running_loop().run_in_executor(None, asyncio.run, burst())
        for share in (0.1, 0.4):  # killed twice, each time in the middle of the burst's trajectories
            await watch.until(lambda seen, share=share: len(trajectories_by_rollout(seen)) >= share * len(ids), timeout=240,
                              what=f"{share:.0%} of the trajectories")
            worker.kill()
            worker.start()
        assert await publishing == 20_000
        await watch.until(lambda seen: set(trajectories_by_rollout(seen)) >= ids, timeout=240,
                          what="a trajectory for every attempt")
        assert_once_each(watch.events, ids)
        short = {rid: (len(copies[0].data.turns), copies[0].data.lineage) for rid, copies in
                 trajectories_by_rollout(watch.events).items() if len(copies[0].data.turns) != 2}
        late = [(e.data.key, e.data.reason[:80]) for e in watch.of_type("deadletter") if e.data.key in short]
        assert not short, f"trajectories without both turns: {list(short.items())[:5]}; deadletters: {late[:5]}"
    wait_for(lambda: worker.analytics(open_attempts=True)["assembly"]["open_attempts"] == 0, timeout=30,
             what="no attempt left unsettled")


def partition_of(rollout_id: str, partitions: int) -> int:
    """Where the producer puts a rollout's events (Kafka's default partitioner: murmur2 of the key)."""
    return DefaultPartitioner()(rollout_id.encode(), list(range(partitions)), list(range(partitions)))


@pytest.mark.slow  # the watchdog's STALL_S (10 s) at least
async def test_a_partition_stalled_while_the_others_get_records_is_read_again(kafka, worker_factory):
    """The records at one partition's end are lost on their way to the worker (no later record of it shows the
    gap) while the other partitions get records all along: that partition's own watchdog reads it again after
    STALL_S. (One clock for all partitions, which the traffic keeps resetting, never fired: its attempt stayed
    open for as long as the traffic went on.)"""
    worker = worker_factory("stalling", fault="streams.drop_calls:1").start()
    stalled = live(Rollout("r-stalled"))
    partitions = kafka.partitions
    others = (rollout_id for rollout_id in (f"r-busy-{i}" for i in itertools.count())
              if partition_of(rollout_id, partitions) != partition_of(stalled.rollout_id, partitions))
    async with TopicWatch(kafka, "trajectories") as watch:
        await publish(kafka, stalled.two_turns())  # its calls: the first the worker fetches, dropped
        # (its finish, written after its calls, handled: its calls were fetched before any of the traffic's)
        wait_for(lambda: worker.handled("rollouts") == 2, timeout=60, what="the stalled rollout's finish read")

        stop = asyncio.Event()

        async def traffic() -> None:  # a rollout elsewhere every 0.5 s, until told to stop (each publish finished)
            for rollout_id in others:
                await publish(kafka, live(Rollout(rollout_id)).two_turns())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
                if stop.is_set():
                    return

        busy = asyncio.create_task(traffic())
        try:
            found = await watch.until(lambda seen: stalled.rollout_id in trajectories_by_rollout(seen), timeout=90,
                                      what="the stalled partition's trajectory")
        finally:
            stop.set()
            await busy
    (trajectory,) = trajectories_by_rollout(found)[stalled.rollout_id]
    assert len(trajectory.data.turns) == 2  # its calls, read again
    assert len(trajectories_by_rollout(found)) > 10  # the other partitions were busy meanwhile
    assert worker.analytics()["assembly"]["stalls"] >= 1

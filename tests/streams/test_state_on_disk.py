"""The worker's table on disk (`--store rocksdb`): a real worker process against the real broker, killed -9."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.streams.test_worker import assert_once_each, trajectories_by_rollout, worker_factory  # noqa: F401
from tests.support.streams import Rollout, StreamsWorker, TopicWatch, live, publish
from tests.support.wait import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # two worker starts, each recovering its table

DISK = ("--store", "rocksdb", "--state-memory-mb", "8", "--write-every-s", "0.2")


def quiet(worker: StreamsWorker) -> bool:
    """Everything it read is handled, written and in its databases (nothing staged, nothing on its way)."""
    view = worker.analytics()
    if view is None:
        return False
    state = view["state"]
    return state["unwritten_changes"] == 0 and state["held_changes"] == 0


async def test_killed_it_restarts_from_its_disk_and_the_changelog_tail(kafka, worker_factory):
    worker = worker_factory("disk", *DISK).start()
    first = [live(Rollout(f"r-disk-{i}", reward_fn="streams.rewards:numeric_answer", metadata={"answer": 89}))
             for i in range(40)]
    second = [live(Rollout(f"r-disk-late-{i}")) for i in range(20)]
    async with TopicWatch(kafka, "trajectories") as watch:
        await publish(kafka, [event for rollout in first for event in rollout.two_turns(reward=None)])
        await watch.until(lambda seen: len(trajectories_by_rollout(seen)) == len(first), timeout=120,
                          what="the first rollouts' trajectories")
        wait_for(lambda: quiet(worker), timeout=60, what="the worker's state written and acknowledged")
        view = worker.analytics()
        assert view is not None
        written = sum(view["state"]["changelog_offsets"].values())  # what its databases hold, up to the kill
        worker.kill()
        await publish(kafka, [event for rollout in second for event in rollout.two_turns()])
        worker.start()
        ids = {rollout.rollout_id for rollout in first + second}
        await watch.until(lambda seen: set(trajectories_by_rollout(seen)) == ids, timeout=120,
                          what="every rollout's trajectory")
        assert_once_each(watch.events, ids)
        # the state came back from disk: nothing settled before the kill is settled (published) again
        copies = Counter(event.rollout_id for event in watch.of_type("trajectory"))
        assert {rid: n for rid, n in copies.items() if n > 1} == {}
    view = worker.analytics()
    assert view is not None
    state = view["state"]
    assert state["store"] == "rocksdb"
    # it read the changelog's tail only: at most the last record of each partition again (Faust seeks to the
    # offset its database holds up to, inclusive), not the `written` records before the kill
    assert written > 100
    assert sum(state["changelog_offsets"].values()) > written  # and it wrote on from there
    assert state["restored_records"] <= len(state["restored_by_partition"]) <= 4, (state, written)
    assert 0 < state["memory_bytes"] <= state["memory_budget_bytes"] == 8 * 1024 * 1024
    assert view["assembly"]["trajectories"] == len(second)  # what this run settled: the second rollouts only
    assert list(worker.data_dir.rglob("*.sst")) or list(worker.data_dir.rglob("*.log")), "no database on disk"

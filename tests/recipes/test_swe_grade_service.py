"""The grader service under the broker's group rules. A machine stalled past the consumer's session (seen in
a recipe run at load 50: the grader's next commit was refused and the process died, leaving every later diff
ungraded) must cost a regrade at most, never the service."""

from __future__ import annotations

import logging
import time

import pytest
from aiokafka import TopicPartition

from agentstream.recipes.swe.grade_service import GradeService, GradeSettings
from agentstream.schemas.kafka import ensure_topics, make_consumer
from tests.support.wait import wait_for_async

SESSION_MS = 6_000


@pytest.mark.slow  # ~15 s: a consumer session expiring, a rejoin
async def test_a_commit_the_group_refuses_after_a_stall_is_logged_and_the_next_one_lands(kafka, tmp_path, caplog):
    settings = GradeSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                             tasks=tmp_path / "tasks.jsonl", group_id="grader-stall")
    await ensure_topics(settings)
    service = GradeService(settings, [], grader=object())  # type: ignore[arg-type]  # no diff is graded here
    group = f"{kafka.topic_prefix}grader-stall"
    consumer = make_consumer(settings, settings.topics.rollouts, group_id=group, session_timeout_ms=SESSION_MS,
                             heartbeat_interval_ms=1_000)
    await consumer.start()
    try:
        async def assigned() -> bool:
            await consumer.getmany(timeout_ms=200)
            return bool(consumer.assignment())

        await wait_for_async(assigned, timeout=60, what="the partitions assigned")
        tp = TopicPartition(settings.topics.rollouts, 0)
        service.offsets.start(tp, 0)
        service.offsets.done(tp, 0)  # a diff graded and answered: offset 1 is due to be committed

        # The stall itself (the fault this test injects, not a wait for something): the event loop, heartbeats
        # included, is held past the session, so the broker drops this member while it still holds its partitions.
        time.sleep(SESSION_MS / 1000 + 3)
        with caplog.at_level(logging.WARNING, logger="recipes.swe.grade_service"):
            await service._commit(consumer)  # refused: the group went on without this member; not raised
        assert "not committed" in caplog.text and not service._committed

        await wait_for_async(assigned, timeout=60, what="the member to rejoin and get its partitions back")
        await service._commit(consumer)
        assert service._committed == {tp: 1}
        assert (await consumer.committed(tp)) == 1, "the broker holds the commit made after the rejoin"
    finally:
        await consumer.stop()

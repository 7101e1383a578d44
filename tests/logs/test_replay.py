"""Replay against a real broker: rebuilt trajectories equal a real streams worker's, datasets round-trip,
a killed replay resumes and covers its range exactly once, and `agentstream top` shows the windows."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import orjson
import polars as pl
import pytest

import agentstream.schemas as s
from agentstream.archive import Archiver
from agentstream.logs.replay import Job, Options, Progress, RebuildSpec, ReplayError, parse_versions, replay
from agentstream.logs.top import TopView
from agentstream.schemas.codec import encode
from agentstream.schemas.kafka import KafkaSettings, Publisher, ensure_topics, make_producer
from agentstream.schemas.scan import scan
from agentstream.streams.assembly import Timing
from agentstream.streams.rewards import Sample
from samples.assembly import assemble
from tests.support import faults
from tests.support.logs import cli, read_topic, without_rewards
from tests.support.streams import REPO, Rollout, Session, StreamsWorker, TopicWatch, live, publish
from tests.support.wait import wait_for

pytestmark = pytest.mark.timeout(240)
WORKER_TIMING = ["--settle-s", "0.2", "--reward-grace-s", "2"]  # what StreamsWorker runs with
NEW_FN = "tests.logs.test_replay:answer_length"


def answer_length(sample: Sample) -> float:
    """The reward function a rebuild swaps in."""
    return len(sample.answer) / 10


def recorded_rollouts() -> tuple[list[s.Event], dict[str, str]]:
    """A mix of attempts: merged and split turns, agent rewards, computed rewards, a missing reward, a failure,
    an attempt no controller manages, two weight versions, repeated events. Returns the events and each
    rollout's case."""
    cases: dict[str, str] = {}
    events: list[s.Event] = []

    def add(case: str, rollout: Rollout, made: list[s.Event]) -> None:
        cases[rollout.rollout_id] = case
        events.extend(made)

    for i in range(4):
        add("rewarded", r := live(Rollout(f"r-ok-{i}", version=1 + i % 2, group_id="g")), r.two_turns(reward=i / 4))
    for i in range(2):
        add("split", r := live(Rollout(f"r-split-{i}", version=2)), r.two_turns(merged=False, reward=0.5))
    for i in range(3):
        add("scored", r := live(Rollout(f"r-fn-{i}", reward_fn="streams.rewards:exact_match",
                                        metadata={"answer": "89"})), r.two_turns(reward=None))
    add("missing", r := live(Rollout("r-missing")), r.two_turns(reward=None))
    add("failed", r := live(Rollout("r-failed")), [r.queued(), r.call([1, 2], [3], "3"), r.failed()])
    r = live(Rollout("r-agent", managed=False))
    add("agent", r, [r.call([5, 6], [7, 8], "78"), r.reward(1.0), r.finished(by="agent")])
    return events + [events[1], events[7]], cases


@pytest.fixture(scope="module")
async def recorded(kafka_bootstrap, tmp_path_factory):
    """A log a real streams worker has assembled: (settings, live trajectories by id, rollout cases)."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=4)
    assert (await ensure_topics(kafka)).ok
    tmp = tmp_path_factory.mktemp("replay-worker")
    worker = StreamsWorker(kafka, tmp / "data", tmp / "worker.log").start()
    try:
        events, cases = recorded_rollouts()
        async with TopicWatch(kafka, "trajectories") as watch:
            await publish(kafka, events)
            await watch.until(lambda seen: {e.rollout_id for e in seen} == set(cases), timeout=60,
                              what="a trajectory for every rollout")
    finally:
        worker.stop()
    trajectories = {e.id: e for e in watch.events}
    assert len(trajectories) == len(cases)
    return kafka, trajectories, cases


def cli_process(kafka: KafkaSettings, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """The command as a real process (to be SIGKILLed at `fault`, see tests/support/faults.py); the prefix goes before
    any `--` (the trainer's flags)."""
    at = args.index("--") if "--" in args else len(args)
    args = (*args[:at], "--prefix", kafka.topic_prefix, *args[at:])
    command = faults.command(fault, "agentstream", *args) if fault else [sys.executable, "-m", "agentstream", *args]
    return subprocess.run(command, cwd=REPO,
                          # wide, so rich never wraps a line the tests compare (its default is 80 columns)
                          env={**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "COLUMNS": "400"},
                          capture_output=True, text=True, timeout=120)


def by_partition(records: list[tuple[int, s.TrajectoryEvent]]) -> dict[int, list[bytes]]:
    """Each partition's records, encoded, in order."""
    found: dict[int, list[bytes]] = {}
    for partition, event in records:
        found.setdefault(partition, []).append(encode(event))
    return found


async def partitions_of_live(kafka: KafkaSettings) -> dict[str, int]:
    return {event.id: partition for partition, event in await read_topic(kafka, "trajectories")}


# --- rebuild ---------------------------------------------------------------------------------


async def test_rebuild_from_raw_events_reproduces_the_live_trajectories_exactly(recorded, monkeypatch, tmp_path):
    kafka, live_ones, _ = recorded
    result = await cli(kafka, monkeypatch, "replay", "rebuild", "--to-topic", "rebuilt", *WORKER_TIMING,
                       "--state", str(tmp_path / "state.json"))
    assert result.exit_code == 0, result.output
    rebuilt = await read_topic(kafka, "rebuilt")
    assert sorted(e.id for _, e in rebuilt) == sorted(live_ones)  # each once
    for _, event in rebuilt:
        assert encode(event) == encode(live_ones[event.id])  # same ids, token ids, rewards, lineage, times
    where = await partitions_of_live(kafka)
    assert all(partition == where[event.id] for partition, event in rebuilt)

    again = await cli(kafka, monkeypatch, "replay", "rebuild", "--to-topic", "rebuilt", *WORKER_TIMING,
                      "--state", str(tmp_path / "state.json"))
    assert again.exit_code == 0 and "already complete" in again.output


async def test_rebuild_with_a_new_reward_function_changes_only_the_rewards(recorded, monkeypatch, tmp_path):
    kafka, live_ones, cases = recorded
    result = await cli(kafka, monkeypatch, "replay", "rebuild", "--to-topic", "rescored", "--reward-fn", NEW_FN,
                       *WORKER_TIMING, "--state", str(tmp_path / "state.json"))
    assert result.exit_code == 0, result.output
    rescored = {e.id: e for _, e in await read_topic(kafka, "rescored")}
    assert set(rescored) == set(live_ones)
    for event_id, new in rescored.items():
        old = live_ones[event_id]
        reward_ids = {r.event_id for r in old.data.rewards + new.data.rewards}
        assert without_rewards(new.data, reward_ids) == without_rewards(old.data, reward_ids)
        assert (new.time, new.rollout_id, new.attempt_id) == (old.time, old.rollout_id, old.attempt_id)
        if cases[new.rollout_id] in ("failed", "agent"):  # only finished attempts of a task are scored
            assert new.data == old.data
            continue
        assert new.data.reward == 0.2 and not new.data.reward_missing  # every answer is "89"
        assert [r.reward_fn for r in new.data.rewards if r.reward_fn] == [NEW_FN]
        # what agents posted is carried over; what the old function computed is not
        posted = [r for r in old.data.rewards if r.reward_fn is None]
        assert [r for r in new.data.rewards if r.reward_fn is None] == posted
    assert {live_ones[i].data.reward for i in live_ones if cases[live_ones[i].rollout_id] == "scored"} == {1.0}


# --- export ----------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
async def test_an_exported_dataset_round_trips(recorded, monkeypatch, tmp_path, suffix):
    kafka, live_ones, _ = recorded
    out = tmp_path / f"data.{suffix}"
    result = await cli(kafka, monkeypatch, "replay", "export", str(out), *WORKER_TIMING)
    assert result.exit_code == 0, result.output
    rows = pl.read_parquet(out).to_dicts() if suffix == "parquet" else [
        orjson.loads(line) for line in out.read_bytes().splitlines()]
    expected = {(t.id, i): (t, seq) for t in live_ones.values() for i, seq in enumerate(t.data.sequences)}
    assert sorted((r["trajectory_id"], r["sequence"]) for r in rows) == sorted(expected)
    for row in rows:
        trajectory, sequence = expected[row["trajectory_id"], row["sequence"]]
        assert row["token_ids"] == sequence.token_ids and row["mask"] == sequence.mask
        assert row["logprobs"] == sequence.logprobs and row["weight_versions"] == sequence.weight_versions
        assert row["reward"] == trajectory.data.reward and row["group_id"] == trajectory.data.group_id
        messages = orjson.loads(row["messages"]) if suffix == "parquet" else row["messages"]
        assert messages[-1]["role"] == "assistant" and messages[-1]["content"] in ("3", "45", "89", "78")
    assert not list(tmp_path.glob("*.parts")), "the parts were joined and removed"


async def test_selection_by_rollouts_and_versions_from_the_stored_topic(recorded, monkeypatch, tmp_path):
    kafka, live_ones, _ = recorded
    out = tmp_path / "picked.jsonl"
    result = await cli(kafka, monkeypatch, "replay", "export", str(out), "--format", "events", "--from",
                       "trajectories", "--rollouts", "r-ok-0,r-ok-1,r-ok-2,r-split-0,r-missing", "--versions", "1")
    assert result.exit_code == 0, result.output
    picked = [s.decode(line) for line in out.read_bytes().splitlines()]
    # r-ok-0 and r-ok-2 ran version 1; r-ok-1 and r-split-0 version 2; r-missing version 0
    assert sorted(e.rollout_id for e in picked) == ["r-ok-0", "r-ok-2"]
    assert all(encode(e) == encode(live_ones[e.id]) for e in picked)
    assert parse_versions("1,3-5") == {1, 3, 4, 5}


async def test_a_time_range_rebuilds_the_attempts_that_started_in_it_whole(kafka, monkeypatch, tmp_path):
    base = s.now_ms() - 60_000
    rollouts = [Rollout(f"r-t{i}", time=base + i * 1000) for i in range(10)]
    events = [e for rollout in rollouts for e in rollout.two_turns()]
    straddling = Rollout("r-long", time=base + 3500)  # starts before --since, ends after it
    events += straddling.two_turns()[:-1] + [straddling.finished(after_ms=1500)]
    producer = make_producer(kafka)
    await producer.start()
    try:  # record timestamps as event times, as they are when events are written live
        for event in events:
            await producer.send_and_wait(kafka.topics.name(event.topic), encode(event), key=event.key,
                                         timestamp_ms=event.time)
    finally:
        await producer.stop()
    since, until = base + 4010, base + 9000
    out = tmp_path / "range.jsonl"
    result = await cli(kafka, monkeypatch, "replay", "export", str(out), "--format", "events", *WORKER_TIMING,
                       "--since", str(since), "--until", str(until), "--lookback-s", "2")
    assert result.exit_code == 0, result.output
    got = {e.rollout_id: e for e in map(s.decode, out.read_bytes().splitlines())}
    # r-t4 … r-t8 started in the range and settled before its end; r-long started before it; r-t9 settles after
    assert sorted(got) == [f"r-t{i}" for i in range(4, 9)]
    whole = {e.rollout_id: e for e in assemble(events, Timing(settle_ms=200, reward_grace_ms=2000))}
    assert all(encode(event) == encode(whole[rollout_id]) for rollout_id, event in got.items())


async def test_an_attempt_ended_too_recently_is_left_open_and_the_summary_says_until_when(kafka, monkeypatch,
                                                                                           tmp_path):
    """A rebuild closes its range at the time it starts. An attempt that ended within its reward grace
    before then may still get its reward: like the live worker, the rebuild leaves it open, and says when
    it would be due (the regrade test once raced this, rebuilding right after writing live-timed events)."""
    done = Rollout("r-done", time=s.now_ms() - 60_000)
    waiting = live(Rollout("r-waiting"))
    await publish(kafka, [*done.two_turns(reward=None), *waiting.two_turns(reward=None)])
    out = tmp_path / "out.jsonl"
    result = await cli(kafka, monkeypatch, "replay", "export", str(out), "--format", "events", "--settle-s", "0.2",
                       "--reward-grace-s", "30")
    assert result.exit_code == 0, result.output
    assert [s.decode(line).rollout_id for line in out.read_bytes().splitlines()] == ["r-done"]
    assert "open: 1, open ended: 1" in result.output
    due = datetime.fromtimestamp((waiting.time + 30_000) / 1000, UTC).isoformat(timespec="milliseconds")
    assert f"reward grace runs until {due}" in result.output
    assert "no ending" not in result.output, "it has ended: widening --until is not the fix"


SESSION_TIMING = ["--settle-s", "2", "--reward-grace-s", "2", "--session-idle-s", "3", "--feedback-window-s", "2"]
"""a worker's session settings, short: a conversation ends 3 s after its last call, waits 2 s for feedback"""


def written_out_of_order(session_ids: list[str], start: int, **feedback: object) -> tuple[list[s.Event], list[s.Event]]:
    """One conversation of each session, ending at `start`: (its end and feedback about its second call, its
    calls). The calls are timed before the end, and the test writes them after it, as a gateway whose calls reach
    the log late would (within --settle-s)."""
    ahead: list[s.Event] = []
    calls: list[s.Event] = []
    for session_id in session_ids:
        session = Session(session_id, start)
        first, second = session.call(-400, [1, 2], [3]), session.call(-300, [1, 2, 3, 4], [5])
        ahead += [session.end(-200), session.feedback(-100, second, **feedback)]
        calls += [first, second]
    return ahead, calls


def differing_ids(live_ones: dict[str, bytes], rebuilt: dict[str, bytes]) -> dict[str, str]:
    """The trajectory ids on one side only, or with other bytes, and how they differ."""
    return {i: "live only" if i not in rebuilt else "rebuilt only" if i not in live_ones else "different"
            for i in set(live_ones) | set(rebuilt) if live_ones.get(i) != rebuilt.get(i)}


@pytest.mark.slow  # two worker starts, ~10 s of conversations' idle and feedback windows
@pytest.mark.timeout(600)
async def test_sessions_written_out_of_order_with_the_worker_killed_rebuild_to_the_live_output(kafka, monkeypatch,
                                                                                                tmp_path):
    """Conversations whose end and feedback reach the log before their calls (timed earlier); the streams worker
    killed -9 once it has read the second conversations' ends, and started again after their calls are written,
    so that it reads the three topics side by side from its last positions. Every end counts (no conversation
    of the client's ends "by idleness"), feedback within the window is in the first trajectory and later
    feedback in a revision; and a rebuild with the worker's settings makes the same trajectories and revisions,
    byte for byte."""
    session_ids = [f"chat-{i}" for i in range(16)]
    worker = StreamsWorker(kafka, tmp_path / "data", tmp_path / "worker.log", tuple(SESSION_TIMING)).start()
    producer = make_producer(kafka)
    await producer.start()
    publisher = Publisher(producer, kafka.topics)

    async def publish(events: list[s.Event]) -> None:  # (at once: all within --settle-s of their times)
        await publisher.publish_all(events)

    try:
        async with TopicWatch(kafka, "trajectories") as watch:

            def firsts(seen: list[s.Event]) -> list[s.TrajectoryEvent]:
                return list({e.id: e for e in seen if e.data.revision_of is None}.values())

            start = s.now_ms() - 3_000
            for round_, feedback in enumerate(({"thumbs": "up"}, {"thumbs": "down"})):
                # (the second conversation's calls come after the first's end + --settle-s, the calls it still takes)
                start = max(s.now_ms(), start + 3_000)
                ahead, calls = written_out_of_order(session_ids, start, **feedback)
                await publish(ahead)
                if round_ == 1:  # killed with the ends read and held, started again once the calls are written
                    # (the rewards topic also holds the first conversations' rewards, the policy's)
                    wait_for(lambda: worker.handled("rollouts") == 2 * len(session_ids)
                             and worker.handled("rewards") >= 3 * len(session_ids),
                             timeout=60, what="the worker to read the second conversations' ends and feedback")
                    worker.kill()
                await publish(calls)
                if round_ == 1:
                    worker.start()
                await watch.until(lambda seen, n=(round_ + 1) * len(session_ids): len(firsts(seen)) >= n,
                                  timeout=120, what=f"the trajectories of conversation {round_}")
            # after the second conversation settled: feedback about it (a revision), then a third conversation that
            # ends by idleness, without feedback
            later = [Session(session_id, s.now_ms()).feedback(0, score=0.5) for session_id in session_ids]
            third = [Session(session_id, s.now_ms() + 50).call(0, [7], [8]) for session_id in session_ids]
            await publish(later + third)
            await watch.until(lambda seen: len({e.id for e in seen}) >= 4 * len(session_ids), timeout=120,
                              what="a revision and a third trajectory of every session")
            # the revisions were built from the calls read back from the calls topic by offset: the settled
            # conversations kept their references, not the calls
            view = worker.analytics()
            assert view is not None and view["state"]["calls_read_back"] >= 2 * len(session_ids), view["state"]
            assert view["assembly"]["revisions_unavailable"] == 0, view["assembly"]
    finally:
        worker.stop()
        await producer.stop()
    live_ones: dict[str, bytes] = {}
    for event in watch.events:  # a trajectory published again after the kill is the same event
        assert live_ones.setdefault(event.id, encode(event)) == encode(event), event.id
    result = await cli(kafka, monkeypatch, "replay", "rebuild", "--to-topic", "rebuilt", *SESSION_TIMING,
                       "--state", str(tmp_path / "state.json"))
    assert result.exit_code == 0, result.output
    rebuilt = {event.id: encode(event) for _, event in await read_topic(kafka, "rebuilt")}
    differing = differing_ids(live_ones, rebuilt)
    assert not differing, f"{len(differing)} of {len(live_ones)} ids differ ({Counter(differing.values())}): {differing}"
    by_session: dict[str, list[s.TrajectoryEvent]] = {}
    for event in sorted({e.id: e for e in watch.events}.values(), key=lambda e: e.time):
        by_session.setdefault(event.data.session_id, []).append(event)
    assert sorted(by_session) == sorted(session_ids)
    for session_id, made in by_session.items():
        assert [(t.attempt_id, t.data.end_reason, t.data.reward, t.data.revision_of is not None) for t in made] == [
            ("segment-0", "ended by the client", 1.0, False), ("segment-1", "ended by the client", 0.0, False),
            ("segment-1", "ended by the client", 0.5, True), ("segment-2", "no call for 3 s", None, False)], session_id
        assert [len(t.data.turns) for t in made] == [2, 2, 2, 1] and made[2].data.revision_of == made[1].id


# --- resuming --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def spread(kafka_bootstrap):
    """Rollouts a second apart (so a rebuild settles them all along the range, not all at its end), and the
    trajectories the assembly's reference fold makes of them: (settings, expected trajectories by id)."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=4)
    assert (await ensure_topics(kafka)).ok
    base = s.now_ms() - 60_000
    events = []
    for i in range(24):
        rollout = Rollout(f"r-spread-{i}", time=base + i * 1000)
        events += rollout.two_turns(reward=i / 24)
    await publish(kafka, events)
    expected = assemble(events, Timing(settle_ms=200, reward_grace_ms=2000))
    assert len(expected) == 24
    return kafka, {e.id: e for e in expected}


async def test_a_rebuild_killed_mid_range_resumes_and_writes_each_trajectory_once(spread, tmp_path):
    kafka, expected = spread
    args = ["replay", "rebuild", "--to-topic", "resumed", *WORKER_TIMING, "--state", str(tmp_path / "state.json"),
            "--batch-size", "3", "--checkpoint-s", "0"]
    killed = await asyncio.to_thread(cli_process, kafka, *args, fault="replay.after_output:3")
    assert killed.returncode == -9, killed.stdout + killed.stderr  # killed after the output, before the state
    partial = await read_topic(kafka, "resumed")
    assert 0 < len(partial) < len(expected)
    finished = await asyncio.to_thread(cli_process, kafka, *args)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    written = [event for _, event in await read_topic(kafka, "resumed")]
    assert sorted(e.id for e in written) == sorted(expected)  # nothing skipped, nothing twice
    assert all(encode(e) == encode(expected[e.id]) for e in written)


async def test_a_rebuild_in_worker_processes_writes_the_same_and_resumes_in_one(spread, tmp_path):
    """`--jobs 2` folds two partitions in each of two processes: the same records in each output partition as
    one process makes, and a run killed mid-range resumes with `--jobs 1` (the state is the same)."""
    kafka, expected = spread
    common = [*WORKER_TIMING, "--batch-size", "3", "--checkpoint-s", "0"]
    one = await asyncio.to_thread(cli_process, kafka, "replay", "rebuild", "--to-topic", "one", *common, "--jobs", "1",
                                  "--state", str(tmp_path / "one.json"))
    assert one.returncode == 0, one.stdout + one.stderr
    args = ["replay", "rebuild", "--to-topic", "two", *common, "--state", str(tmp_path / "two.json")]
    killed = await asyncio.to_thread(cli_process, kafka, *args, "--jobs", "2", fault="replay.after_output:3")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    partial = await read_topic(kafka, "two")
    assert 0 < len(partial) < len(expected)
    finished = await asyncio.to_thread(cli_process, kafka, *args, "--jobs", "1")
    assert finished.returncode == 0, finished.stdout + finished.stderr

    made_by_one = by_partition(await read_topic(kafka, "one"))
    assert sorted(orjson.loads(v)["id"] for values in made_by_one.values() for v in values) == sorted(expected)
    assert by_partition(await read_topic(kafka, "two")) == made_by_one  # nothing skipped, nothing twice, in order

    # workers that read the archive start as new interpreters (polars does not survive a fork)
    archive = tmp_path / "archive"
    await Archiver(kafka, archive, tables=("rollouts", "calls", "rewards"), say=lambda _: None).cycle()
    archived = await asyncio.to_thread(cli_process, kafka, "replay", "rebuild", "--to-topic", "two-archived", *common,
                                       "--jobs", "2", "--source", "archive", "--archive", str(archive),
                                       "--state", str(tmp_path / "archived.json"))
    assert archived.returncode == 0, archived.stdout + archived.stderr
    assert by_partition(await read_topic(kafka, "two-archived")) == made_by_one

    def after_done(output: str) -> list[str]:
        lines = output.splitlines()
        return lines[next(i for i, line in enumerate(lines) if line.startswith("Done")) + 1:]

    assert after_done(archived.stdout) == after_done(one.stdout)  # the same counts and reasons
    counts = [orjson.loads((tmp_path / name).read_bytes())["counts"] for name in ("one.json", "archived.json",
                                                                                   "two.json")]
    assert counts[0]["trajectories"] == len(expected) and counts[1] == counts[0] and counts[2] == counts[0]


async def test_a_resumed_rebuild_knows_the_attempts_settled_before_from_their_files_not_its_position(
        kafka_bootstrap, tmp_path):
    """A rebuild keeps its settled rollouts in files beside the state (settled.py), its position only the open
    ones: resumed, a late event and a repeat for an attempt settled long before are still late and a duplicate
    (not a new attempt), as in a run not interrupted; killed with `--jobs 1`, resumed with `--jobs 2`."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=4)
    assert (await ensure_topics(kafka)).ok
    base = s.now_ms() - 60_000
    early = Rollout("r-early", time=base)
    events = early.two_turns(reward=0.5)
    for i in range(40):
        events += Rollout(f"r-later-{i}", time=base + (i + 1) * 1000).two_turns(reward=i / 40)
    early.time = base + 45_000
    events += [events[1], early.call([1, 2], [3], "3")]  # a repeat of its first call, then a late call
    await publish(kafka, events)
    common = [*WORKER_TIMING, "--batch-size", "3", "--checkpoint-s", "0"]
    one = await asyncio.to_thread(cli_process, kafka, "replay", "rebuild", "--to-topic", "whole", *common,
                                  "--jobs", "1", "--state", str(tmp_path / "whole.json"))
    assert one.returncode == 0, one.stdout + one.stderr
    whole = orjson.loads((tmp_path / "whole.json").read_bytes())["counts"]
    assert whole["late"] == 1 and whole["duplicates"] == 1 and whole["trajectories"] == 41
    assert not (tmp_path / "whole.json.settled").exists()  # a finished rebuild needs no files

    args = ["replay", "rebuild", "--to-topic", "resumed", *common, "--state", str(tmp_path / "state.json")]
    killed = await asyncio.to_thread(cli_process, kafka, *args, "--jobs", "1", fault="replay.after_state:4")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    state = orjson.loads((tmp_path / "state.json").read_bytes())
    held = {rollout for part in state["source"]["assembly"].values() for rollout in part["rollouts"]}
    lengths = state["source"]["settled"]  # (of the files: what the state counts)
    files = {p: [orjson.loads(line)[0] for line in path.read_bytes()[:lengths[p]].splitlines()]
             for path in (tmp_path / "state.json.settled").iterdir() if (p := path.stem.rpartition("-")[2]) in lengths}
    partition = next(p for p, rollouts in files.items() if "r-early" in rollouts)  # settled: in its file,
    assert "r-early" not in held  # not in the position; and its late call is not read yet
    assert state["source"]["next"]["calls"][partition] < state["ranges"]["calls"][partition][1] - 1
    finished = await asyncio.to_thread(cli_process, kafka, *args, "--jobs", "2")
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert orjson.loads((tmp_path / "state.json").read_bytes())["counts"] == whole
    assert by_partition(await read_topic(kafka, "resumed")) == by_partition(await read_topic(kafka, "whole"))


class Crash(BaseException):
    """What no error handling of the fold catches (a reward function's errors are deadlettered)."""


def crashing(sample: Sample) -> float:
    """A reward function that ends the process calling it: in a rebuild, its worker."""
    raise Crash("boom in the fold")


async def test_a_failing_rebuild_worker_ends_the_rebuild_with_its_error(spread, tmp_path):
    kafka, _ = spread
    # the workers fork from a fresh fork server, so the crash comes with the job, not patched in here
    job = Job("raw", "topic", "broken", rebuild=RebuildSpec(timing=Timing(settle_ms=200, reward_grace_ms=2000),
                                                            reward_fn="tests.logs.test_replay:crashing"))
    with pytest.raises(RuntimeError, match=r"rebuild worker of partitions \[\d, \d\] failed:(.|\n)*boom in the fold"):
        await replay(kafka, job, Options(tmp_path / "state.json", jobs=2))


COLLECTOR: list[bool] = []
"""whether the cycle collector ran on its own, as each reward function call found it"""


def noting_the_collector(sample: Sample) -> float:
    """A reward function that notes whether the collector runs on its own, and crashes at its third call."""
    COLLECTOR.append(gc.isenabled())
    if len(COLLECTOR) == 3:
        raise Crash("boom at the third")
    return 0.5


async def test_a_rebuild_folds_without_automatic_collections_and_turns_them_on_again_when_it_fails(spread, tmp_path):
    """A rebuild folds with the collector paused (its young passes were 8 % of the CPU); the collector runs
    again once it ends, even where it ends by an error, and for the code after it."""
    kafka, _ = spread
    job = Job("raw", "topic", "paused", rebuild=RebuildSpec(timing=Timing(settle_ms=200, reward_grace_ms=2000),
                                                            reward_fn="tests.logs.test_replay:noting_the_collector"))
    COLLECTOR.clear()
    assert gc.isenabled()
    with pytest.raises(Crash, match="boom at the third"):
        await replay(kafka, job, Options(tmp_path / "state.json", jobs=1))  # (in this process: its calls seen here)
    assert COLLECTOR == [False, False, False]
    assert gc.isenabled()


async def test_a_rebuild_that_fails_outside_its_fold_ends_it_at_once(spread, tmp_path):
    """An error in the loop that takes the rebuild's chunks (here the progress callback's) closes the fold there
    and then: the collector runs again as the error comes out, not once the event loop finalizes the fold."""
    kafka, _ = spread
    job = Job("raw", "topic", "interrupted", rebuild=RebuildSpec(timing=Timing(settle_ms=200, reward_grace_ms=2000)))

    def interrupting(progress: Progress) -> None:
        assert not gc.isenabled()  # (folding)
        raise Crash("boom in the progress")

    with pytest.raises(Crash, match="boom in the progress"):
        await replay(kafka, job, Options(tmp_path / "state.json", jobs=1, batch_size=3), on_progress=interrupting)
    assert gc.isenabled()


CALLS = {"made": 0}


def killing_once(sample: Sample) -> float:
    """A reward function that SIGKILLs the process calling it at its fourth call, once: in a rebuild, its worker
    (the first to get there creates the file $AGENTSTREAM_TEST_KILLED; none dies once it exists)."""
    CALLS["made"] += 1
    marker = os.environ.get("AGENTSTREAM_TEST_KILLED")
    if marker and CALLS["made"] == 4:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    return len(sample.answer) / 10


async def test_a_rebuild_whose_worker_is_killed_resumes_with_each_trajectory_written_once(spread, tmp_path,
                                                                                         monkeypatch):
    """Into a topic, the workers write their trajectories themselves and flush before sending a position: one
    killed mid-range (after some of its writes, whatever the state says) ends the rebuild, and the run again
    writes the rest, each trajectory once, each partition in the order one process writes it."""
    kafka, expected = spread
    spec = RebuildSpec(timing=Timing(settle_ms=200, reward_grace_ms=2000), reward_fn="tests.logs.test_replay:killing_once")
    await replay(kafka, Job("raw", "topic", "killed-one", rebuild=spec), Options(tmp_path / "one.json", jobs=1))
    job, options = Job("raw", "topic", "killed-two", rebuild=spec), Options(tmp_path / "two.json", jobs=2,
                                                                             batch_size=3, checkpoint_s=0)
    monkeypatch.setenv("AGENTSTREAM_TEST_KILLED", str(tmp_path / "killed"))
    with pytest.raises(ReplayError, match=r"rebuild worker of partitions \[\d, \d\] died"):
        await replay(kafka, job, options)
    partial = await read_topic(kafka, "killed-two")
    assert 0 < len(partial) < len(expected)
    summary = await replay(kafka, job, options)
    assert summary.resumed and summary.written == len(expected)
    made_by_one = by_partition(await read_topic(kafka, "killed-one"))
    assert sorted(orjson.loads(v)["id"] for values in made_by_one.values() for v in values) == sorted(expected)
    assert by_partition(await read_topic(kafka, "killed-two")) == made_by_one  # nothing skipped, nothing twice


def from_environment(sample: Sample) -> float:
    """A reward function that reads its setting from the environment, as the SWE grader does."""
    return float(os.environ["AGENTSTREAM_TEST_REWARD"])


async def test_rebuild_workers_see_the_environment_of_the_rebuild_not_of_their_fork_server(spread, tmp_path,
                                                                                           monkeypatch):
    kafka, _ = spread
    spec = RebuildSpec(timing=Timing(settle_ms=200, reward_grace_ms=2000), reward_fn="tests.logs.test_replay:from_environment")
    for value in ("0.25", "0.75"):  # the second rebuild's workers fork from the server the first one started
        monkeypatch.setenv("AGENTSTREAM_TEST_REWARD", value)
        await replay(kafka, Job("raw", "topic", f"env-{value}", rebuild=spec), Options(tmp_path / f"{value}.json", jobs=2))
        rewards = {t.data.reward for _, t in await read_topic(kafka, f"env-{value}") if t.data.status == "finished"}
        assert rewards == {float(value)}


@pytest.mark.parametrize("fmt,crash", [("parquet", "after_output:2"), ("chat", "after_output:3"),
                                       ("events", "after_state:3")])
async def test_an_export_killed_mid_range_resumes_and_covers_it_exactly_once(spread, tmp_path, fmt, crash):
    kafka, expected = spread
    out = tmp_path / f"out.{fmt}"
    args = ["replay", "export", str(out), "--format", fmt, *WORKER_TIMING, "--batch-size", "3", "--checkpoint-s", "0"]
    killed = await asyncio.to_thread(cli_process, kafka, *args, fault=f"replay.{crash}")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    if fmt == "parquet":
        assert not out.exists() and list(out.with_name("out.parquet.parts").glob("part-*.parquet"))
    else:
        assert 0 < len(out.read_bytes().splitlines()) < len(expected)
    finished = await asyncio.to_thread(cli_process, kafka, *args)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    if fmt == "parquet":
        ids = pl.read_parquet(out)["trajectory_id"].to_list()
    elif fmt == "chat":
        ids = [orjson.loads(line)["trajectory_id"] for line in out.read_bytes().splitlines()]
    else:
        ids = [s.decode(line).id for line in out.read_bytes().splitlines()]
    assert sorted(ids) == sorted(expected)  # one sequence each: one row each


# --- training --------------------------------------------------------------------------------


async def test_replay_train_feeds_the_selected_trajectories_to_the_offline_trainer(spread, tiny_model_dirs, tmp_path):
    kafka, expected = spread
    picked = [f"r-spread-{i}" for i in (3, 5, 8, 13)]
    args = ["replay", "train", "--from", "raw", "--rollouts", ",".join(picked), *WORKER_TIMING,
            "--stage", str(tmp_path / "stage.jsonl"), "--",
            "--base-model", str(tiny_model_dirs[0]), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--group-size", "4", "--groups-per-batch", "1", "--lr", "1e-3"]
    result = await asyncio.to_thread(cli_process, kafka, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    (weights,) = [s.decode(record.value) async for batch in scan(kafka, kafka.topics.weights) for record in batch]
    assert sorted(weights.data.lineage) == sorted(e.id for e in expected.values() if e.rollout_id in picked)
    assert weights.data.version == 1 and weights.data.metrics["samples"] == 4


# --- errors ----------------------------------------------------------------------------------


async def test_errors_name_the_fix(recorded, monkeypatch, tmp_path):
    kafka, _, _ = recorded
    cases = [
        (["replay", "rebuild", "--to-topic", "trajectories"], "--to-topic trajectories-rebuilt"),
        (["replay", "export", str(tmp_path / "x.jsonl"), "--from-offsets", "0:1"], "bound it by time"),
        (["replay", "export", str(tmp_path / "x.jsonl"), "--from", "trajectories", "--reward-fn", NEW_FN],
         "use --from raw"),
        (["replay", "export", str(tmp_path / "x.jsonl"), "--reward-fn", "nowhere:fn"], "cannot import"),
        (["replay", "rebuild", "--to-topic", "calls-copy", "--prefix", "no-such."], "check the topic prefix"),
    ]
    for args, fix in cases:
        result = await cli(kafka, monkeypatch, *args)
        assert result.exit_code == 1 and fix in result.output, (args, result.output)
    (tmp_path / "taken.jsonl").write_text("mine\n")
    taken = await cli(kafka, monkeypatch, "replay", "export", str(tmp_path / "taken.jsonl"))
    assert taken.exit_code == 1 and "--restart" in taken.output
    first = await cli(kafka, monkeypatch, "replay", "export", str(tmp_path / "a.jsonl"), "--rollouts", "r-ok-0")
    assert first.exit_code == 0, first.output
    other = await cli(kafka, monkeypatch, "replay", "export", str(tmp_path / "a.jsonl"), "--rollouts", "r-ok-1",
                      "--state", str(tmp_path / "a.jsonl.replay-state.json"))
    assert other.exit_code == 1 and "differs in: rollouts" in other.output, other.output


# --- top -------------------------------------------------------------------------------------


def metrics(start: int, partition: int, version: int, **values: float) -> s.MetricsEvent:
    return s.MetricsEvent(source="streams", data=s.Metrics(
        window_s=10, window_start=start, group={"model": "tiny", "weight_version": str(version),
                                                "partition": str(partition)}, values=values))


async def test_top_once_merges_partitions_and_keeps_the_latest_of_each_window(kafka, monkeypatch):
    start = s.now_ms() // 10_000 * 10_000
    events = [
        metrics(start, 0, 1, calls=1, trajectories=0),  # superseded by the next event of its window and group
        metrics(start, 0, 1, calls=4, errors=1, tokens_out=20, trajectories=2, rewarded=2, reward_sum=0.5,
                latency_b10=4),
        metrics(start, 1, 1, calls=2, tokens_out=10, trajectories=1, rewarded=1, reward_sum=1.0, latency_b10=2),
        metrics(start, 1, 2, calls=4, trajectories=2, rewarded=2, reward_sum=2.0, latency_b20=4),
        metrics(start - 10_000, 0, 1, calls=10),
        s.PoolUpdateEvent(source="gateway", data=s.PoolUpdate(
            model="tiny", version=2, server="http://vllm-a", status="ok", pause_ms=123.4, load_ms=100.0,
            held_ms=130.0, applied_by="gw-1")),
    ]
    await publish(kafka, events)
    view = TopView()
    async for batch in scan(kafka, kafka.topics.metrics):
        for record in batch:
            view.add(record.value)
    newest, older = view.by_window(10)
    assert (newest["calls"], newest["calls_per_s"], newest["errors"], newest["trajectories"]) == (10, 1.0, 1, 5)
    assert newest["reward_mean"] == pytest.approx(3.5 / 5) and older["calls"] == 10
    by_version = {row["weight_version"]: row for row in view.by_version(10)}
    assert by_version["1"]["reward_mean"] == pytest.approx(0.5) and by_version["1"]["calls"] == 16
    assert by_version["2"]["reward_mean"] == 1.0 and by_version["1"]["latency_p50_ms"] == pytest.approx(4.657, abs=1e-3)

    result = await cli(kafka, monkeypatch, "top", "--once", "--history", "1h")
    assert result.exit_code == 0, result.output
    assert "123.4" in result.output and "http://vllm-a" in result.output  # the pool's pause
    assert "0.700" in result.output and "1.000" in result.output  # reward means: the window, version 2
    assert "1 (10.0 %)" in result.output  # 1 error in 10 calls


async def test_readers_keep_one_copy_of_a_trajectory_published_twice(kafka, monkeypatch, tmp_path):
    """A streams worker killed between publishing a trajectory and recording it settled publishes it
    again, with the same id: replay, export, SQL and top each keep one copy."""
    rollout = Rollout("r-twice-published")
    (trajectory,) = assemble(rollout.two_turns(), Timing(settle_ms=0))
    other = assemble(Rollout("r-once").two_turns(), Timing(settle_ms=0))[0]
    pool = s.PoolUpdateEvent(source="gateway", data=s.PoolUpdate(
        model="tiny", version=2, server="http://vllm-a", status="ok", pause_ms=1.0, load_ms=1.0, held_ms=1.0,
        applied_by="gw-1"))
    await publish(kafka, [trajectory, other, trajectory, pool, pool])

    out = tmp_path / "once.jsonl"
    result = await cli(kafka, monkeypatch, "replay", "export", str(out), "--format", "events", "--from", "trajectories")
    assert result.exit_code == 0, result.output
    assert sorted(s.decode(line).rollout_id for line in out.read_bytes().splitlines()) == ["r-once", "r-twice-published"]

    from agentstream.logs.query import run_sql

    counted = await run_sql(kafka, "SELECT rollout_id, COUNT(*) AS n FROM trajectories GROUP BY rollout_id")
    assert dict(counted.rows()) == {"r-once": 1, "r-twice-published": 1}

    view = TopView()
    async for batch in scan(kafka, kafka.topics.pool):
        for record in batch:
            view.add(record.value)
    assert len(view.pool) == 1


def test_a_rebuild_folds_in_one_process_by_default_where_the_range_left_is_small(monkeypatch):
    """The fork server's start costs about what a second core gains at `SMALL_RANGE` records (docs/queries.md)."""
    from agentstream.logs.replay import run
    from agentstream.logs.replay.state import ReplayState

    monkeypatch.setattr(run, "default_jobs", lambda: 2)
    kafka = KafkaSettings(bootstrap_servers="localhost:1", topic_prefix="t.")
    half, options = run.SMALL_RANGE // 2, Options(Path("unused"))
    state = ReplayState({}, {t: {0: (10, 10 + half), 1: (0, half)} for t in ("rollouts", "calls", "rewards")})
    assert run._jobs(kafka, options, state) == 2
    state.source = {"next": {t: {"0": 10 + half, "1": half // 2} for t in ("rollouts", "calls", "rewards")}}
    assert run._left(state) == 3 * (half - half // 2)
    assert run._jobs(kafka, options, state) == 1
    assert run._jobs(kafka, Options(Path("unused"), jobs=2), state) == 2

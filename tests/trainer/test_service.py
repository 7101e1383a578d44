"""The trainer process against a real broker: versions, checkpoints, crash recovery, staleness, offline mode."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agentstream.schemas as s
from agentstream.schemas.kafka import make_consumer
from agentstream.trainer.checkpoint import CheckpointStore
from agentstream.trainer.service import Trainer
from agentstream.trainer.settings import TrainerSettings
from tests.support import faults
from tests.support.trainer import arithmetic_groups, committed_and_end, publish, read_all, trainer_settings, write_jsonl
from tests.support.wait import wait_for_async

REPO = Path(__file__).parents[2]


async def test_a_version_is_a_checkpoint_and_a_weights_event(kafka, tiny_model_dirs, tmp_path):
    base = tiny_model_dirs[0]
    first = arithmetic_groups(base, groups=2, group_size=4, prefix="first")
    await publish(kafka, first)
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, max_versions=1)
    (event,) = await Trainer(settings).run()

    w = event.data
    folder = tmp_path.joinpath("ckpt", "v000001").resolve()
    assert (w.model, w.version, w.base_version, w.step, w.uri) == ("tiny", 1, 0, 1, str(folder))
    assert sorted(w.lineage) == sorted(e.id for e in first)
    for metric in ("loss", "reward_mean", "kl", "clipfrac", "grad_norm", "samples", "stale_dropped", "staleness_max"):
        assert metric in w.metrics, metric
    assert w.metrics["samples"] == 8 and w.metrics["reward_mean"] == pytest.approx(0.5)
    # the event on the topic is the one the checkpoint keeps, and it is there once
    on_topic = [e for e in await read_all(kafka, kafka.topics.weights)]
    assert on_topic == [event]
    assert (folder / "training_state" / "weights_event.json").read_bytes() == s.encode(event)
    # a folder transformers (and vLLM) load: safetensors, config, tokenizer; weights moved
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    trained = AutoModelForCausalLM.from_pretrained(folder)
    original = AutoModelForCausalLM.from_pretrained(base)
    assert AutoTokenizer.from_pretrained(folder).encode("hi") == [ord("h"), ord("i")]
    assert not torch.equal(trained.model.embed_tokens.weight, original.model.embed_tokens.weight)
    # offsets committed after the checkpoint: every record is accounted for
    committed, ends = await committed_and_end(kafka, settings.consumer_group)
    assert {p: committed[p] for p in ends if ends[p]} == {p: e for p, e in ends.items() if e}

    # a restart continues from the checkpoint, optimizer included; a re-delivered trajectory already
    # trained on is dropped; an undecodable record is deadlettered and does not stop the trainer
    second = arithmetic_groups(base, groups=2, group_size=4, prefix="second")
    validation = arithmetic_groups(base, groups=1, group_size=1, prefix="val")[0]
    validation.data.split = "validation"
    await publish(kafka, [first[3], validation, *second], raw=[b"{not json"])
    (event2,) = await Trainer(settings).run()
    assert (event2.data.version, event2.data.base_version, event2.data.step) == (2, 1, 2)
    assert sorted(event2.data.lineage) == sorted(e.id for e in second)
    optimizer = torch.load(tmp_path / "ckpt" / "v000002" / "training_state" / "optimizer.pt", weights_only=True)
    assert {int(state["step"]) for state in optimizer["state"].values()} == {2}
    deadletters = await read_all(kafka, kafka.topics.deadletter)
    assert [d.data.value for d in deadletters] == ["{not json"]
    assert "not a trajectory event" in deadletters[0].data.reason


def trainer_command(settings: TrainerSettings, *flags: str) -> list[str]:
    return [sys.executable, "-m", "agentstream.trainer",
            "--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
            "--base-model", str(settings.base_model), "--checkpoint-dir", str(settings.checkpoint_dir),
            "--consumer-group", settings.consumer_group, "--group-size", "4", "--groups-per-batch", "2",
            "--lr", "1e-3", "--torch-threads", "1", "--max-staleness", "100", "--log-level", "debug", *flags]


def run_trainer_process(settings: TrainerSettings, log: Path, *flags: str, fault: str | None = None) -> int:
    """The trainer as a real process, SIGKILLed at `fault` if given (tests/support/faults.py)."""
    command = trainer_command(settings, *flags)
    if fault:
        command = faults.command(fault, "agentstream.trainer", *command[3:])
    with log.open("ab") as out:
        return subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                              timeout=180, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode


async def test_killed_between_checkpoint_and_commit_trains_every_sample_exactly_once(kafka, tiny_model_dirs,
                                                                                       tmp_path):
    base = tiny_model_dirs[0]
    events = arithmetic_groups(base, groups=12, group_size=4)  # 6 batches
    await publish(kafka, events + events[::7])  # and re-deliveries of some, same ids
    settings = trainer_settings(kafka, tmp_path / "ckpt", base)
    log = tmp_path / "trainer.log"

    # 1: SIGKILLed after version 1 is checkpointed and announced, before its offsets are committed
    assert run_trainer_process(settings, log, fault="trainer.after_publish") == -9, log.read_text()
    committed, _ = await committed_and_end(kafka, settings.consumer_group)
    assert set(committed.values()) == {None}, "the crash came before any commit"
    # 2: SIGKILLed after version 2 is checkpointed, before it is announced
    assert run_trainer_process(settings, log, fault="trainer.after_checkpoint") == -9, log.read_text()
    assert [e.data.version for e in await read_all(kafka, kafka.topics.weights)] == [1]
    assert CheckpointStore(settings.checkpoint_dir).versions() == [1, 2]
    # 3: announces version 2, trains the rest, and stops cleanly on SIGTERM
    with log.open("ab") as out:
        process = subprocess.Popen(trainer_command(settings), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        async def six_versions():
            return len(await read_all(kafka, kafka.topics.weights)) >= 6
        await wait_for_async(six_versions, timeout=120, interval=0.5, what="6 weight versions")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
    assert "checkpointed but not announced" in log.read_text()

    published = [e for e in await read_all(kafka, kafka.topics.weights)]
    assert [e.data.version for e in published] == [1, 2, 3, 4, 5, 6]
    assert [e.data.base_version for e in published] == [0, 1, 2, 3, 4, 5]
    trained = [trajectory_id for e in published for trajectory_id in e.data.lineage]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == {e.id for e in events}, "a sample was skipped"
    # the checkpoints chain: each version's folder holds the event that announced it
    store = CheckpointStore(settings.checkpoint_dir)
    for version in store.versions():
        assert store.load(version).event == published[version - 1]


@pytest.mark.parametrize("policy", ["drop", "downweight"])
async def test_stale_samples_are_dropped_or_downweighted_and_counted(kafka, tiny_model_dirs, tmp_path, policy):
    base = tiny_model_dirs[0]
    fresh = arithmetic_groups(base, groups=2, group_size=4, version=5, prefix="fresh")
    stale = arithmetic_groups(base, groups=2, group_size=4, version=1, prefix="stale")  # 4 versions behind
    source = write_jsonl(tmp_path / "trajectories.jsonl", stale[:4] + fresh + stale[4:])
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, offline_file=source, initial_version=5,
                                max_staleness=3, stale_policy=policy, stale_decay=0.5)
    published = await Trainer(settings).run()
    metrics = published[0].data.metrics
    if policy == "drop":
        assert [sorted(e.data.lineage) for e in published] == [sorted(e.id for e in fresh)]
        assert metrics["stale_dropped"] == 8 and metrics["staleness_max"] == 0
        assert metrics["stale_v1_dropped"] == 8 and "stale_v5_dropped" not in metrics  # by the version that served it
    else:
        trained = [i for e in published for i in e.data.lineage]
        assert sorted(trained) == sorted(e.id for e in fresh + stale)
        assert sum(e.data.metrics["stale_downweighted"] for e in published) == 8
        assert max(e.data.metrics["staleness_max"] for e in published) >= 4
        assert sum(e.data.metrics.get("stale_dropped", 0) for e in published) == 0


@pytest.mark.parametrize("keep", [False, True])
async def test_samples_without_logprobs_are_dropped_and_counted_unless_kept(kafka, tiny_model_dirs, tmp_path, keep):
    base = tiny_model_dirs[0]
    logged = arithmetic_groups(base, groups=2, group_size=4, prefix="logged")
    unlogged = [event.model_copy(update={"data": event.data.model_copy(update={
                    "turns": [turn.model_copy(update={"logprobs_missing": True}) for turn in event.data.turns]})})
                for event in arithmetic_groups(base, groups=2, group_size=4, prefix="unlogged")]
    source = write_jsonl(tmp_path / "trajectories.jsonl", unlogged[:4] + logged + unlogged[4:])
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, offline_file=source, train_without_logprobs=keep)
    published = await Trainer(settings).run()
    trained = sorted(i for e in published for i in e.data.lineage)
    dropped = sum(e.data.metrics.get("logprobs_missing_dropped", 0) for e in published)
    if keep:
        assert trained == sorted(e.id for e in logged + unlogged) and dropped == 0
    else:
        assert trained == sorted(e.id for e in logged) and dropped == 8
    with pytest.raises(ValueError, match="--train-without-logprobs and --rollout-is"):
        trainer_settings(kafka, tmp_path / "ckpt", base, train_without_logprobs=True, rollout_is="token")


async def test_offline_mode_trains_a_recorded_topic_range_and_resumes_after_it(kafka, tiny_model_dirs, tmp_path):
    base = tiny_model_dirs[0]
    recorded = arithmetic_groups(base, groups=2, group_size=4, prefix="recorded")
    later = arithmetic_groups(base, groups=2, group_size=4, prefix="later")
    await publish(kafka, recorded)
    _, ends = await committed_and_end(kafka, "nobody")
    await publish(kafka, later)
    until = ",".join(f"{p}:{o}" for p, o in ends.items())

    settings = trainer_settings(kafka, tmp_path / "ckpt", base, offline_topic=kafka.topics.trajectories,
                                offline_to=until)
    published = await Trainer(settings).run()  # ends by itself at the end of the range
    assert [sorted(e.data.lineage) for e in published] == [sorted(e.id for e in recorded)]
    # the same checkpoint folder, the range's end open: resumes after what it trained
    settings = settings.model_copy(update={"offline_to": ""})
    published = await Trainer(settings).run()
    assert [(e.data.version, sorted(e.data.lineage)) for e in published] == [(2, sorted(e.id for e in later))]
    committed, _ = await committed_and_end(kafka, settings.consumer_group)
    assert set(committed.values()) == {None}, "offline mode leaves the live group's offsets alone"


async def test_offline_file_flushes_partial_groups_at_its_end(kafka, tiny_model_dirs, tmp_path):
    base = tiny_model_dirs[0]
    events = arithmetic_groups(base, groups=3, group_size=4)
    partial, lonely = events[8:11], events[11]
    lonely.data.group_id = "alone"
    source = write_jsonl(tmp_path / "t.jsonl", events[:8] + [events[0]] + [partial[0], lonely, *partial[1:]])
    published = await Trainer(trainer_settings(kafka, tmp_path / "ckpt", base, offline_file=source)).run()
    assert [sorted(e.data.lineage) for e in published] == [sorted(e.id for e in events[:8]),
                                                           sorted(e.id for e in partial)]
    assert published[0].data.metrics.get("duplicate_dropped") == 1


async def test_a_rebalance_hands_buffered_samples_back_and_loses_none(kafka, tiny_model_dirs, tmp_path):
    base = tiny_model_dirs[0]
    first, second = (arithmetic_groups(base, groups=1, group_size=4, prefix=p) for p in ("first", "second"))
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, groups_per_batch=1)
    trainer = Trainer(settings)
    running = asyncio.create_task(trainer.run())
    try:
        await publish(kafka, first + second[:3])
        await wait_for_async(lambda: len(trainer.published) == 1 and len(trainer.batcher) == 3, timeout=60,
                             what="version 1 trained and 3 samples buffered")
        # a second member joins the group: the trainer gives up some partitions, and their buffered samples
        intruder = make_consumer(kafka, kafka.topics.trajectories, group_id=settings.consumer_group)
        await intruder.start()
        try:
            async def intruder_assigned():
                await intruder.getmany(timeout_ms=200)
                return intruder.assignment()
            await wait_for_async(intruder_assigned, timeout=60, what="the intruder's assignment")
            assert len(trainer.batcher) < 3
        finally:
            await intruder.stop()  # leaves without committing anything
        # the partitions come back: the trainer reads from its watermarks again
        await wait_for_async(lambda: len(trainer.batcher) == 3, timeout=60, what="the 3 samples buffered again")
        await publish(kafka, second[3:])
        await wait_for_async(lambda: len(trainer.published) == 2, timeout=60, what="version 2")
    finally:
        trainer.stop()
        await asyncio.wait_for(running, 60)
    assert sorted(trainer.published[1].data.lineage) == sorted(e.id for e in second)


async def test_reward_penalties_shape_what_the_trainer_learns_and_leave_the_log_and_eval_alone(
        kafka, tiny_model_dirs, tmp_path):
    """Shaping is for training only: an attempt that hit the step limit or overflowed the context is trained
    on with a penalty, while the trajectories in the log, and so eval's pass rates, keep the grader's reward."""
    from agentstream.eval import score

    base = tiny_model_dirs[0]
    events = arithmetic_groups(base, groups=2, group_size=4, prefix="shaped")  # rewards 1, 0, 1, 0 per group
    ends = ["step_limit", "context_overflow", "submitted", None]
    for event in events:
        event.data.end_reason = ends[event.data.sample_index]
    await publish(kafka, events)
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, offline_topic=kafka.topics.trajectories,
                                reward_penalties={"context_overflow": -1.0, "step_limit": -0.5})
    [version] = await Trainer(settings).run()
    metrics = version.data.metrics
    assert metrics["reward_shaped_samples"] == 4
    assert metrics["reward_mean"] == pytest.approx((0.5 - 1.0 + 1.0 + 0.0) / 4), "trained on the shaped rewards"
    assert (metrics["reward_min"], metrics["reward_max"]) == (-1.0, 1.0)

    logged = [e for e in await read_all(kafka, kafka.topics.trajectories)]
    assert {e.id: e.data.reward for e in logged} == {e.id: e.data.reward for e in events}, "the log is untouched"
    measured = score({e.rollout_id: e for e in logged}, {e.rollout_id: e.data.task_id for e in logged}, k=4,
                     threshold=1.0)
    assert measured["pass_at_1"] == 0.5 and measured["solved_tasks"] == 2, "eval reads the grader's reward as is"
    assert sorted(r for rewards in measured["per_task"].values() for r in rewards) == [0.0] * 4 + [1.0] * 4

"""Exactly-once accounting and atomic checkpoints, without a broker."""

from __future__ import annotations

import multiprocessing

import pytest

import agentstream.schemas as s
from agentstream.trainer.checkpoint import CheckpointLocked, CheckpointStore, TrainingState
from agentstream.trainer.errors import TrainerError
from agentstream.trainer.ledger import Ledger, LedgerState
from agentstream.trainer.sources import parse_offsets


def test_the_watermark_waits_for_the_oldest_held_record():
    ledger = Ledger("src")
    for offset in range(5):
        ledger.hold(0, offset, f"id{offset}")
    ledger.settle(0, 1, "id1"), ledger.settle(0, 3, "id3")
    assert ledger.watermarks() == {0: 0}
    ledger.settle(0, 0, "id0")
    assert ledger.watermarks() == {0: 2}
    ledger.settle(0, 2, "id2"), ledger.settle(0, 4, "id4")
    assert ledger.watermarks() == {0: 5}


def test_a_resumed_ledger_skips_what_was_settled_and_reads_what_was_held():
    ledger = Ledger("src", window=10)
    for offset in range(6):
        ledger.hold(1, offset, f"id{offset}")
    for offset in (1, 2, 4):  # trained in the checkpoint's version
        ledger.settle(1, offset, f"id{offset}")
    state = LedgerState.model_validate_json(ledger.snapshot().model_dump_json())  # as the checkpoint stores it

    resumed = Ledger("src", state, window=10)
    assert resumed.watermarks() == {1: 0}
    redelivered = [o for o in range(6) if not resumed.settled_before(1, o)]
    assert redelivered == [0, 3, 5]
    assert resumed.is_duplicate("id2") and not resumed.is_duplicate("id3")
    assert Ledger("other source", state).watermarks() == {}, "positions belong to their source"


def test_a_duplicate_does_not_hide_its_held_original_after_a_restart():
    ledger = Ledger("src")
    ledger.hold(0, 0, "a")
    assert ledger.is_duplicate("a")
    ledger.settle(0, 1, None)  # the re-delivery of "a", dropped
    resumed = Ledger("src", ledger.snapshot())
    assert not resumed.settled_before(0, 0) and not resumed.is_duplicate("a")
    assert resumed.settled_before(0, 1)


def test_released_partitions_are_read_again_from_their_watermark():
    ledger = Ledger("src")
    for offset in range(4):
        ledger.hold(2, offset, f"id{offset}")
    ledger.settle(2, 0, "id0"), ledger.settle(2, 2, "id2")
    ledger.release({2})
    assert ledger.watermarks() == {2: 1} and not ledger.is_duplicate("id1")
    assert [o for o in range(4) if not ledger.settled_before(2, o)] == [1, 3]


def test_offset_specs():
    assert parse_offsets("", [0, 1]) == {}
    assert parse_offsets("7", [0, 1]) == {0: 7, 1: 7}
    assert parse_offsets("0:3,1:9", [0, 1]) == {0: 3, 1: 9}
    with pytest.raises(TrainerError, match="no partition 5"):
        parse_offsets("5:1", [0, 1])


def state(version: int) -> tuple[TrainingState, s.WeightsEvent]:
    event = s.WeightsEvent(source="t", data=s.Weights(model="m", version=version, uri="/x", step=version))
    return TrainingState(model="m", version=version, base_version=version - 1, step=version, lineage=[],
                         ledger=LedgerState()), event


def test_a_checkpoint_appears_whole_or_not_at_all(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt")
    store.lock()
    carry = tmp_path / "base"
    carry.mkdir()
    (carry / "tokenizer.json").write_text("{}")
    (carry / "model.safetensors").write_text("old weights, not carried")

    def dies_midway(folder):
        (folder / "model.safetensors").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.write(*state(1), save_model=dies_midway, carry_from=carry, optimizer_state=None)
    assert store.versions() == [] and store.latest() is None
    store.unlock()
    store.lock()  # the next trainer clears the half-written folder
    assert not list(store.root.glob(".tmp-*"))

    written = store.write(*state(1), save_model=lambda f: (f / "model.safetensors").write_text("new"),
                          carry_from=carry, optimizer_state=None)
    assert (written.path / "model.safetensors").read_text() == "new"
    assert (written.path / "tokenizer.json").is_file()
    assert store.latest().event == written.event
    for version in (2, 3, 4):
        store.write(*state(version), save_model=lambda f: None, carry_from=carry, optimizer_state=None)
    assert store.prune(keep=2) == [1, 2] and store.versions() == [3, 4]
    store.unlock()


def _try_lock(root, result):
    try:
        CheckpointStore(root).lock()
        result.put("locked")
    except CheckpointLocked as exc:
        result.put(str(exc))


def test_one_trainer_per_checkpoint_folder(tmp_path):
    store = CheckpointStore(tmp_path)
    store.lock()
    result = multiprocessing.get_context("spawn").Queue()
    other = multiprocessing.get_context("spawn").Process(target=_try_lock, args=(tmp_path, result))
    other.start()
    other.join(60)
    assert "another trainer is writing" in result.get(timeout=5)
    store.unlock()

"""The trainer's memory estimate and what it decides: start as asked, pick a smaller micro-batch or gradient
checkpointing, or refuse with one line (exit 2); and a trainer killed by the kernel reported as such."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentstream.models.tiny_model import build_tiny_model
from agentstream.trainer.memory import (
    GIB,
    RUNTIME_BYTES,
    Available,
    DoesNotFit,
    Shape,
    available_memory,
    cgroup_headroom,
    counted_parameters,
    estimate,
    fit,
)
from agentstream.trainer.settings import TrainerSettings

# Qwen2.5-Coder-0.5B's shape (its config.json), the model of issue 47
QWEN = Shape(parameters=494_032_768, layers=24, hidden=896, intermediate=4864, kv=128, vocab=151_936)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_parameters_from_the_headers_match_the_model_and_the_config(tiny):
    from transformers import AutoModelForCausalLM

    from agentstream.trainer.grpo import with_lora

    shape = Shape.of(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    config = json.loads((tiny / "config.json").read_text())
    assert counted_parameters(shape.hidden, shape.intermediate, shape.kv, config["hidden_size"], shape.layers,
                              shape.vocab, config.get("tie_word_embeddings", False), biased=True) == shape.parameters
    adapted = with_lora(model, TrainerSettings(lora_rank=8))
    assert shape.lora_parameters(8) == sum(p.numel() for p in adapted.parameters() if p.requires_grad)


def test_the_terms_of_full_fine_tuning_and_lora():
    settings = TrainerSettings(max_seq_len=1000, micro_batch_size=2)
    full = estimate(QWEN, settings, bfloat16=False)
    assert full.weights == 4 * QWEN.parameters
    assert (full.gradients, full.optimizer) == (4 * QWEN.parameters, 8 * QWEN.parameters)
    per_layer = 4 * (10 * 896 + 4 * 128 + 4 * 4864)
    assert full.activations == 2 * 1000 * 24 * per_layer
    assert full.logits == 2 * 1000 * 151_936 * 4 * 5
    assert full.total == full.weights + full.gradients + full.optimizer + full.activations + full.logits \
        + RUNTIME_BYTES
    lora = estimate(QWEN, settings.model_copy(update={"lora_rank": 32}), bfloat16=False)
    assert lora.gradients == 4 * QWEN.lora_parameters(32) < full.gradients / 10
    assert lora.activations == full.activations
    bf16 = estimate(QWEN, settings, bfloat16=True)
    assert bf16.weights == 6 * QWEN.parameters and bf16.activations == full.activations // 2


def test_checkpointing_keeps_each_layers_input_and_one_layer():
    settings = TrainerSettings(max_seq_len=2048, micro_batch_size=1)
    plain = estimate(QWEN, settings, bfloat16=False)
    saved = estimate(QWEN, settings.model_copy(update={"gradient_checkpointing": True}), bfloat16=False)
    assert saved.activations == 2048 * (24 * 4 * 896 + 4 * (10 * 896 + 4 * 128 + 4 * 4864))
    assert saved.activations < plain.activations / 8


def test_the_micro_batch_is_the_mini_batch_or_the_batch_when_not_given():
    by_batch = estimate(QWEN, TrainerSettings(group_size=4, groups_per_batch=2), bfloat16=False)
    by_mini = estimate(QWEN, TrainerSettings(group_size=4, groups_per_batch=2, mini_batch_size=2), bfloat16=False)
    by_tokens = estimate(QWEN, TrainerSettings(micro_batch_tokens=4096, max_seq_len=2048), bfloat16=False)
    one = estimate(QWEN, TrainerSettings(micro_batch_size=1), bfloat16=False)
    assert by_batch.activations == 8 * one.activations
    assert by_mini.activations == by_tokens.activations == 2 * one.activations


def available(gib: float) -> Available:
    return Available(int(gib * GIB), "MemAvailable")


def test_settings_that_fit_are_kept():
    settings = TrainerSettings(micro_batch_size=8)
    fitted = fit(settings, QWEN, available(200), bfloat16=False)
    assert fitted.settings == settings and fitted.chosen == {}
    assert "peak estimate" in fitted.describe() and "available 200.0 GiB (MemAvailable)" in fitted.describe()


def test_a_smaller_micro_batch_first_then_checkpointing():
    settings = TrainerSettings(group_size=8, groups_per_batch=1, max_seq_len=2048)
    need = {rows: estimate(QWEN, settings.model_copy(update={"micro_batch_size": rows}), False).total
            for rows in (8, 4, 2, 1)}
    fitted = fit(settings, QWEN, Available(need[2], "MemAvailable"), bfloat16=False)
    assert fitted.chosen == {"micro_batch_size": 2}
    assert fitted.settings.micro_batch_size == 2 and not fitted.settings.gradient_checkpointing
    below_one = Available(need[1] - GIB, "MemAvailable")
    fitted = fit(settings, QWEN, below_one, bfloat16=False)
    assert fitted.chosen["gradient_checkpointing"] is True
    assert fitted.estimate.total <= below_one.size
    assert "chose --gradient-checkpointing" in fitted.describe()


def test_what_the_user_set_is_not_changed_and_the_refusal_names_the_fix():
    # issue 47's command: full fine-tuning of the 0.5B, checkpointing off and the micro-batch given
    settings = TrainerSettings(max_seq_len=4096, micro_batch_size=4, gradient_checkpointing=False)
    with pytest.raises(DoesNotFit) as refused:
        fit(settings, QWEN, available(24), bfloat16=False)
    message = str(refused.value)
    assert "\n" not in message
    assert "peak estimate" in message and "available 24.0 GiB (MemAvailable)" in message
    assert "try --micro-batch-size 1" in message or "try --gradient-checkpointing" in message
    assert refused.value.exit_code == 2


def test_nothing_fits_says_what_else_to_do():
    with pytest.raises(DoesNotFit, match="try --lora-rank 16, a smaller --max-seq-len"):
        fit(TrainerSettings(), QWEN, available(4), bfloat16=False)


def test_the_cgroups_limit_less_its_usage(tmp_path):
    (tmp_path / "proc").mkdir()
    membership = tmp_path / "proc" / "cgroup"
    v2 = tmp_path / "v2" / "job"
    v2.mkdir(parents=True)
    membership.write_text("0::/job\n")
    (v2 / "memory.max").write_text(f"{8 * GIB}\n")
    (v2 / "memory.current").write_text(f"{3 * GIB}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {GIB}\n")
    assert cgroup_headroom(membership, tmp_path / "v2") == 6 * GIB
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_headroom(membership, tmp_path / "v2") is None
    v1 = tmp_path / "v1" / "memory"  # a container sees its own cgroup as the root
    v1.mkdir(parents=True)
    membership.write_text("4:memory:/host/job\n1:cpu:/\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    assert cgroup_headroom(membership, tmp_path / "v1") == 3 * GIB


def test_a_given_limit_caps_what_is_available():
    assert available_memory(0.25) == Available(GIB // 4, "--memory-limit-gib")
    found = available_memory()
    assert found.source in ("MemAvailable", "the cgroup's limit") and found.size > GIB // 4


@pytest.mark.slow  # (the trainer process imports torch and transformers: seconds)
def test_the_trainer_refuses_to_start_with_one_line_and_exit_2(tiny, tmp_path):
    empty = tmp_path / "none.jsonl"
    empty.touch()
    done = subprocess.run(
        [sys.executable, "-m", "agentstream.trainer", "--base-model", str(tiny), "--offline-file", str(empty),
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--memory-limit-gib", "0.5", "--gradient-checkpointing"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("trainer:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "peak estimate" in lines[0] and "available 0.5 GiB (--memory-limit-gib)" in lines[0]
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("v*"))

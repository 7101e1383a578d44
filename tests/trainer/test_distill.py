"""On-policy distillation against real vLLM servers: a teacher server scores the student's sampled tokens
(`trainer.distill`), the scores line up with the tokens, and the trainer's distillation advantage moves the
student towards the teacher."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from agentstream.trainer.distill import Teacher, TeacherError
from agentstream.trainer.grpo import distillation_advantages, mixed_advantages, to_tensors
from agentstream.trainer.service import Trainer
from agentstream.trainer.settings import TrainerSettings
from tests.support.trainer import samples_of, trainer_settings, trajectory, write_jsonl

SHARPER = 6.0
"""the teacher is the tiny model of another seed with its output head scaled: a confident teacher, far (in KL) from
the near-uniform student, as a trained model is from a fresh one"""


def build_teacher(source: Path, out: Path) -> Path:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPER)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            (out / name).write_bytes((source / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def teacher_server(tiny_model_dirs, tmp_path_factory):
    """A second vLLM server (the student's is the session's `vllm_server`): the teacher, served as "teacher"."""
    from agentstream.stack.vllm import LocalVLLM

    folder = build_teacher(tiny_model_dirs[1], tmp_path_factory.mktemp("teacher"))
    server = LocalVLLM(name=f"pytest-teacher-{os.getpid()}")
    try:
        state = server.start(folder, served_name="teacher", timeout=600, tool_parser=None)
        yield state.url, folder
    finally:
        server.stop(grace=2)


def distill_settings(url: str, **fields) -> TrainerSettings:
    return TrainerSettings(distill_weight=fields.pop("distill_weight", 1.0), distill_teacher_url=url, **fields)


def sampled(url: str, model: str, prompt: list[int], n: int, seed: int, max_tokens: int = 24) -> list[dict]:
    response = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "n": n, "temperature": 1.0, "seed": seed,
        "logprobs": 0, "return_token_ids": True, "ignore_eos": True})
    response.raise_for_status()
    return response.json()["choices"]


def hf_logprobs_of(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def exact_kl(student, teacher, sequences: list[list[int]], starts: list[int]) -> float:
    """KL(student ‖ teacher), summed over the vocabulary, averaged over the positions that generated tokens."""
    total, positions = 0.0, 0
    for tokens, start in zip(sequences, starts):
        ids = torch.tensor([tokens])
        with torch.no_grad():
            s = torch.log_softmax(student(input_ids=ids).logits[0, start - 1:-1].float(), -1)
            t = torch.log_softmax(teacher(input_ids=ids).logits[0, start - 1:-1].float(), -1)
        total += (s.exp() * (s - t)).sum().item()
        positions += s.shape[0]
    return total / positions


# --- the advantage, on tensors ------------------------------------------------------------------------


def test_the_distillation_advantage_is_the_teachers_logprob_minus_the_students_on_generated_tokens_only():
    prompt, completion = [1, 2, 3], [4, 5, 6]
    event = trajectory(prompt, completion, 0.0, "g", 0, logprobs=[-1.0, -2.0, -3.0])
    sample = samples_of([event])[0]
    sample.teacher_logprobs = [[0.0, -9.0, -9.0, -0.5, -2.0, -4.0]]
    batch = to_tensors([sample], 64)
    advantage = distillation_advantages(batch)
    # position t scores token t+1: the completion's tokens are scored at 2, 3, 4
    assert advantage[0].tolist() == pytest.approx([0, 0, 0.5, 0.0, -1.0])
    settings = TrainerSettings(distill_weight=0.25, distill_teacher_url="http://teacher", group_size=1,
                               min_group_size=1)
    assert torch.allclose(mixed_advantages(batch, settings), 0.25 * advantage)  # a group of one: no task signal


def test_a_batch_the_teacher_did_not_score_is_refused_rather_than_trained_on_zeros():
    sample = samples_of([trajectory([1, 2], [3, 4], 1.0, "g", 0)])[0]
    with pytest.raises(ValueError, match="teacher's logprobs"):
        distillation_advantages(to_tensors([sample], 64))


@pytest.mark.parametrize(("fields", "message"), [
    ({"distill_weight": 0.5}, "distill-teacher-url"),
    ({"distill_weight": 0.5, "distill_teacher_url": "http://t", "loss": "sft"}, "--loss grpo"),
    ({"distill_weight": 1.5, "distill_teacher_url": "http://t"}, "less than or equal to 1"),
])
def test_distillation_settings_that_cannot_work_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainerSettings(**fields)


# --- against real servers ------------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
async def test_the_teachers_scores_line_up_with_a_sequence_it_generated_itself(teacher_server):
    url, _ = teacher_server
    prompt = list(b"def add(a, b):")
    (choice,) = sampled(url, "teacher", prompt, n=1, seed=3)
    completion = choice["token_ids"]
    generated = choice["logprobs"]["token_logprobs"]
    teacher = Teacher(distill_settings(url))
    try:
        scores = await teacher.score(prompt + completion)
        assert teacher.model == "teacher", "the served model is found from /v1/models"
    finally:
        await teacher.close()
    assert len(scores) == len(prompt) + len(completion) and scores[0] == 0.0
    # the score of token t is the logprob the teacher sampled it with, at temperature 1
    assert scores[len(prompt):] == pytest.approx(generated, abs=2e-3)
    # one position off would not match: the check can fail
    assert scores[len(prompt) - 1:-1] != pytest.approx(generated, abs=2e-3)


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_token_the_teacher_does_not_know_is_its_error_not_a_silent_zero(teacher_server):
    url, _ = teacher_server
    teacher = Teacher(distill_settings(url, distill_teacher_model="teacher"))
    try:
        with pytest.raises(TeacherError, match="400"):
            await teacher.score([1, 2, 10_000_000])
    finally:
        await teacher.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_trainer_steps_with_the_distillation_advantage_bring_the_student_closer_to_the_teacher(
        kafka, vllm_server, teacher_server, tmp_path):
    url, teacher_dir = teacher_server
    events, sequences, starts = [], [], []
    for g, text in enumerate([b"def f(x):", b"import os\n", b"class A:", b"# add two"]):
        prompt = list(text)
        for i, choice in enumerate(sampled(vllm_server.url, vllm_server.model, prompt, n=4, seed=g)):
            completion, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            # every reward equal: the task gives GRPO no signal, only the teacher does
            events.append(trajectory(prompt, completion, 0.0, f"q{g}", i, logprobs))
            sequences.append(prompt + completion)
            starts.append(len(prompt))
    student = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    before = exact_kl(student, teacher, sequences, starts)
    # the reverse KL's estimate on the student's own tokens, from the teacher's weights in this process
    estimate = torch.cat([hf_logprobs_of(student, seq)[start - 1:] - hf_logprobs_of(teacher, seq)[start - 1:]
                          for seq, start in zip(sequences, starts)]).mean().item()

    settings = trainer_settings(kafka, tmp_path / "ckpt", vllm_server.model_dir, group_size=4, groups_per_batch=4,
                                lr=3e-3, epochs=4, offline_file=write_jsonl(tmp_path / "t.jsonl", events),
                                distill_weight=1.0, distill_teacher_url=url)
    (event,) = await Trainer(settings).run()
    metrics = event.data.metrics
    assert metrics["signal_sequences"] == 16 and metrics["optimizer_steps"] == 4
    assert metrics["distill_kl"] == pytest.approx(estimate, abs=5e-3), "the served teacher scored other tokens"
    after = exact_kl(AutoModelForCausalLM.from_pretrained(event.data.uri, dtype=torch.float32), teacher,
                     sequences, starts)
    # one batch of 16 × 24 sampled tokens, 4 steps: measured 0.921 → 0.898 here (the bench follows it further)
    assert after < 0.99 * before, f"KL(student ‖ teacher) {before:.3f} → {after:.3f}"

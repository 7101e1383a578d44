"""On-policy distillation against plain GRPO from the same start (#47 item 3), on the tiny model.

The task has a sparse, binary reward: an answer of ≤ 8 bytes passes if at least `--digits` of them are digits. A
fresh tiny model writes a digit with probability ~10/259: of its 1,024 answers measured, 31 had 2 digits or more
and 2 had 3 or more, so at 2 about 4 groups of 8 in 5 carry no signal, at 3 nearly all (as most of a 0.5B coder's
groups do on a coding task); each threshold is a task of its own, run by every arm. The teacher is the student's
own start fine-tuned by supervised steps on digit answers to the training prompts (`trainer.sft.SFTPolicy`): the
same tokenizer and architecture, as a bigger model of the same family would be, good at the task (its pass rate
on the held-out prompts is measured and reported), and built in seconds. It is served by vLLM and scores the
student's own sampled tokens through `trainer.distill.Teacher`, exactly as the trainer does with
`--distill-weight`.

Each arm starts from the same student weights and seed and runs for the same training wall time (`--seconds`,
validation not counted): per version, 4 training prompts × 8 completions sampled from the current student
(transformers' `generate`, temperature 1, as `bench.trainer_learning` does; no Kafka, no gateway), scored by the
teacher if the arm distils, then one `Policy.update` with `distill_weight` W (0: plain GRPO). After each version
the student answers the held-out prompts (`--validation-samples` each): its pass@1 and digit share.

    uv run python -m bench.distill [--seconds 40] [--weights 0 0.5 1] [--digits 2 3]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentstream.models.tiny_model import build_tiny_model
from agentstream.trainer.batcher import Sample, group_of
from agentstream.trainer.checkpoint import MODEL_FILES
from agentstream.trainer.distill import Teacher
from agentstream.trainer.grpo import Policy
from agentstream.trainer.settings import TrainerSettings
from agentstream.trainer.sft import SFTPolicy
from bench.report import Report
from bench.trainer_learning import GROUP_SIZE, GROUPS, MAX_TOKENS, sample
from samples.events import chat_prompt, trajectory

TRAIN_PROMPTS = ("Write digits.", "A number, please.", "Digits only:", "Give me a number.", "Count something.",
                 "Your PIN?", "How many?", "Say a year.")
VALIDATION_PROMPTS = ("Type some digits.", "What number?", "Numbers:", "Write a number.")
"""held out: neither the teacher's fine-tuning nor the student's updates see them"""
DIGITS = set(range(48, 58))


def digit_count(tokens: list[int]) -> int:
    return sum(t in DIGITS for t in tokens)


def build_teacher(student: Path, out: Path, steps: int, seed: int) -> Path:
    """The student's start fine-tuned on answers of `MAX_TOKENS` random digits to the training prompts."""
    settings = TrainerSettings(loss="sft", lr=3e-3, seed=seed)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    policy = SFTPolicy.load(student, settings)
    for step in range(steps):
        events = [trajectory(chat_prompt(text), [rng.choice(sorted(DIGITS)) for _ in range(MAX_TOKENS)], 1.0,
                             f"sft{step}-{p}", i)
                  for p, text in enumerate(TRAIN_PROMPTS) for i in range(4)]
        policy.update([Sample(e.id, 0, row, e.data, group_of(e.id, e.data)) for row, e in enumerate(events)])
    out.mkdir(parents=True)
    policy.save(out)
    for extra in student.iterdir():  # the tokenizer: the teacher scores the student's token ids
        if extra.is_file() and not MODEL_FILES.fullmatch(extra.name):
            shutil.copy2(extra, out / extra.name)
    return out


def validate(model: torch.nn.Module, threshold: int, samples: int) -> dict[str, float]:
    """pass@1 (one sample each, averaged) and digit share of the held-out prompts' answers."""
    answers = [tokens for text in VALIDATION_PROMPTS for tokens, _ in sample(model, chat_prompt(text), samples)]
    passed = sum(digit_count(a) >= threshold for a in answers)
    return {"pass": passed / len(answers), "passed": passed, "n": len(answers),
            "digit_share": sum(digit_count(a) for a in answers) / (MAX_TOKENS * len(answers))}


def rollouts(policy: Policy, version: int, threshold: int, rng: random.Random) -> tuple[list[Sample], float]:
    """One version's batch: `GROUPS` training prompts × `GROUP_SIZE` answers, reward 1 if the answer passes."""
    samples, rewards = [], []
    for g, text in enumerate(rng.sample(TRAIN_PROMPTS, GROUPS)):
        prompt = chat_prompt(text)
        for i, (tokens, logprobs) in enumerate(sample(policy.model, prompt, GROUP_SIZE)):
            reward = float(digit_count(tokens) >= threshold)
            event = trajectory(prompt, tokens, reward, f"v{version}g{g}", i, logprobs, version)
            samples.append(Sample(event.id, 0, len(samples), event.data, group_of(event.id, event.data)))
            rewards.append(reward)
    return samples, sum(rewards) / len(rewards)


async def run_arm(weight: float, digits: int, student: Path, teacher_url: str, args: argparse.Namespace
                  ) -> dict[str, Any]:
    """Versions from `student` until `args.seconds` of training; validation before the first and after each."""
    settings = TrainerSettings(lr=args.lr, group_size=GROUP_SIZE, seed=args.seed, distill_weight=weight,
                               distill_teacher_url=teacher_url if weight else "", distill_teacher_model="teacher",
                               distill_concurrency=8)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    policy = Policy.load(student, settings)
    teacher = Teacher(settings) if weight else None
    rows = [{"version": 0, "wall_s": 0.0, **validate(policy.model, digits, args.validation_samples)}]
    print(f"  W={weight:g} v0: validation pass@1 {rows[0]['pass']:.3f}", flush=True)
    trained_s = 0.0
    try:
        while trained_s < args.seconds and len(rows) <= args.max_versions:
            started = time.perf_counter()
            samples, train_pass = rollouts(policy, len(rows), digits, rng)
            sampled_s = time.perf_counter() - started
            teacher_s = await teacher.score_samples(samples, settings.max_seq_len) if teacher else 0.0
            metrics = policy.update(samples)
            version_s = time.perf_counter() - started
            trained_s += version_s
            rows.append({"version": len(rows), "wall_s": trained_s, "version_s": version_s, "sample_s": sampled_s,
                         "teacher_s": teacher_s, "train_s": metrics["train_s"], "train_pass": train_pass,
                         "distill_kl": metrics.get("distill_kl"),
                         **validate(policy.model, digits, args.validation_samples)})
            row = rows[-1]
            kl = f", teacher KL {row['distill_kl']:.3f}" if row["distill_kl"] is not None else ""
            print(f"  W={weight:g} v{row['version']}: {version_s:.1f} s (teacher {teacher_s:.1f} s), train pass "
                  f"{train_pass:.3f}{kl}, validation pass@1 {row['pass']:.3f} digits {row['digit_share']:.2f}; "
                  f"{trained_s:.0f}/{args.seconds:.0f} s", flush=True)
    finally:
        if teacher:
            await teacher.close()
    return {"weight": weight, "digits": digits, "rows": rows}


async def warm(url: str) -> None:
    """One scoring call before the arms: the server's first request took 5-7 s, which the first distilling arm's
    first version would otherwise pay."""
    teacher = Teacher(TrainerSettings(distill_weight=1.0, distill_teacher_url=url, distill_teacher_model="teacher"))
    try:
        await teacher.score(chat_prompt(TRAIN_PROMPTS[0]))
    finally:
        await teacher.close()


def arm_name(weight: float) -> str:
    return "plain GRPO" if weight == 0 else f"distillation W={weight:g}"


def interval(passed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95 % interval of a pass rate."""
    p, spread = passed / n, z * z / n
    centre, half = (p + spread / 2) / (1 + spread), z * math.sqrt(p * (1 - p) / n + spread / (4 * n)) / (1 + spread)
    return max(0.0, centre - half), min(1.0, centre + half)


def table(arms: list[dict[str, Any]]) -> str:
    """Validation pass@1 by version, arm beside arm (markdown, for the README), and each arm's time per version."""
    names = [arm_name(a["weight"]) for a in arms]
    lines = ["| version | " + " | ".join(f"{n}: pass@1 (digit share), s" for n in names) + " |",
             "|---" * (len(arms) + 1) + "|"]
    for version in range(max(len(a["rows"]) for a in arms)):
        cells = []
        for arm in arms:
            row = arm["rows"][version] if version < len(arm["rows"]) else None
            cells.append("" if row is None else f"{row['pass']:.3f} ({row['digit_share']:.2f}), {row['wall_s']:.0f}")
        lines.append(f"| {version} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> Report:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from agentstream.stack.vllm import LocalVLLM

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # one thread: on the shared 2 cores (load 15) two threads made a version 10× slower (measured 15-30 s vs 1.5 s)
    torch.set_num_threads(1)
    report = Report("distill")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as tmp:
        student = build_tiny_model(Path(tmp) / "student", seed=args.seed)
        started = time.perf_counter()
        teacher_dir = build_teacher(student, Path(tmp) / "teacher", args.teacher_steps, args.seed)
        teacher_built_s = time.perf_counter() - started
        torch.manual_seed(args.seed)
        teacher_val = validate(AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32),
                               max(args.digits), args.validation_samples)
        print(f"teacher: {args.teacher_steps} SFT steps in {teacher_built_s:.1f} s; validation pass@1 "
              f"{teacher_val['pass']:.3f}, digit share {teacher_val['digit_share']:.2f}", flush=True)
        server = LocalVLLM(name=f"bench-distill-teacher-{os.getpid()}")
        try:
            url = server.start(teacher_dir, served_name="teacher", timeout=1200, tool_parser=None).url
            await warm(url)
            arms = []
            for digits in args.digits:
                for weight in args.weights:
                    print(f"arm: pass at ≥ {digits} digits, W={weight:g} ({arm_name(weight)}), {args.seconds:.0f} s "
                          f"of training", flush=True)
                    arms.append(await run_arm(weight, digits, student, url, args))
        finally:
            server.stop()
    for arm in arms:
        first, last = arm["rows"][0], arm["rows"][-1]
        trained = arm["rows"][1:]
        low, high = interval(last["passed"], last["n"])
        name = f"≥ {arm['digits']} digits, {arm_name(arm['weight'])}"
        report.add(f"{name}: validation pass@1, v0 → v{last['version']} [95 % interval]",
                   f"{first['pass']:.3f} → {last['pass']:.3f} [{low:.2f}, {high:.2f}]")
        report.add(f"{name}: s per version (median; sampling / teacher / update)",
                   f"{sorted(r['version_s'] for r in trained)[len(trained) // 2]:.2f} "
                   f"({sum(r['sample_s'] for r in trained) / len(trained):.2f} / "
                   f"{sum(r['teacher_s'] for r in trained) / len(trained):.2f} / "
                   f"{sum(r['train_s'] for r in trained) / len(trained):.2f})")
    for digits in args.digits:
        # per version, as on a model whose version is mostly rollouts (the 0.5B coder's ~20 min), not the update
        task = [arm for arm in arms if arm["digits"] == digits]
        common = min(len(arm["rows"]) for arm in task) - 1
        report.add(f"≥ {digits} digits: validation pass@1 at v{common}, the last version every arm reached "
                   f"({', '.join(arm_name(arm['weight']) for arm in task)})",
                   " / ".join(f"{arm['rows'][common]['pass']:.3f}" for arm in task))
    report.add(f"teacher: validation pass@1 at ≥ {max(args.digits)} digits (digit share)",
               f"{teacher_val['pass']:.3f} ({teacher_val['digit_share']:.2f})")
    report.details.update(arms=arms, teacher=teacher_val, teacher_built_s=teacher_built_s, args=vars(args),
                          load_before=load_before, load_after=os.getloadavg()[0],
                          task=f"pass: ≥ DIGITS of ≤ {MAX_TOKENS} answer bytes are digits",
                          train_prompts=TRAIN_PROMPTS, validation_prompts=VALIDATION_PROMPTS)
    for digits in args.digits:
        print(f"pass at ≥ {digits} digits: validation pass@1 (digit share), training s, by version")
        print(table([arm for arm in arms if arm["digits"] == digits]))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=40, help="each arm's training wall time")
    parser.add_argument("--max-versions", type=int, default=200)
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.5, 1.0],
                        help="--distill-weight of each arm; 0 is plain GRPO")
    parser.add_argument("--digits", type=int, nargs="+", default=[2, 3],
                        help="the digits an answer needs to pass; each a task of its own, run by every arm")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--teacher-steps", type=int, default=20)
    parser.add_argument("--validation-samples", type=int, default=16, help="answers per held-out prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(run(args)).print()


if __name__ == "__main__":
    main()

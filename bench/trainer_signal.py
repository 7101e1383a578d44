"""What an update costs when few groups carry signal: `Policy.update` on one batch whose groups all
have mixed rewards (the baseline: every row is run) and on the same batch with all but some groups'
rewards made equal (advantage 0: those rows get no forward or backward pass), interleaved in one run.

    uv run python -m bench.trainer_signal [--repeats 7] [--model DIR]

The default model is the tiny one (hidden 128, vocabulary 259); `--model` takes a real folder
(`agentstream model smollm2 DIR`), where the logits of a large vocabulary dominate the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from functools import partial
from pathlib import Path

import torch

from agentstream.models.tiny_model import build_tiny_model
from agentstream.trainer.batcher import Sample, group_of
from agentstream.trainer.grpo import Policy
from agentstream.trainer.settings import TrainerSettings
from bench.trainer_throughput import make_events, timed

GROUPS, GROUP_SIZE, COMPLETION = 8, 4, 128
RESULTS = Path(__file__).parent / "results" / "trainer_signal.json"


def batch_with_signal(samples: list[Sample], groups_with_signal: int) -> list[Sample]:
    """The batch with every group from `groups_with_signal` on rewarded 0 throughout."""
    return [dataclasses.replace(s, trajectory=s.trajectory.model_copy(update={"reward": 0.0}))
            if i // GROUP_SIZE >= groups_with_signal else s for i, s in enumerate(samples)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed updates of each batch (median reported)")
    parser.add_argument("--model", type=Path, help="a model folder (default: the tiny model)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_tiny_model(Path(tmp) / "tiny", seed=0)
        events = make_events(GROUPS, GROUP_SIZE, COMPLETION, seed=0, prefix="g")
        # each group half rewarded, so every group of the baseline has signal
        events = [e.model_copy(update={"data": e.data.model_copy(update={"reward": float(i % 2)})})
                  for i, e in enumerate(events)]
        samples = [Sample(e.id, 0, i, e.data, group_of(e.id, e.data)) for i, e in enumerate(events)]
        torch.manual_seed(0)
        policy = Policy.load(model_dir, TrainerSettings(group_size=GROUP_SIZE, lr=1e-6))
        shares = (GROUPS, GROUPS // 2, GROUPS // 4, 1, 0)
        by_name = timed({str(n): partial(policy.update, batch_with_signal(samples, n)) for n in shares}, args.repeats)
        seconds = {n: by_name[str(n)] for n in shares}
    print(f"{GROUPS} groups × {GROUP_SIZE}, {COMPLETION} generated tokens each; model {args.model or 'tiny'}")
    print(f"{'groups with signal':<20}{'seconds per update':>20}{'vs every group':>16}")
    for n in shares:
        print(f"{n:<20}{seconds[n]:>20.3f}{seconds[n] / seconds[GROUPS]:>16.2f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({f"update_s_{n}_of_{GROUPS}": seconds[n] for n in shares}
                                  | {f"ratio_{n}_of_{GROUPS}": seconds[n] / seconds[GROUPS] for n in shares}, indent=1))


if __name__ == "__main__":
    main()

"""Tenants' adapters (#48 item 3): one trainer process with every tenant's LoRA adapter over one base in memory
(`trainer.adapters.TenantAdapters`), against one trainer process per tenant (each loads the base and trains one
adapter), for 1 and 3 tenants. Each tenant trains --updates GRPO updates of one group of --rows rows; the tenants of
one process take turns, the processes of the other way run at once (as separate trainers would, on the same cores).

    uv run python -m bench.tenant_trainers [--model tiny|smollm2] [--tenants 1,3] [--updates 4]

Reported: the memory of the whole way (the sum of every process's peak RSS, VmHWM), the time of one tenant's update
(median, after the first), and the wall time for every tenant's updates. Ratios against 1 tenant in one process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "tenant_trainers.json"


def child(folder: Path, tenants: int, updates: int, rows: int, length: int, lora_rank: int) -> dict[str, object]:
    """`tenants` adapters trained in this process, each `updates` times in turn; the update times and peak RSS."""
    import random

    import torch
    from transformers.utils import logging as hf_logging

    from agentstream.trainer.adapters import TenantAdapters
    from agentstream.trainer.batcher import Sample, group_of
    from agentstream.trainer.memory import GIB, peak_rss
    from agentstream.trainer.settings import TrainerSettings
    from samples.events import trajectory

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)  # (one core per trainer: the processes of the other way get one each)
    settings = TrainerSettings(max_seq_len=length, group_size=rows, groups_per_batch=1, micro_batch_size=rows,
                               lora_rank=lora_rank, lr=1e-4)
    rng = random.Random(0)
    adapters = TenantAdapters(folder, settings)
    names = [f"tenant-{i}" for i in range(tenants)]
    for name in names:
        adapters.add(name)
    times: list[float] = []
    for update in range(updates):
        for name in names:
            events = [trajectory([rng.randrange(3, 60) for _ in range(8)],
                                 [rng.randrange(3, 60) for _ in range(length - 8)], float(i % 2),
                                 f"{name}-{update}", i) for i in range(rows)]
            samples = [Sample(e.id, 0, i, e.data, group_of(e.id, e.data)) for i, e in enumerate(events)]
            started = time.perf_counter()
            adapters.update(name, samples)
            times.append(time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as out:
        for name in names:
            adapters.save(name, Path(out) / name)
        saved = sorted(p.name for p in (Path(out) / names[-1]).iterdir())
    return {"update_s": times[len(names):] or times, "peak_gib": peak_rss() / GIB, "saved": saved}


def run(folder: Path, processes: int, tenants_each: int, args: argparse.Namespace) -> dict[str, float]:
    """`processes` trainers at once, each with `tenants_each` adapters; the way's memory and times."""
    spec = json.dumps([str(folder), tenants_each, args.updates, args.rows, args.length, args.lora_rank])
    started = time.perf_counter()
    running = [subprocess.Popen([sys.executable, "-m", "bench.tenant_trainers", "--child", spec],
                                stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    outputs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in running]
    wall = time.perf_counter() - started
    if any(p.returncode for p in running):
        raise SystemExit("a trainer of the bench failed")
    assert all(out["saved"] == ["adapter_config.json", "adapter_model.safetensors"] for out in outputs)
    updates = [t for out in outputs for t in out["update_s"]]
    return {"memory_gib": sum(out["peak_gib"] for out in outputs), "update_s": statistics.median(updates),
            "wall_s": wall}


def model_folder(name: str, tmp: Path) -> Path:
    if name == "tiny":
        from agentstream.models.tiny_model import build_tiny_model

        return build_tiny_model(tmp / "tiny", seed=0)
    from agentstream.models.smollm2 import build_smollm2, default_folder

    return build_smollm2(default_folder())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tenants", default="1,3")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(json.loads(args.child)[0]), *json.loads(args.child)[1:])))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, Path(tmp))
        baseline: dict[str, float] | None = None
        print(f"{'way':<22}{'tenants':>8}{'memory GiB':>12}{'× base':>8}{'update s':>10}{'× base':>8}"
              f"{'wall s':>9}{'× base':>8}")
        for tenants in [int(n) for n in args.tenants.split(",")]:
            for way, processes, each in (("one process", 1, tenants), ("a process per tenant", tenants, 1)):
                if tenants == 1 and processes == 1 and way != "one process":
                    continue
                row = run(folder, processes, each, args)
                baseline = baseline or row
                results.append({"model": args.model, "way": way, "tenants": tenants, **row})
                print(f"{way:<22}{tenants:>8}{row['memory_gib']:>12.2f}"
                      f"{row['memory_gib'] / baseline['memory_gib']:>8.2f}{row['update_s']:>10.3f}"
                      f"{row['update_s'] / baseline['update_s']:>8.2f}{row['wall_s']:>9.1f}"
                      f"{row['wall_s'] / baseline['wall_s']:>8.2f}", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

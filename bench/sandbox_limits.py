"""What the local sandbox's totals cost: its cgroup and its workspace disk, against the same sandbox
without them, same run.

Baseline: `LocalSandbox` with `sandbox.cgroups.create` and `sandbox.disk.available` switched off (what a
host without cgroups or loop devices gets: rlimits alone, the workspace bound directly and chowned).
Measured, the two interleaved so both see the same machine load (medians):
  - per command: `true` and `python3 -c pass` in an open sandbox (the cgroup join and the check that
    nothing is left in the group afterwards);
  - start-up + first `true` + close, with an empty workspace and with --files files (a repository's
    worth): the disk is made, mounted, filled and copied back (only what changed) where the baseline
    chowns the tree both ways;
  - close after one command that changed one file of --files.

    uv run python -m bench.sandbox_limits [--rounds 15] [--files 5000]
(needs root, bubblewrap, cgroups and loop devices, like the sandbox with its totals)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from agentstream.sandbox import cgroups, disk, hostfs
from agentstream.sandbox.contract import Limits, SandboxSpec
from agentstream.sandbox.local import LocalSandbox
from bench.report import Report
from bench.sandbox_overhead import fill

LIMITS = Limits(attempt_timeout_s=3600)


@contextmanager
def without_totals() -> Iterator[None]:
    """The sandbox as a host without cgroups or loop devices runs it."""
    create, available = cgroups.create, disk.available
    cgroups.create = lambda name, limits: None  # type: ignore[assignment]
    disk.available = lambda: "switched off for the baseline"  # type: ignore[assignment]
    try:
        yield
    finally:
        cgroups.create, disk.available = create, available


def opened(workspace: Path, totals: bool) -> LocalSandbox:
    if totals:
        box = LocalSandbox(SandboxSpec(workspace, LIMITS))
        assert box._cgroup is not None and box._disk is not None, "this host lacks cgroups or loop devices"
        return box
    with without_totals():
        return LocalSandbox(SandboxSpec(workspace, LIMITS))


def timed(action: Callable[[], object]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def paired(rounds: int, action: Callable[[bool], object]) -> tuple[float, float]:
    """Medians of `rounds` alternating runs of action(False) (baseline) and action(True)."""
    base, meas = [], []
    for _ in range(rounds):
        base.append(timed(lambda: action(False)))
        meas.append(timed(lambda: action(True)))
    return statistics.median(base), statistics.median(meas)


def startup(workspace: Path, totals: bool) -> None:
    with opened(workspace, totals) as box:
        assert box.run("true").ok


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--commands", type=int, default=40)
    parser.add_argument("--files", type=int, default=5000)
    args = parser.parse_args()
    report = Report("sandbox_limits")
    root = Path(tempfile.mkdtemp(prefix="bench-sandbox-limits-"))
    try:
        workspace = root / "workspace"
        workspace.mkdir()
        for command in ("true", "/usr/bin/python3 -c pass"):
            (root / "a").mkdir(exist_ok=True)
            (root / "b").mkdir(exist_ok=True)
            with opened(root / "a", False) as plain, opened(root / "b", True) as bounded:
                base, meas = paired(args.commands, lambda totals, c=command: (bounded if totals else plain).run(c))
            report.add(f"per command `{command}`: rlimits only", f"{base * 1000:.1f} ms")
            report.add(f"per command `{command}`: + cgroup + disk", f"{meas * 1000:.1f} ms", meas / base)
            report.details[f"command {command}"] = {"base_s": base, "bounded_s": meas}

        base, meas = paired(args.rounds, lambda totals: startup(workspace, totals))
        report.add("start-up + first `true` + close, empty workspace: rlimits only", f"{base * 1000:.1f} ms")
        report.add("start-up + first `true` + close, empty workspace: + cgroup + disk", f"{meas * 1000:.1f} ms",
                   meas / base)
        big = root / "repository"
        big.mkdir()
        fill(big, args.files)
        base_big, meas_big = paired(args.rounds, lambda totals: startup(big, totals))
        report.add(f"start-up + first `true` + close, {args.files} files: rlimits only", f"{base_big * 1000:.1f} ms")
        report.add(f"start-up + first `true` + close, {args.files} files: + cgroup + disk", f"{meas_big * 1000:.1f} ms",
                   meas_big / base_big)

        def one_edit(totals: bool) -> float:
            box = opened(big, totals)
            assert box.run("echo 'y = 2' >> pkg0/m0.py").ok
            return timed(box.close)

        closes = [(one_edit(False), one_edit(True)) for _ in range(args.rounds)]
        base_close, meas_close = (statistics.median(side) for side in zip(*closes))
        report.add(f"close after editing 1 of {args.files} files: rlimits only", f"{base_close * 1000:.1f} ms")
        report.add(f"close after editing 1 of {args.files} files: + cgroup + disk", f"{meas_close * 1000:.1f} ms",
                   meas_close / base_close)
        report.details["startup"] = {"base_s": base, "bounded_s": meas, "files": args.files,
                                     "base_big_s": base_big, "bounded_big_s": meas_big,
                                     "base_close_s": base_close, "bounded_close_s": meas_close}
    finally:
        hostfs.remove_tree(root)
    report.print("ratio vs. the same sandbox without cgroup and disk (rlimits only, the workspace bound directly)")


if __name__ == "__main__":
    main()

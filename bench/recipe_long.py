"""The coding recipe's long run (#47 item 6): the one command for hours, in segments that add up, and its plot.

A segment runs `agentstream recipe swe ARGS` for a wall-time budget, then stops it as Ctrl-C would (SIGTERM: the
command stops everything it started, its run folder resumable), and appends the segment to the run folder's ledger
(`long-run.jsonl`: start, end, seconds, versions measured by then, the 1-minute load average over it). The same
invocation again resumes the run (the RL stage goes on in its attempt, recipes/swe/README.md): several sessions make
one long run, and a larger `--versions` grows its horizon.

    python -m bench recipe_long --hours 2.5 -- --model qwen-coder-0.5b --seed 11 --limit 60 \\
        --out ~/.cache/agentstream/runs/recipe-swe-qwen-coder-0.5b-seed11-long --stages probe,rl --versions 24

`--plot RUN[=LABEL] ...` draws validation pass@1 by version with its 95 % interval (Wilson, per task: as the
recipe reports it) for each run folder (an arm: GRPO, distillation) into one PNG, and prints a markdown table per
arm: version, pass@1 [interval], train reward, groups with signal, hours of the ledger's segments until the
version was measured.

    python -m bench recipe_long --plot RUN_GRPO=GRPO RUN_DISTILL=distillation --png bench/results/recipe_long.png
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LEDGER = "long-run.jsonl"
COMMAND = f"{sys.executable} -m agentstream recipe swe"
STOP_S = 900.0
"""how long the command may take to stop after SIGTERM (its services' own stops, the vLLM server's) before it is
killed: a kill leaves its services running, which the next segment's command stops first (recipe.py)"""
SAMPLE_S = 60.0


# --- a segment -----------------------------------------------------------------------------------


def run_folder(args: list[str]) -> Path:
    """The command's `--out`: the ledger lives there (a default folder is named by a hash the bench cannot see)."""
    for n, arg in enumerate(args):
        if arg == "--out" and n + 1 < len(args):
            return Path(args[n + 1]).expanduser()
        if arg.startswith("--out="):
            return Path(arg.removeprefix("--out=")).expanduser()
    raise SystemExit("give the command's --out: the long run's ledger is kept in its run folder")


def per_version(run: Path) -> dict[int, dict[str, Any]]:
    """The RL stage's rows by version: rl.json when the stage ended, else those its newest attempt wrote so far."""
    if (rl := run / "rl.json").exists():
        rows = json.loads(rl.read_text())["per_version"]
    else:
        attempts = sorted((run / "rl").glob("*-rl-*/versions.json"), key=lambda p: int(p.parent.name.rsplit("-", 1)[1]))
        rows = json.loads(attempts[-1].read_text()) if attempts else {}
    return {int(version): row for version, row in rows.items()}


def measured(run: Path) -> int:
    return sum(1 for row in per_version(run).values() if row.get("validation_pass_at_1") is not None)


def segment(command: list[str], run: Path, hours: float, stop_s: float = STOP_S) -> dict[str, Any]:
    """Run the command for `hours` at most, stopped by SIGTERM at the budget; the segment's ledger entry."""
    run.mkdir(parents=True, exist_ok=True)
    log = run / "long-run.log"
    began, loads = time.time(), []
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + hours * 3600
    while process.poll() is None and time.monotonic() < deadline:
        try:
            process.wait(timeout=min(SAMPLE_S, max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            loads.append(os.getloadavg()[0])
    ended = "exited"
    if process.poll() is None:
        ended = "budget"
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            ended = "killed"  # its services run on: the next segment's command stops them
            process.kill()
            process.wait()
    loads.append(os.getloadavg()[0])
    end = time.time()
    entry = {"start": _utc(began), "end": _utc(end), "start_s": round(began, 1), "end_s": round(end, 1),
             "seconds": round(end - began, 1), "ended": ended, "exit_code": process.returncode,
             "versions_measured": measured(run), "load_1min_mean": round(sum(loads) / len(loads), 2),
             "command": shlex.join(command)}
    with open(run / LEDGER, "a") as ledger:
        ledger.write(json.dumps(entry) + "\n")
    return entry


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def ledger(run: Path) -> list[dict[str, Any]]:
    path = run / LEDGER
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# --- the plot and the table ------------------------------------------------------------------------


def hours_until(segments: list[dict[str, Any]], when: float | None) -> float | None:
    """The ledger's running hours before `when` (seconds since the epoch): the run's own time, not the pauses
    between sessions."""
    if when is None or not segments:
        return None
    return sum(max(0.0, min(float(s["end_s"]), when) - float(s["start_s"])) for s in segments) / 3600


def arm_rows(run: Path) -> list[dict[str, Any]]:
    segments = ledger(run)
    rows = []
    for version, row in sorted(per_version(run).items()):
        passed = row.get("validation_pass_at_1")
        rows.append({"version": version, "pass_at_1": passed,
                     "interval": row.get("validation_pass_at_1_interval_95"),
                     "train_reward": row.get("train_reward_mean"),
                     "signal": row.get("train_groups_with_signal_share"), "groups": row.get("train_groups"),
                     "hours": None if passed is None else hours_until(segments, row.get("validation_measured_at"))})
    return rows


def table(label: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"**{label}**", "", "| version | pass@1 [95 %] | train reward | groups with signal | hours |",
             "|---:|---:|---:|---:|---:|"]
    for row in rows:
        passed = "" if row["pass_at_1"] is None else f"{row['pass_at_1']:.3f}" + (
            f" [{row['interval'][0]:.2f}, {row['interval'][1]:.2f}]" if row["interval"] else "")
        reward = "" if row["train_reward"] is None else f"{row['train_reward']:.3f}"
        signal_share = "" if row["signal"] is None else f"{row['signal']:.2f} of {row['groups']}"
        hours = "" if row["hours"] is None else f"{row['hours']:.2f}"
        lines.append(f"| {row['version']} | {passed} | {reward} | {signal_share} | {hours} |")
    return "\n".join(lines)


def plot(arms: dict[str, list[dict[str, Any]]], png: Path, references: dict[str, tuple[float, float, float]]) -> None:
    """One line per arm with its band; a reference (a figure measured elsewhere, as the warm start's) level across."""
    from agentstream.demo.progress import plot_by_version

    versions = sorted({row["version"] for rows in arms.values() for row in rows})
    lines, intervals = {}, {}
    for label, rows in arms.items():
        by_version = {row["version"]: row for row in rows}
        lines[label] = [by_version[v]["pass_at_1"] if v in by_version else None for v in versions]
        intervals[label] = [by_version[v]["interval"] if v in by_version else None for v in versions]
    for label, (value, low, high) in references.items():
        lines[label], intervals[label] = [value] * len(versions), [(low, high)] * len(versions)
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_by_version(png, "the coding recipe's long run: validation pass@1 by version (95 % interval)", versions,
                    lines, ylabel="validation pass@1", intervals=intervals)


def parse_reference(given: str) -> tuple[str, tuple[float, float, float]]:
    label, _, figures = given.rpartition("=")
    try:
        value, low, high = (float(x) for x in figures.split(","))
    except ValueError:
        raise SystemExit(f"--reference {given!r}: give LABEL=PASS_AT_1,LOW,HIGH (e.g. 'warm start=0.269,0.10,0.54')") from None
    return label or "reference", (value, low, high)


def parse_arm(given: str) -> tuple[Path, str]:
    path, _, label = given.partition("=")
    folder = Path(path).expanduser()
    return folder, label or folder.name


def main(argv: list[str]) -> int:
    command_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench recipe_long", description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, help="the segment's wall-time budget; the command's arguments after --")
    parser.add_argument("--command", default=COMMAND, help="what runs the recipe (default: %(default)s)")
    parser.add_argument("--stop-s", type=float, default=STOP_S, help="seconds the command may take to stop")
    parser.add_argument("--plot", nargs="+", metavar="RUN[=LABEL]", help="run folders to plot, one arm each")
    parser.add_argument("--reference", nargs="*", default=[], metavar="LABEL=P,LOW,HIGH",
                        help="a pass@1 measured elsewhere (the warm start's, say) drawn level across, with its band")
    parser.add_argument("--png", type=Path, default=Path("bench/results/recipe_long.png"))
    args = parser.parse_args(own)
    if args.plot:
        arms = {label: arm_rows(folder) for folder, label in map(parse_arm, args.plot)}
        plot(arms, args.png, dict(map(parse_reference, args.reference)))
        print("\n\n".join(table(label, rows) for label, rows in arms.items()))
        print(f"\nplot: {args.png}")
        results = args.png.with_suffix(".json")
        results.write_text(json.dumps(arms, indent=2) + "\n")
        return 0
    if args.hours is None or not command_args:
        parser.error("give --hours and the command's arguments after --, or --plot RUN ...")
    run = run_folder(command_args)
    entry = segment([*shlex.split(args.command), *command_args], run, args.hours, args.stop_s)
    total = sum(s["seconds"] for s in ledger(run)) / 3600
    print(f"segment {entry['start']} → {entry['end']} ({entry['seconds'] / 3600:.2f} h, {entry['ended']}): "
          f"{entry['versions_measured']} versions measured, load {entry['load_1min_mean']}; the run's "
          f"{len(ledger(run))} segment(s): {total:.2f} h ({run / LEDGER})")
    return 0 if entry["ended"] in ("budget", "exited") and entry["exit_code"] in (0, -signal.SIGTERM, 130, 143) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

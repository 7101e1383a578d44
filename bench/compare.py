"""Before and after, in the same run: one benchmark run whole in two checkouts, alternately.

    python -m bench.compare --baseline DIR [--baseline-python PY] [--pairs 3] [--json FILE] NAME [ARGS…]

Runs `python -m bench.NAME ARGS…` in the baseline checkout (DIR, with its own interpreter: a
checkout of another version has its own environment) and in this one, `--pairs` times each, in
the order before, after, after, before, before, … (each pair's order reversed from the last, so a
load that drifts through the run weighs on both sides alike). Each run's figures are read from
the JSON file it writes (`bench/results/NAME.json` in its checkout, see `bench.report`), or, for
the benchmarks that only print, from its output (`PRINTED`). For each figure found in both: the
median after/before over the pairs, and the smallest and largest pair. A figure in a time unit
is better lower, a rate better higher; the table says which, and flags a pair-median more than
`--threshold` worse. Figures the benchmark measured against its own in-run baseline (its ratio
column) are compared too: those cancel the machine's load within each run.

Each number of a figure is compared ("1,970 trajectories/s, CPU 56 µs each": the rate and the CPU,
the steadier of the two under load). Figures are matched by label, with the numbers in its
parentheses masked (a run's own shares and rates, not part of the name); where a label changed
between the checkouts (a module path in it), `RENAMED` maps the baseline's onto this one's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).parent.parent
console = Console()

NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"({NUMBER})\s*(µs|us|ms|ns|s\b|min\b|/s|[A-Za-z%]+(?:/s)?)?")
IN_PARENTHESES = re.compile(r"\([^()]*\)")
TIME_UNITS = {"ns", "µs", "us", "ms", "s", "min"}
LOWER_IS_BETTER = re.compile(r"\btime\b|CPU per|delay|p50|p99|bytes per", re.IGNORECASE)
"""labels of unitless figures that are costs (e.g. `ratio controller/bare time: 3.65x`)"""

RENAMED = {
    # the log tools moved from agentstream/ into agentstream/logs/ (#35)
    "decode": [("agentstream.query.decode", "agentstream.logs.query.decode")],
}


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str
    ratio: float | None
    """the benchmark's own ratio against its in-run baseline, when it gives one"""

    def lower_is_better(self, label: str) -> bool:
        if self.unit in TIME_UNITS or self.unit.endswith("/s"):
            return self.unit in TIME_UNITS
        return bool(LOWER_IS_BETTER.search(label))


def parse_figures(label: str, text: str, ratio: float | None = None) -> dict[str, Figure]:
    """Each number in a figure with its unit: "5.8 µs (171,138 events/s per core)" → `label` 5.8 µs and
    `label [events/s]` 171,138; the benchmark's ratio goes with the first. None in "identical"."""
    figures = {}
    for n, match in enumerate(FIGURE.finditer(text)):
        value, unit = float(match.group(1).replace(",", "")), match.group(2) or ""
        name = label if n == 0 else f"{label} [{n + 1}: {unit}]"
        figures[name] = Figure(value, unit, ratio if n == 0 else None)
    return figures


def from_report(path: Path, since: float) -> dict[str, Figure]:
    """The figures of a `bench.report.Report` JSON file written since `since` (else none: the run wrote none)."""
    if not path.exists() or path.stat().st_mtime < since:
        return {}
    figures = {}
    for row in json.loads(path.read_text())["rows"]:
        label = row["measurement"].strip()
        found = parse_figures(label, row["figure"], row["ratio"])
        if not found and row["ratio"] is not None:
            found = {label: Figure(row["ratio"], "×", row["ratio"])}
        figures.update(found)
    return figures


def printed_lines(output: str) -> dict[str, Figure]:
    """`label: figure` lines, as `bench.controller_launch` prints them."""
    figures = {}
    for line in output.splitlines():
        label, colon, rest = line.partition(":")
        if colon and label.strip():
            figures.update(parse_figures(label.strip(), rest))
    return figures


def printed_table(output: str) -> dict[str, Figure]:
    """`bench.trainer_throughput`'s table: a row per batch shape, columns of samples/s and shares."""
    lines = output.splitlines()
    header = next((line for line in lines if line.startswith("batch (")), None)
    if header is None:
        return {}
    columns = re.split(r"\s{2,}", header.strip())[1:]
    figures = {}
    for line in lines[lines.index(header) + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(columns) + 1 or not re.match(r"\d+×\d+", cells[0]):
            continue
        for column, cell in zip(columns, cells[1:], strict=True):
            figures.update(parse_figures(f"{cells[0]}: {column}", cell))
    return figures


PRINTED: dict[str, Callable[[str], dict[str, Figure]]] = {
    "controller_launch": printed_lines,
    "trainer_throughput": printed_table,
}


@dataclass(frozen=True)
class Tree:
    label: str
    root: Path
    python: str


def run_once(tree: Tree, name: str, args: list[str], logs: Path, n: int) -> dict[str, Figure]:
    started = time.time()
    log = logs / f"{name}.{tree.label}.{n}.log"
    with log.open("w") as out:
        done = subprocess.run([tree.python, "-m", f"bench.{name}", *args], cwd=tree.root, stdout=out,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"bench.{name} in {tree.root} failed ({done.returncode}); its output: {log}\n{output[-2000:]}")
    figures = PRINTED[name](output) if name in PRINTED else from_report(tree.root / "bench/results" / f"{name}.json", started)
    if not figures:
        raise SystemExit(f"bench.{name} in {tree.root} gave no figures this script can read; its output: {log}")
    console.print(f"  {tree.label} {n}: {time.time() - started:.0f} s, load {os.getloadavg()[0]:.1f}, "
                  f"{len(figures)} figures (log {log})")
    return figures


def normalised(name: str, figures: dict[str, Figure]) -> dict[str, Figure]:
    """Labels as this checkout names them (`RENAMED`), with the numbers in parentheses masked: those are a
    run's own figures ("worker CPU per event (whole process; 77% on a CPU, …)"), not part of the name."""
    found: dict[str, Figure] = {}
    for label, figure in figures.items():
        for old, new in RENAMED.get(name, []):
            label = label.replace(old, new)
        masked = IN_PARENTHESES.sub(lambda match: re.sub(NUMBER, "#", match.group(0)), label)
        found[label if masked in found else masked] = figure
    return found


def ratios(before: list[dict[str, Figure]], after: list[dict[str, Figure]], pick: Callable[[Figure], float | None]
           ) -> dict[str, list[float]]:
    """Per label, after/before of `pick` in each pair where both have it, above zero (a ratio of a figure that
    can be negative, e.g. a delay minus the wait it includes by design, says nothing)."""
    found: dict[str, list[float]] = {}
    for b, a in zip(before, after, strict=True):
        for label in a.keys() & b.keys():
            x, y = pick(a[label]), pick(b[label])
            if x is not None and y is not None and x > 0 and y > 0:
                found.setdefault(label, []).append(x / y)
    return found


def summary(name: str, before: list[dict[str, Figure]], after: list[dict[str, Figure]], threshold: float) -> list[dict]:
    rows = []
    figure_ratios = ratios(before, after, lambda f: f.value)
    own_ratios = ratios(before, after, lambda f: f.ratio)
    for label in [label for label in after[0] if label in figure_ratios]:
        spread = figure_ratios[label]
        lower = after[0][label].lower_is_better(label)
        median = statistics.median(spread)
        worse = median > 1 + threshold if lower else median < 1 - threshold
        own = own_ratios.get(label)
        rows.append({"measurement": label, "unit": after[0][label].unit, "better": "lower" if lower else "higher",
                     "median": median, "min": min(spread), "max": max(spread), "pairs": len(spread),
                     "own_ratio_median": statistics.median(own) if own else None, "worse": worse})
    return rows


def show(name: str, rows: list[dict], loads: list[float]) -> None:
    table = Table(title=f"bench.{name}: after / before, same run (load {min(loads):.1f}–{max(loads):.1f})",
                  caption="after/before of each figure over the pairs; 'own ratio' = after/before of the benchmark's "
                          "ratio against its in-run baseline; ! = median worse than the threshold")
    for column in ("measurement", "unit", "better", "median", "min–max", "pairs", "own ratio"):
        table.add_column(column)
    for row in rows:
        own = row["own_ratio_median"]
        table.add_row(row["measurement"], row["unit"], row["better"], f"{row['median']:.2f}" + (" !" if row["worse"] else ""),
                      f"{row['min']:.2f}–{row['max']:.2f}", str(row["pairs"]), "" if own is None else f"{own:.2f}")
    Console(width=max(console.width, 150)).print(table)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the version to compare against")
    parser.add_argument("--baseline-python", default=sys.executable,
                        help="the baseline's interpreter (its own venv's, e.g. DIR/.venv/bin/python)")
    parser.add_argument("--pairs", type=int, default=3, help="before/after pairs (at least 3 for a spread)")
    parser.add_argument("--threshold", type=float, default=0.10, help="flag a median worse than this share")
    parser.add_argument("--json", type=Path, help="also write the comparison here")
    parser.add_argument("--again", action="store_true",
                        help="run nothing: summarise the runs saved in --json again (e.g. after changing how labels match)")
    parser.add_argument("name", help="the benchmark, as in `python -m bench.NAME`")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments, the same for both")
    args = parser.parse_args(argv)
    before = Tree("before", args.baseline.resolve(), args.baseline_python)
    after = Tree("after", ROOT, sys.executable)
    for tree in (before, after):
        if not (tree.root / "bench" / f"{args.name}.py").exists():
            raise SystemExit(f"no bench/{args.name}.py in {tree.root}: name a benchmark both checkouts have")
    if args.again:
        if args.json is None:
            parser.error("--again reads the file --json names")
        saved = json.loads(args.json.read_text())
        runs = {side: [normalised(args.name, {k: Figure(**f) for k, f in run.items()}) for run in done]
                for side, done in saved["runs"].items()}
        show(args.name, summary(args.name, runs["before"], runs["after"], args.threshold),
             [saved["load_1min"]["min"], saved["load_1min"]["max"]])
        return 0
    logs = Path(tempfile.mkdtemp(prefix=f"compare-{args.name}-"))
    runs: dict[str, list[dict[str, Figure]]] = {"before": [], "after": []}
    loads = [os.getloadavg()[0]]
    console.print(f"bench.{args.name} {' '.join(args.args)}: {args.pairs} pairs, before = {before.root}, after = {after.root}")
    for pair in range(args.pairs):
        order = (before, after) if pair % 2 == 0 else (after, before)
        for tree in order:
            runs[tree.label].append(normalised(args.name, run_once(tree, args.name, args.args, logs, pair + 1)))
            loads.append(os.getloadavg()[0])
    rows = summary(args.name, runs["before"], runs["after"], args.threshold)
    show(args.name, rows, loads)
    if args.json:
        args.json.write_text(json.dumps({
            "name": args.name, "args": args.args, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "baseline": str(before.root), "load_1min": {"min": min(loads), "max": max(loads)}, "rows": rows,
            "runs": {label: [{k: vars(f) for k, f in run.items()} for run in done] for label, done in runs.items()},
        }, indent=2) + "\n")
    return 1 if any(row["worse"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m bench recipe_long`: a segment of the long run stopped at its budget and written to the run folder's ledger,
segments adding up; the plot and table of pass@1 by version from run folders. Run as a program, as the benchmarks
are; the recipe's command is a stand-in script here (the real one is hours: bench/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]

STAND_IN = textwrap.dedent("""
    import json, signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    versions = int(sys.argv[sys.argv.index("--versions") + 1])
    folder = out / "rl" / f"{out.name}-rl-1"
    folder.mkdir(parents=True, exist_ok=True)
    rows = {str(v): {"validation_pass_at_1": 0.5} for v in range(versions)}
    (folder / "versions.json").write_text(json.dumps(rows))
    if "--until-stopped" in sys.argv:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the recipe's code for a SIGTERM
        while True:
            time.sleep(60)
""")
"""the recipe's command as the bench sees it: measures `--versions` versions, then runs until stopped or ends"""


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", "recipe_long", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # a segment's budget of wall time (3.6 s) and the programs' start-up
def test_each_segment_is_stopped_at_its_budget_and_added_to_the_run_folders_ledger(tmp_path):
    script, run = tmp_path / "recipe.py", tmp_path / "run"
    script.write_text(STAND_IN)
    command = f"{sys.executable} {script}"

    first = bench("--hours", "0.001", "--command", command, "--", "--out", str(run), "--versions", "2",
                  "--until-stopped")
    assert first.returncode == 0, first.stderr
    second = bench("--hours", "1", "--command", command, "--", "--out", str(run), "--versions", "3")
    assert second.returncode == 0, second.stderr

    segments = [json.loads(line) for line in (run / "long-run.jsonl").read_text().splitlines()]
    assert [(s["ended"], s["exit_code"], s["versions_measured"]) for s in segments] == [
        ("budget", 143, 2), ("exited", 0, 3)], "stopped by SIGTERM at the budget; the next one ended by itself"
    assert 3.6 <= segments[0]["seconds"] < 60 and segments[0]["end_s"] <= segments[1]["start_s"]
    assert all(s["load_1min_mean"] >= 0 and s["start"].endswith("Z") for s in segments)
    assert "2 segment(s)" in second.stdout

    refused = bench("--hours", "1", "--command", command, "--", "--versions", "1")
    assert refused.returncode != 0 and "give the command's --out" in refused.stderr


def test_the_plot_draws_each_arm_and_the_table_counts_the_ledgers_hours(tmp_path):
    def arm(name: str, rows: dict[str, dict[str, object]]) -> Path:
        run = tmp_path / name
        run.mkdir()
        (run / "rl.json").write_text(json.dumps({"versions": len(rows) - 1, "per_version": rows}))
        # two sessions of an hour, an hour apart: a version measured half an hour into the second took 1.5 h
        (run / "long-run.jsonl").write_text("".join(json.dumps(s) + "\n" for s in (
            {"start_s": 0, "end_s": 3600, "seconds": 3600}, {"start_s": 7200, "end_s": 10800, "seconds": 3600})))
        return run

    def row(passed: float | None, interval: list[float] | None, at: float) -> dict[str, object]:
        return {"validation_pass_at_1": passed, "validation_pass_at_1_interval_95": interval, "train_reward_mean": 0.125,
                "train_groups_with_signal_share": 0.5, "train_groups": 2, "validation_measured_at": at}

    grpo = arm("grpo", {"0": row(0.2, [0.05, 0.5], 600), "1": row(0.25, [0.05, 0.7], 9000)})
    distill = arm("distill", {"0": row(0.2, [0.05, 0.5], 600), "1": row(None, None, 0), "2": row(0.4, [0.1, 0.8], 10000)})
    png = tmp_path / "out" / "long.png"

    shown = bench("--plot", f"{grpo}=GRPO", f"{distill}=distillation", "--png", str(png))
    assert shown.returncode == 0, shown.stderr
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "**GRPO**" in shown.stdout and "**distillation**" in shown.stdout
    assert "| 1 | 0.250 [0.05, 0.70] | 0.125 | 0.50 of 2 | 1.50 |" in shown.stdout
    assert "| 0 | 0.200 [0.05, 0.50] | 0.125 | 0.50 of 2 | 0.17 |" in shown.stdout
    assert "| 1 |  | 0.125 | 0.50 of 2 |  |" in shown.stdout, "a version not measured: no figure, no hours"
    assert json.loads(png.with_suffix(".json").read_text())["distillation"][2]["hours"] == pytest.approx(1.0 + 2800 / 3600)

    # a figure measured elsewhere (the warm start's) drawn across; one not given as three numbers is refused by name
    with_reference = bench("--plot", f"{grpo}=GRPO", "--reference", "warm start=0.269,0.10,0.54", "--png", str(png))
    assert with_reference.returncode == 0, with_reference.stderr
    refused = bench("--plot", f"{grpo}=GRPO", "--reference", "warm start=0.269", "--png", str(png))
    assert refused.returncode != 0 and "LABEL=PASS_AT_1,LOW,HIGH" in refused.stderr

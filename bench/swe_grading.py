"""The coding recipe's grader and task builder: seconds per grading, tasks built per minute.

Grading: the grader on each task's gold patch (git inspects and builds the tree inside a fresh
bubblewrap sandbox, the policy, the ast scan, FAIL_TO_PASS + PASS_TO_PASS under the pinned pytest with
the outcome pipe), with the second opinion (each FAIL_TO_PASS test again in a sandbox of its own) and
without. Baseline, measured in the same run on the same tasks, interleaved: the same pytest run on the
same tree, on the host, outside any sandbox (the test run alone). The ratios are what isolation, the
parsed diff, the pinned run and the second opinion cost per grading.

Building: `build` with a fresh repos folder (sdist and test venv cached), tasks and candidates per
minute. Baseline: one bare run of the package's whole suite on the host, the work each candidate needs
at least once.

    uv run python -m bench.swe_grading [--tasks 4] [--against /path/to/another/checkout]

`--against` also grades each task with the grader of another checkout of the repository (e.g.
`git archive main | tar -x -C /tmp/base`), in a subprocess with that checkout first on `sys.path`,
interleaved with this one's gradings: the ratio of this grader to that one, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentstream.recipes.swe import repos, testrun
from agentstream.recipes.swe.build import TOOLZ, build, fetch_sdist
from agentstream.recipes.swe.grader import Grader
from agentstream.recipes.swe.instance import Instance
from bench.report import Report

AGAINST = """
import json, sys, time
from pathlib import Path
from agentstream.recipes.swe.grader import Grader
from agentstream.recipes.swe.instance import Instance
instance = Instance.model_validate_json(Path(sys.argv[1]).read_text())
grader = Grader(repos_dir=Path(sys.argv[2]), second_opinion=sys.argv[3] == "on")
began = time.perf_counter()
reward = grader.grade(instance, instance.patch).reward
print(json.dumps({"s": time.perf_counter() - began, "reward": reward}))
"""
"""one grading by another checkout's grader, timed inside its own process (its imports are not counted)"""


def graded_by(checkout: Path, instance: Instance, repos_dir: Path, second_opinion: bool) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        handle.write(instance.model_dump_json())
        handle.flush()
        done = subprocess.run([sys.executable, "-c", AGAINST, handle.name, str(repos_dir), "on" if second_opinion else "off"],
                              cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)}, capture_output=True,
                              text=True, check=True)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["reward"] == 1.0, answer
    return float(answer["s"])


def bare_run(instance: Instance, repos_dir: Path, env: Path, ids: list[str] | None) -> float:
    """The grading's test run (or the whole suite, ids=None) on the host, no sandbox."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        repos.checkout(repos.repo_path(repos_dir, instance.repo), instance.base_commit, tree)
        for patch in (instance.test_patch, instance.patch):
            subprocess.run(["git", "apply", "-"], cwd=tree, input=patch.encode(), check=True,
                           env={**os.environ, "GIT_CEILING_DIRECTORIES": scratch})
        command = testrun.pytest_command(env, ids or ())
        # the venv's .pth points at /workspace, which the host lacks: the tree goes on PYTHONPATH (-I off)
        command = command.replace(" -I ", " ")
        began = time.perf_counter()
        subprocess.run(command, shell=True, cwd=tree, capture_output=True, env={**os.environ, "PYTHONPATH": str(tree)})
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, default=4, help="tasks to grade (and to build)")
    parser.add_argument("--against", type=Path, help="another checkout whose grader is timed in the same run")
    args = parser.parse_args()
    report = Report("swe_grading")
    with tempfile.TemporaryDirectory(prefix="bench-swe-") as scratch:
        repos_dir = Path(scratch) / "repos"
        fetch_sdist(TOOLZ)  # cached once, like the test venv: not part of the build's rate
        env = testrun.ensure_env(repos.default_envs_dir() / repos.slug(TOOLZ.repo))
        began = time.perf_counter()
        built = build(limit=args.tasks, repos_dir=repos_dir, workers=2)
        build_s = time.perf_counter() - began
        instances = built.instances
        suite_bare = bare_run(instances[0], repos_dir, env, None)

        graders = {"second opinion on": Grader(repos_dir=repos_dir),
                   "second opinion off": Grader(repos_dir=repos_dir, second_opinion=False)}
        graded: dict[str, list[float]] = {name: [] for name in graders}
        against: dict[str, list[float]] = {name: [] for name in graders}
        bare: list[float] = []
        for n, instance in enumerate(instances):
            ids = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
            for name, grader in graders.items():
                if args.against and n % 2:  # the other grader first on every other task: neither always meets a cold cache
                    against[name].append(graded_by(args.against, instance, repos_dir, grader.second_opinion))
                began = time.perf_counter()
                result = grader.grade(instance, instance.patch)
                graded[name].append(time.perf_counter() - began)
                assert result.reward == 1.0, result.details
                if args.against and not n % 2:
                    against[name].append(graded_by(args.against, instance, repos_dir, grader.second_opinion))
                bare.append(bare_run(instance, repos_dir, env, ids))
    bare_s = statistics.median(bare)
    report.add("bare test run of one task (host, no sandbox), median", f"{bare_s:.2f} s", 1.0)
    for name, times in graded.items():
        grade_s = statistics.median(times)
        report.add(f"grading one task, {name} (gold patch), median", f"{grade_s:.2f} s", grade_s / bare_s)
        if against[name]:
            other_s = statistics.median(against[name])
            report.add(f"  the same by {args.against.name}'s grader, median (ratio: this one / that one)",
                       f"{other_s:.2f} s", grade_s / other_s)
    report.add("bare run of the whole toolz suite (host)", f"{suite_bare:.2f} s", 1.0)
    per_candidate = build_s / max(built.tried, 1)
    report.add("build: seconds per candidate tried (2 workers)", f"{per_candidate:.2f} s", per_candidate / suite_bare)
    report.add("build: tasks per minute", f"{len(instances) / build_s * 60:.1f}", None)
    report.add("build: candidates per minute", f"{built.tried / build_s * 60:.1f}", None)
    report.details.update(graded_s=graded, against_s=against, bare_s=bare, fail_to_pass=[len(i.FAIL_TO_PASS) for i in instances], build_s=build_s, tried=built.tried, kept=len(instances),
                          rejected=built.rejected, load_average=os.getloadavg())
    report.print("ratio vs. the bare run on the host in the same run")


if __name__ == "__main__":
    main()

"""`python -m agentstream.eval`: its settings, refused when they contradict each other, and the controller it runs
per evaluation, started with exactly the evaluation's settings (no broker needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic_settings import CliApp

from agentstream.controller.settings import ControllerSettings
from agentstream.eval import EvalSettings, Evaluator
from agentstream.schemas.kafka import KafkaSettings


def run_eval(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentstream.eval", "--tasks=t.jsonl", "--agent=a", "--model=m",
                           *flags], capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin"})


def test_contradicting_or_missing_settings_are_refused_with_the_flag_named():
    both = run_eval("--token-secret=s", "--follow", "--version=2")
    assert both.returncode == 2 and "--follow measures each as it appears" in both.stderr
    zero = run_eval("--token-secret=s", "--samples=0")
    assert zero.returncode == 2 and "--samples (AGENTSTREAM_SAMPLES) = '0': " in zero.stderr
    secretless = run_eval()
    assert secretless.returncode == 2 and "AGENTSTREAM_TOKEN_SECRET" in secretless.stderr


def test_each_evaluation_runs_a_controller_with_the_evals_settings(tmp_path):
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1", topic_prefix="run.")
    settings = EvalSettings(tasks=Path("v.jsonl"), agent="python -m agent", model="m", token_secret="-secret",
                            samples=4, out=tmp_path, agent_env={"AGENTSTREAM_SWE_STEP_LIMIT": "3"})
    controller = Evaluator(kafka, settings).controller(tmp_path / "validation.jsonl", "eval-m-v2-1")
    read = CliApp.run(ControllerSettings, cli_args=controller.argv()[3:])
    assert (read.validation_samples, read.samples, read.epochs, read.run_id) == (4, 1, 1, "eval-m-v2-1")
    assert (read.token_secret, read.topic_prefix, read.bootstrap_servers) == ("-secret", "run.", "127.0.0.1:1")
    assert read.shutdown_grace_s == 0 and not read.progress
    assert controller.env == {"AGENTSTREAM_SWE_STEP_LIMIT": "3"}, "the agents' environment reaches the controller"

    probe = settings.model_copy(update={"split": "train"})
    read = CliApp.run(ControllerSettings, cli_args=Evaluator(kafka, probe).controller(tmp_path / "t", "p").argv()[3:])
    assert (read.samples, read.validation_samples) == (4, 1)

"""Every entrypoint refuses a bad setting the same way: one line on stderr naming the setting (its flag, its
variable), the value given and why, exit code 2, no traceback (`schemas.flags.parse`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ENTRYPOINTS = {
    "gateway": (["-m", "agentstream.gateway", "--port=many"], "--port (AGENTSTREAM_PORT) = 'many': "),
    "streams": (["-m", "agentstream.streams", "worker", "--settle-s=soon"], "--settle-s (AGENTSTREAM_SETTLE_S) = 'soon': "),
    "controller": (["-m", "agentstream.controller", "--tasks=t.jsonl", "--agent=a", "--samples=-1"],
                   "--samples (AGENTSTREAM_SAMPLES) = '-1': "),
    "trainer": (["-m", "agentstream.trainer", "--lr=-1"], "--lr (AGENTSTREAM_LR) = '-1': Input should be greater than 0"),
    "releases": (["-m", "agentstream.releases", "--alpha=often"], "--alpha (AGENTSTREAM_ALPHA) = 'often': "),
    "dashboard": (["-m", "agentstream.dashboard", "--port=many"], "--port (AGENTSTREAM_PORT) = 'many': "),
    "eval": (["-m", "agentstream.eval", "--tasks=t.jsonl", "--agent=a", "--model=m", "--samples=0"],
             "--samples (AGENTSTREAM_SAMPLES) = '0': "),
    "an unknown flag": (["-m", "agentstream.trainer", "--learning-rate=1"], "unrecognized arguments: --learning-rate=1"),
    "a value that is not JSON": (["-m", "agentstream.trainer", "--source-weights={bad"], "source_weights"),
    "the demo": (["-m", "agentstream", "demo", "--trainer.lr=-1"], "--trainer.lr (AGENTSTREAM_LR) = '-1': "),
    "the production demo": (["-m", "agentstream", "demo", "--production", "--releases.alpha=often"],
                            "--releases.alpha (AGENTSTREAM_ALPHA) = 'often': "),
    "recipe swe": (["-m", "agentstream", "recipe", "swe", "--trainer.max-seq-len", "long"],
                   "--trainer.max-seq-len (AGENTSTREAM_MAX_SEQ_LEN) = 'long': "),
    "a preset's unknown service": (["-m", "agentstream", "demo", "--trainr.lr=1"], "--trainr.lr: "),
    "a preset's unknown setting": (["-m", "agentstream", "demo", "--trainer.learning-rate=1"],
                                   "unrecognized arguments: --trainer.learning-rate=1"),
}


@pytest.mark.parametrize("name", sorted(ENTRYPOINTS))
def test_a_bad_setting_is_one_line_naming_it_and_exit_2(name):
    args, said = ENTRYPOINTS[name]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AGENTSTREAM_", "KAFKA_"))}
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout

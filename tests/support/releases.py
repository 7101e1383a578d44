"""A release event as the releases service writes it, and that service as a process, for the releases' and the
dashboard's tests."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from agentstream.schemas.events import Release, ReleaseEvent
from agentstream.stack.process import spawn, stop_pid
from tests.support.streams import REPO

JUDGE_ARGS = ("--min-sessions", "5", "--alpha", "0.01", "--min-calls", "1000", "--interval-s", "1")
"""deterministic for the test: a decision once 5 sessions per arm have a reward. The error and latency guards
wait for more calls than the test makes: with 6-12 calls per arm a p95 is one call, such as a CPU server's slow
first answer after a weight load on a loaded machine. The guards are the rule's, tested in test_releases.py."""


def release(action: str, version: int = 2, started_at: int = 1000, **changes) -> ReleaseEvent:
    data = Release(model="tiny", action=action, version=version, uri=f"/ckpt/{version}", stable_version=1,
                   stable_uri="/ckpt/1", share_bp=2500, servers=["http://b"], started_at=started_at, **changes)
    return ReleaseEvent(source="test", data=data)


@dataclass
class Judge:
    """`python -m agentstream.releases` as a process."""

    kafka: object
    log: Path
    process: subprocess.Popen | None = None

    def start(self) -> Judge:
        self.process = spawn([sys.executable, "-m", "agentstream.releases", "--bootstrap-servers", self.kafka.bootstrap_servers,
                              "--topic-prefix", self.kafka.topic_prefix, *JUDGE_ARGS], self.log, cwd=REPO)
        return self

    def kill(self) -> None:
        """SIGKILL: no chance to finish anything (its state is the log)."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            stop_pid(self.process.pid, grace=10)

"""Trivial agents for the controller's tests: `python controller_agents.py MODE STATE_DIR`.

They talk to no gateway; they report what they were given and behave as the task input says:
  ok       print the environment the controller gave (JSON), exit 0
  fail     exit 3 with a message on stderr
  flaky    fail on a rollout's first attempt, succeed on the next
  hang     ignore SIGTERM, start a child that ignores it too, then hang on the first attempt
  block    on the first attempt, hang until killed; on later attempts exit 0
Each run appends "rollout attempt pid [child_pid]" to STATE_DIR/runs.log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "AGENTSTREAM_ROLLOUT_ID", "AGENTSTREAM_ATTEMPT_ID", "AGENTSTREAM_TASK",
       "AGENTSTREAM_REWARD_URL", "AGENTSTREAM_MODEL")


def first_time(state: Path, rollout: str) -> bool:
    marker = state / f"seen-{rollout}"
    if marker.exists():
        return False
    marker.touch()
    return True


def hang_forever() -> None:
    while True:
        time.sleep(3600)


def main() -> int:
    state = Path(sys.argv[1])
    task = json.loads(Path(os.environ["AGENTSTREAM_TASK"]).read_text())
    mode = task["mode"] if isinstance(task, dict) else "ok"
    rollout, attempt = os.environ["AGENTSTREAM_ROLLOUT_ID"], os.environ["AGENTSTREAM_ATTEMPT_ID"]
    child = None
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen(["/bin/sh", "-c", "trap '' TERM; while true; do sleep 1; done"])
    with (state / "runs.log").open("a") as runs:
        runs.write(f"{rollout} {attempt} {os.getpid()}{f' {child.pid}' if child else ''}\n")
    print(json.dumps({"env": {name: os.environ.get(name) for name in ENV}, "task": task}))
    sys.stdout.flush()
    if mode == "fail" or (mode == "flaky" and first_time(state, rollout)):
        print(f"failing on purpose ({mode})", file=sys.stderr)
        return 3
    if mode in ("hang", "block") and first_time(state, rollout):
        hang_forever()
    if mode == "slow":
        time.sleep(float(task.get("seconds", 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The agent of `bench.cluster_chaos`: a few streamed chat calls through the gateway, then a reward.

It notes each call it saw answered (status 200 and the stream's `[DONE]`) as `call_id attempt_id unix_time`
in `SEEN_DIR/<attempt>.log`, the count the run checks the calls topic against. A call that fails (its
gateway killed, a broker moving) is made again, up to `AGENT_TRIES` times, as an agent's SDK would.

    python -m bench.cluster_agent SEEN_DIR      (the controller gives it OPENAI_BASE_URL and OPENAI_API_KEY)
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import httpx

CALLS = 3
TRIES = int(os.environ.get("AGENT_TRIES", "20"))


def main() -> int:
    seen = Path(sys.argv[1]) / f"{os.environ['AGENTSTREAM_ATTEMPT_ID']}.log"
    seen.parent.mkdir(parents=True, exist_ok=True)
    headers = {"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    with httpx.Client(base_url=os.environ["OPENAI_BASE_URL"], headers=headers, timeout=60) as http:
        for turn in range(CALLS):
            if not call(http, seen, turn):
                return 1
    return 0 if rewarded(headers) else 1


def call(http: httpx.Client, seen: Path, turn: int) -> bool:
    request = {"model": "tiny", "messages": [{"role": "user", "content": f"turn {turn}"}], "max_tokens": 8,
               "stream": True}
    for _ in range(TRIES):
        try:
            with http.stream("POST", "/chat/completions", json=request) as response:
                body = response.read().decode()
                answered = response.status_code == 200 and "[DONE]" in body
                call_id = response.headers.get("x-agentstream-call-id")
        except httpx.HTTPError:
            answered = False
        if answered and call_id:
            with open(seen, "a") as out:
                out.write(f"{call_id} {os.environ['AGENTSTREAM_ATTEMPT_ID']} {time.time():.3f}\n")
            return True
        time.sleep(0.5)  # a replica or broker is down: the next try reaches another
    return False


def rewarded(headers: dict[str, str]) -> bool:
    """The reward posted (again, if its gateway died first: a reward posted twice is the same fact twice)."""
    for _ in range(TRIES):
        try:
            if httpx.post(os.environ["AGENTSTREAM_REWARD_URL"], headers=headers, timeout=60,
                          json={"value": random.random()}).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


if __name__ == "__main__":
    sys.exit(main())

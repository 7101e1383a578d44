"""Simulated production users: each opens a session, asks one question, leaves, and rates the answer later.

An ordinary OpenAI-SDK program, talking to the plain `/v1` of an OpenAI-compatible server (the gateway)
with a session header, plus the gateway's session endpoints for the end and the feedback:
  OPENAI_BASE_URL, OPENAI_API_KEY  read by the SDK (the gateway's /v1 and an operator key)
  AGENTSTREAM_MODEL                the model to ask (else the first the server lists)

The users like answers written in `--preferred` characters (digits by default): a user's score is the
share of the answer's characters that are such (as `streams.rewards:character_share` scores the tiny
demo's rollouts), sent as `score` with thumbs up at 0.5 or more. A model that does not answer in digits
yet is rated low, so what it learns from the feedback is the users' preference. The feedback comes after
the session ended: most of it within `--delay-s`, a `--late-share` of it after `--late-delay-s`.

  python examples/production_users.py --tasks examples/arithmetic_tasks.jsonl --concurrency 4 --rate 1.5
Each session is a JSON line on stdout; runs until `--sessions` were rated (0: until stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import uuid
from collections.abc import Iterator

import httpx
from openai import AsyncOpenAI, OpenAIError

SESSION_HEADER = "x-agentstream-session-id"


def preference(answer: str, preferred: str) -> float:
    """The share of the answer's characters the user likes (0 for an empty answer)."""
    return sum(ch in preferred for ch in answer) / len(answer) if answer else 0.0


def prompts_of(path: str) -> list[str]:
    with open(path) as file:
        tasks = [json.loads(line) for line in file if line.strip()]
    return [task["input"]["prompt"] if isinstance(task.get("input"), dict) else str(task["input"]) for task in tasks]


class Users:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.random = random.Random(args.seed)
        self.base_url = os.environ["OPENAI_BASE_URL"].rstrip("/")
        self.site = httpx.AsyncClient(base_url=self.base_url.removesuffix("/v1"), timeout=60,
                                      headers={"authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
        self.prompts = prompts_of(args.tasks)
        self.rated = 0
        self.next_arrival = 0.0
        self.feedback: set[asyncio.Task[None]] = set()

    async def session(self, number: int) -> None:
        """One user: a question in a session of its own, the end of the session, the rating later."""
        session_id = f"user-{number}-{uuid.uuid4()}"
        client = AsyncOpenAI(max_retries=2, default_headers={SESSION_HEADER: session_id})
        try:
            model = os.environ.get("AGENTSTREAM_MODEL") or (await client.models.list()).data[0].id
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": self.random.choice(self.prompts)}],
                max_tokens=self.args.max_tokens, temperature=1.0)
        except OpenAIError as exc:  # the user goes away unanswered; the next one comes
            print(json.dumps({"session": session_id, "error": str(exc)}), flush=True)
            return
        finally:
            await client.close()
        (await self.site.post(f"/sessions/{session_id}/end", json={})).raise_for_status()
        answer = reply.choices[0].message.content or ""
        late = self.random.random() < self.args.late_share
        delay = self.args.late_delay_s if late else self.random.uniform(0, self.args.delay_s)
        task = asyncio.create_task(self.rate(session_id, f"u-{number}", answer, delay, late))
        self.feedback.add(task)
        task.add_done_callback(self.feedback.discard)

    async def rate(self, session_id: str, user: str, answer: str, delay: float, late: bool) -> None:
        await asyncio.sleep(delay)  # the user takes their time
        score = preference(answer, self.args.preferred)
        body = {"score": score, "thumbs": "up" if score >= 0.5 else "down", "user": user, "id": "rating"}
        (await self.site.post(f"/sessions/{session_id}/feedback", json=body)).raise_for_status()
        self.rated += 1
        print(json.dumps({"session": session_id, "answer": answer, "score": round(score, 3),
                          "delay_s": round(delay, 2), "late": late}), flush=True)

    async def arrival(self) -> None:
        """Wait for the next user's turn: arrivals at `--rate` per second on average (a Poisson stream), never
        in a burst to catch up."""
        if not self.args.rate:
            return
        now = asyncio.get_running_loop().time()
        self.next_arrival = max(self.next_arrival, now) + self.random.expovariate(self.args.rate)
        await asyncio.sleep(self.next_arrival - now)

    async def user(self, numbers: Iterator[int]) -> None:
        for number in numbers:
            if self.args.sessions and self.rated >= self.args.sessions:
                return
            await self.arrival()
            await self.session(number)

    async def run(self) -> None:
        numbers = iter(range(10**9))
        await asyncio.gather(*(self.user(numbers) for _ in range(self.args.concurrency)))
        await asyncio.gather(*self.feedback)
        await self.site.aclose()


def parser() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_argument("--tasks", required=True, help="JSONL of tasks: their input prompts are the questions")
    flags.add_argument("--concurrency", type=int, default=4, help="users at once (at most)")
    flags.add_argument("--rate", type=float, default=0.0, help="new users per second (0: as fast as answered)")
    flags.add_argument("--sessions", type=int, default=0, help="stop after this many rated sessions (0: never)")
    flags.add_argument("--max-tokens", type=int, default=8)
    flags.add_argument("--preferred", default="0123456789", help="the characters users like answers written in")
    flags.add_argument("--delay-s", type=float, default=2.0, help="feedback comes up to this long after the end")
    flags.add_argument("--late-share", type=float, default=0.1, help="share of the users who rate much later")
    flags.add_argument("--late-delay-s", type=float, default=15.0, help="how much later")
    flags.add_argument("--seed", type=int, default=0, help="seeds the users' choices (not the model's sampling)")
    return flags


def main() -> int:
    try:
        asyncio.run(Users(parser().parse_args()).run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

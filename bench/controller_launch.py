"""Controller throughput: attempts per second through the controller vs bare process spawning.

Baseline, measured in the same run: the same number of `/bin/sh -c true` processes, each in its
own session with output to files, spawned and awaited with the same concurrency and no Kafka.
The controller adds per attempt: three acknowledged events (queued, started, finished), a task
file, a token, and killing the finished attempt's process group.

    uv run python -m bench.controller_launch [--rollouts 200] [--concurrency 8]
(uses KAFKA_BOOTSTRAP_SERVERS if set, else starts a throwaway local broker)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

from agentstream.controller.controller import Controller
from agentstream.controller.settings import ControllerSettings
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import free_port


async def bare_spawns(count: int, concurrency: int, folder: Path) -> float:
    slots = asyncio.Semaphore(concurrency)

    async def one(n: int) -> None:
        async with slots:
            with open(folder / f"{n}.out", "wb") as out, open(folder / f"{n}.err", "wb") as err:
                process = await asyncio.create_subprocess_exec("/bin/sh", "-c", "true", stdout=out, stderr=err,
                                                               start_new_session=True)
            await process.wait()

    began = time.perf_counter()
    await asyncio.gather(*(one(n) for n in range(count)))
    return time.perf_counter() - began


async def controller_run(count: int, concurrency: int, folder: Path, bootstrap: str) -> float:
    tasks = folder / "tasks.jsonl"
    tasks.write_text("".join(f'{{"id": "t{n}", "input": {n}}}\n' for n in range(count)))
    settings = ControllerSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:8]}.",
                                  tasks=tasks, agent="true", concurrency=concurrency, token_secret="bench",
                                  logs_dir=folder / "logs", progress=False)
    controller = Controller(settings)
    began = time.perf_counter()
    summary = await controller.run()
    elapsed = time.perf_counter() - began
    assert summary.done == count, summary
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        broker = None
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            broker = LocalKafka(root / "kafka")
            bootstrap = broker.start(port=free_port(), say=lambda _: None).url
        try:
            (root / "bare").mkdir()
            bare = await bare_spawns(args.rollouts, args.concurrency, root / "bare")
            (root / "one").mkdir()
            fixed = await controller_run(1, args.concurrency, root / "one", bootstrap)
            managed = await controller_run(args.rollouts, args.concurrency, root, bootstrap)
        finally:
            if broker:
                broker.stop()
    n = args.rollouts
    print(f"{n} attempts at concurrency {args.concurrency}")
    print(f"  bare spawn:  {n / bare:7.1f} /s  ({bare / n * 1000:6.2f} ms each)")
    marginal = (managed - fixed) / (n - 1)
    print(f"  controller:  {n / managed:7.1f} /s  ({managed / n * 1000:6.2f} ms each, incl. start-up)")
    print(f"  start-up (topics, recovery read, weights catch-up, one attempt): {fixed:.2f} s")
    print(f"  marginal:    {1 / marginal:7.1f} /s  ({marginal * 1000:6.2f} ms each)")
    print(f"  ratio controller/bare time: {managed / bare:.2f}x overall, {marginal * n / bare:.2f}x marginal")


if __name__ == "__main__":
    asyncio.run(main())

"""Partial rollouts (#47 item 4): rollout throughput and weight-update latency with the gateway's
`--partial-rollouts` against the default (an update waits for the calls in flight), same run, same server.

One vLLM-CPU server with the tiny model, one broker, two gateways on it (one per mode, each with its own
topics). Phases alternate between the modes (hold, partial, hold, partial, …): in each, `--agents` agents
call back to back through the phase's gateway, streamed, with answers of a long-tailed length (most short,
some long: `LENGTHS`, the same seeded sequence in every phase), while a trainer stand-in publishes a new
checkpoint every `--update-every` seconds (the two checkpoints in turn). Measured per mode:

- rollout throughput: completion tokens the agents received per second over the phases;
- update latency: from the `weights` event to the server serving it, as the applying gateway measures it
  (`PoolUpdate.held_ms`: the drain, then pause → reload → resume), and the reload alone (`pause_ms`);
- how many calls went on across an update (their events carry `weight_segments`).

    uv run python -m bench.partial_rollouts [--phases 4] [--seconds 75] [--agents 4] [--update-every 15]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from agentstream.schemas.codec import decode
from agentstream.schemas.events import CallEvent, Event, PoolUpdateEvent, Weights, WeightsEvent
from agentstream.schemas.kafka import (
    KafkaSettings,
    Publisher,
    ensure_topics,
    make_producer,
)
from agentstream.schemas.scan import Bounds, resolve, scan
from agentstream.stack.process import free_port, spawn, stop_pid
from bench.gateway_overhead import KEY, await_http, kafka_broker
from bench.report import Report

LENGTHS = (16, 16, 16, 32, 32, 64, 128, 512)
"""answer lengths (tokens) drawn from, seeded: most answers short, one in eight long, as agents' turns are"""
MODES = ("hold", "partial")


@dataclass
class Phase:
    mode: str
    seconds: float
    tokens: int = 0
    calls: int = 0
    updates: list[int] = field(default_factory=list)
    """the versions published in this phase"""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


async def agent(url: str, phase: Phase, seed: int, until: float) -> None:
    """Streamed calls back to back until `until` (monotonic); every token received counts while the phase runs."""
    lengths = random.Random(seed)
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        while time.monotonic() < until:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"story {lengths.random()}"}],
                    "max_tokens": lengths.choice(LENGTHS), "temperature": 1.0, "stream": True, "ignore_eos": True,
                    "return_token_ids": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                # split on b"\n" only: the tiny model's characters include ones str.splitlines breaks at
                pending = b""
                async for data in response.aiter_bytes():
                    *lines, pending = (pending + data).split(b"\n")
                    for line in lines:
                        if not line.startswith(b"data: {"):
                            continue
                        choices = orjson.loads(line[6:]).get("choices") or []
                        if choices and time.monotonic() < until:
                            phase.tokens += len(choices[0].get("token_ids") or [])
            phase.calls += 1


async def trainer(kafka: KafkaSettings, checkpoints: list[Path], versions: list[int], phase: Phase, every: float,
                  until: float) -> None:
    """Publish the next checkpoint every `every` seconds while the phase runs."""
    producer = make_producer(kafka)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka.topics)
        while time.monotonic() + every < until:
            await asyncio.sleep(every)
            versions[0] += 1
            version = versions[0]
            await publisher.publish(WeightsEvent(source="bench", data=Weights(
                model="tiny", version=version, uri=str(checkpoints[version % 2]), step=version)))
            phase.updates.append(version)
    finally:
        await producer.stop()


async def run_phase(url: str, kafka: KafkaSettings, phase: Phase, args: argparse.Namespace, checkpoints: list[Path],
                    versions: list[int]) -> None:
    started = time.monotonic()
    until = started + phase.seconds
    await asyncio.gather(trainer(kafka, checkpoints, versions, phase, args.update_every, until),
                         *(agent(url, phase, seed, until) for seed in range(args.agents)))


async def run(args: argparse.Namespace) -> Report:
    from agentstream.models.tiny_model import build_tiny_model
    from agentstream.stack.vllm import LocalVLLM

    report = Report("partial_rollouts")
    with tempfile.TemporaryDirectory(prefix="bench-partial-") as tmp, kafka_broker(Path(tmp)) as (bootstrap, _):
        work = Path(tmp)
        checkpoints = [build_tiny_model(work / "tiny-0", seed=0), build_tiny_model(work / "tiny-1", seed=1)]
        server = LocalVLLM(name=f"bench-partial-{os.getpid()}")
        gateways: dict[str, tuple[str, KafkaSettings]] = {}
        pids: list[int] = []
        try:
            state = server.start(checkpoints[0], served_name="tiny", timeout=1200)
            for mode in MODES:
                kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench-{mode}-{os.getpid()}.")
                assert (await ensure_topics(kafka)).ok
                port = free_port()
                log = work / f"gateway-{mode}.log"
                proc = spawn([sys.executable, "-m", "agentstream.gateway", "--port", str(port), "--upstreams",
                              f"tiny={state.url}", "--no-create-topics", "--log-level", "warning",
                              "--drain-timeout-s", str(args.drain_timeout_s),
                              *(["--partial-rollouts"] if mode == "partial" else [])], log,
                             env={"KAFKA_BOOTSTRAP_SERVERS": bootstrap, "AGENTSTREAM_API_KEYS": f'["{KEY}"]',
                                  "AGENTSTREAM_TOPIC_PREFIX": kafka.topic_prefix})
                pids.append(proc.pid)
                await_http(f"http://127.0.0.1:{port}/healthz", proc, log)
                gateways[mode] = (f"http://127.0.0.1:{port}", kafka)
            versions = [0]
            phases = []
            for number in range(args.phases):
                mode = MODES[number % 2]
                phase = Phase(mode, args.seconds)
                url, kafka = gateways[mode]
                await run_phase(url, kafka, phase, args, checkpoints, versions)
                print(f"phase {number + 1}/{args.phases} ({mode}): {phase.tokens_per_s:.0f} tok/s, {phase.calls} calls, "
                      f"updates {phase.updates}", flush=True)
                phases.append(phase)
            results = {mode: await outcome(gateways[mode][1], [p for p in phases if p.mode == mode]) for mode in MODES}
        finally:
            for pid in pids:
                stop_pid(pid, grace=10)
            server.stop()
    hold, partial = results["hold"], results["partial"]
    report.add(f"rollout throughput, {args.agents} agents, updates every {args.update_every:g} s, hold (baseline)",
               f"{hold['tokens_per_s']:.0f} tok/s")
    report.add("rollout throughput, partial rollouts", f"{partial['tokens_per_s']:.0f} tok/s",
               partial["tokens_per_s"] / hold["tokens_per_s"])
    report.add("update latency p50 (weights event → served: drain + reload), hold (baseline)",
               f"{hold['held_ms_p50']:.0f} ms")
    report.add("update latency p50, partial rollouts", f"{partial['held_ms_p50']:.0f} ms",
               partial["held_ms_p50"] / hold["held_ms_p50"])
    report.add("update latency max, hold / partial", f"{hold['held_ms_max']:.0f} / {partial['held_ms_max']:.0f} ms",
               partial["held_ms_max"] / hold["held_ms_max"])
    report.add("reload alone (pause → resume) p50, hold / partial",
               f"{hold['pause_ms_p50']:.0f} / {partial['pause_ms_p50']:.0f} ms")
    report.add("calls that went on across an update (weight_segments), hold / partial",
               f"{hold['segmented_calls']} / {partial['segmented_calls']} of {hold['calls']} / {partial['calls']}")
    report.details.update(results=results, args=vars(args), load_after=os.getloadavg()[0])
    return report


async def outcome(kafka: KafkaSettings, phases: list[Phase]) -> dict[str, Any]:
    """One mode's figures over its phases, from what the agents received and what its gateway recorded."""
    updates = [e.data for e in await read_events_of(kafka, kafka.topics.pool) if isinstance(e, PoolUpdateEvent)
               and e.data.status == "ok"]
    calls = [e.data for e in await read_events_of(kafka, kafka.topics.calls) if isinstance(e, CallEvent)]
    held = [update.held_ms or 0.0 for update in updates]
    return {
        "tokens_per_s": sum(p.tokens for p in phases) / sum(p.seconds for p in phases),
        "updates": len(updates),
        "held_ms_p50": statistics.median(held), "held_ms_max": max(held),
        "pause_ms_p50": statistics.median(update.pause_ms for update in updates),
        "held_ms": held,
        "calls": len(calls),
        "segmented_calls": sum(1 for call in calls if call.weight_segments),
    }


async def read_events_of(kafka: KafkaSettings, topic: str) -> list[Event]:
    """Every event of `topic`, from its beginning to its end now (the one bounded reader, `schemas.scan`)."""
    log = await resolve(kafka, topic)
    return [decode(record.value) async for records in scan(kafka, topic, Bounds.exactly(log, sorted(log)))
            for record in records if record.value is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", type=int, default=4, help="phases, alternating hold and partial")
    parser.add_argument("--seconds", type=float, default=75.0, help="length of each phase")
    parser.add_argument("--agents", type=int, default=4, help="concurrent agents")
    parser.add_argument("--update-every", type=float, default=15.0, help="seconds between weight updates")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0, help="the gateways' drain bound")
    report = asyncio.run(run(parser.parse_args(argv)))
    report.print()


if __name__ == "__main__":
    main()

"""Gateway overhead: latency it adds over calling the upstream directly, and calls per second.

Starts a Kafka broker (or uses KAFKA_BOOTSTRAP_SERVERS), two fake upstreams
(`bench.fake_upstream`) and two gateways (`python -m agentstream.gateway`, training mode): one with
durable publishing (`ack`, the default) and one with `async`. At each concurrency level the same
client calls the upstream directly and through each gateway, in alternating rounds in the same
run, and reports p50/p99 and the difference. Then the most calls per second each sustains, and
the CPU each gateway (and a local broker) spends per call. At the end it checks that every call
made through the gateways is in Kafka.

Two upstreams, two questions. `tiny` answers at once: the clients call back to back, so at 16
and 64 clients the machine (2 cores shared by client, upstream, gateway and Kafka) is saturated,
and the added latency is mostly queueing for the CPU, about clients × (the CPU a call through
the gateway costs more) / cores. `paced` answers after `--paced-ms` without using the CPU, as a
model does (real ones take far longer): clients call at an agent's pace, and the added latency is
the gateway's own. Both are the same gateway process, routing by model name.

With `--baseline DIR` (a checkout of another version, e.g. `git worktree add /tmp/base main`), a third
gateway, `ack-baseline`, runs that version's code in `ack` mode, measured in the same alternating
rounds: before and after a change, in the same run.

    python -m bench.gateway_overhead [--seconds 4] [--levels 1,16,64] [--paced-ms 20] [--baseline DIR]
                                     [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import orjson
from rich.console import Console
from rich.table import Table

from agentstream.schemas.kafka import KafkaSettings, ensure_topics, make_consumer, partitions_of
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.process import free_port, stop_pid

console = Console()
ROOT = Path(__file__).parent.parent
KEY = "bench-key"
BODY = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 16})
STREAM_BODY = orjson.dumps({**orjson.loads(BODY), "stream": True})
PACED_BODY = orjson.dumps({**orjson.loads(BODY), "model": "paced"})


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)


def await_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited while starting; log ({log}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s; log: {log}")


@contextlib.contextmanager
def kafka_broker(workdir: Path):
    """(bootstrap servers, the broker's pid when it is ours to measure)"""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"], None
        return
    broker = LocalKafka(workdir / "kafka")
    with console.status("Starting Kafka…"):
        state = broker.start(port=free_port(), say=lambda message: None)
    try:
        yield state.url, state.pid
    finally:
        broker.stop()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(url: str, clients: int, seconds: float, body: bytes, streamed: bool = False) -> list[float]:
    """Latencies (s) of back-to-back calls from `clients` concurrent clients for `seconds`."""
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=clients, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as response:
                    payload = await response.read()
                    if response.status != 200 or (streamed and not payload.endswith(b"data: [DONE]\n\n")):
                        raise SystemExit(f"{url} answered {response.status}: {payload[:300]!r}")
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def end_offset_total(kafka: KafkaSettings, topic: str) -> int:
    consumer = make_consumer(kafka, group_id=None)
    await consumer.start()
    try:
        return sum((await consumer.end_offsets(await partitions_of(kafka, topic))).values())
    finally:
        await consumer.stop()


async def compare(targets: dict[str, str], levels: list[int], args: argparse.Namespace, body: bytes,
                  made: dict[str, int]) -> dict:
    """p50/p99 per target and level, and each gateway's difference to calling the upstream directly."""
    results = {}
    for clients in levels:
        samples: dict[str, list[float]] = {name: [] for name in targets}
        for _ in range(args.rounds):  # alternate, so drift in the machine's load hits all alike
            for name, url in targets.items():
                got = await measure(f"{url}/v1/chat/completions", clients, args.seconds / args.rounds, body)
                samples[name] += got
                made[name] += len(got)
        level = {name: {"p50_ms": percentile(v, 0.5) * 1000, "p99_ms": percentile(v, 0.99) * 1000,
                        "calls": len(v), "calls_per_s": len(v) / args.seconds} for name, v in samples.items()}
        gateways = [name for name in targets if name != "direct"]
        for mode in gateways:
            level[mode]["added_p50_ms"] = level[mode]["p50_ms"] - level["direct"]["p50_ms"]
            level[mode]["added_p99_ms"] = level[mode]["p99_ms"] - level["direct"]["p99_ms"]
        results[clients] = level
        console.print(f"{clients:>3} clients: direct p50 {level['direct']['p50_ms']:.2f} ms; " + "; ".join(
            f"{mode} +{level[mode]['added_p50_ms']:.2f} ms p50, +{level[mode]['added_p99_ms']:.2f} ms p99"
            for mode in gateways))
    return results


async def run(args: argparse.Namespace) -> dict:
    results: dict = {"levels": {}, "paced": {}, "throughput": {}, "cpu_ms_per_call": {}, "cpus": os.cpu_count(),
                     "paced_ms": args.paced_ms, "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp, kafka_broker(Path(tmp)) as (bootstrap, broker):
        work = Path(tmp)
        fast, paced = free_port(), free_port()
        procs = [spawn([sys.executable, "-m", "bench.fake_upstream", "--port", str(fast)], work / "upstream.log"),
                 spawn([sys.executable, "-m", "bench.fake_upstream", "--port", str(paced), "--delay-ms", str(args.paced_ms)],
                       work / "paced.log")]
        upstream, paced_upstream = f"http://127.0.0.1:{fast}", f"http://127.0.0.1:{paced}"
        gateways: dict[str, tuple[str, KafkaSettings, int]] = {}
        try:
            await_http(f"{upstream}/health", procs[0], work / "upstream.log")
            await_http(f"{paced_upstream}/health", procs[1], work / "paced.log")
            gateway = [sys.executable, "-m", "agentstream.gateway"]
            modes = {"ack": (ROOT, gateway), "async": (ROOT, gateway),
                     **({"ack-baseline": (args.baseline, shlex.split(args.baseline_gateway))} if args.baseline else {})}
            for mode, (root, command) in modes.items():
                kafka = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"bench-{mode}-{os.getpid()}.")
                assert (await ensure_topics(kafka)).ok
                port = free_port()
                log = work / f"gateway-{mode}.log"
                procs.append(spawn([*command, "--port", str(port), "--upstreams",
                                    f"tiny={upstream},paced={paced_upstream}", "--durability", mode.split("-")[0],
                                    "--no-create-topics", "--log-level", "warning"], log,
                                   env={"KAFKA_BOOTSTRAP_SERVERS": bootstrap, "AGENTSTREAM_API_KEYS": f'["{KEY}"]',
                                        "AGENTSTREAM_TOPIC_PREFIX": kafka.topic_prefix}, cwd=root))
                await_http(f"http://127.0.0.1:{port}/healthz", procs[-1], log)
                gateways[mode] = (f"http://127.0.0.1:{port}", kafka, procs[-1].pid)

            targets = {"direct": upstream, **{mode: url for mode, (url, _, _) in gateways.items()}}
            made = {name: 0 for name in targets}
            for name, url in targets.items():  # warm up connections and caches
                made[name] += len(await measure(f"{url}/v1/chat/completions", 16, 1.0, BODY))

            console.print("[bold]upstream answering at once[/bold] (clients call back to back)")
            results["levels"] = await compare(targets, args.levels, args, BODY, made)
            console.print(f"[bold]upstream answering after {args.paced_ms:g} ms[/bold] (clients at a model's pace)")
            results["paced"] = await compare({**targets, "direct": paced_upstream}, args.levels, args, PACED_BODY,
                                             made)

            stream = {name: await measure(f"{url}/v1/chat/completions", 16, args.seconds / 2, STREAM_BODY, True)
                      for name, url in targets.items()}
            for name in targets:
                made[name] += len(stream[name])
            results["stream_16"] = {name: {"p50_ms": percentile(v, 0.5) * 1000, "p99_ms": percentile(v, 0.99) * 1000}
                                    for name, v in stream.items()}

            for name, url in targets.items():
                pids = {"gateway": gateways[name][2], "kafka": broker} if name in gateways else {}
                before = {part: cpu_seconds(pid) for part, pid in pids.items() if pid}
                got = await measure(f"{url}/v1/chat/completions", args.throughput_clients, args.seconds, BODY)
                made[name] += len(got)
                results["throughput"][name] = len(got) / args.seconds
                if before:
                    results["cpu_ms_per_call"][name] = {
                        part: (cpu_seconds(pids[part]) - used) * 1000 / len(got) for part, used in before.items()}
                console.print(f"max throughput {name}: {len(got) / args.seconds:,.0f} calls/s")

            for mode, (_, kafka, _) in gateways.items():
                recorded = await end_offset_total(kafka, kafka.topics.calls)
                deadline = time.monotonic() + 15
                while mode == "async" and recorded < made[mode] and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)  # async mode acknowledges later: give its last events a moment
                    recorded = await end_offset_total(kafka, kafka.topics.calls)
                results.setdefault("recorded", {})[mode] = {"calls": made[mode], "events": recorded}
                if mode.startswith("ack") and recorded != made[mode]:
                    raise SystemExit(f"durable gateway: {made[mode]} calls answered but {recorded} events in Kafka")
        finally:
            for proc in procs:
                stop_pid(proc.pid, grace=20)
    results["load_after"] = os.getloadavg()[0]
    return results


def latency_table(title: str, levels: dict) -> Table:
    table = Table(title=title)
    modes = [mode for mode in next(iter(levels.values())) if mode != "direct"]
    for column in ("clients", "direct p50", "direct p99", *(f"{mode} +{q}" for mode in modes for q in ("p50", "p99"))):
        table.add_column(column, justify="right")
    for clients, level in levels.items():
        table.add_row(str(clients), f"{level['direct']['p50_ms']:.2f} ms", f"{level['direct']['p99_ms']:.2f} ms",
                      *(f"{level[mode][key]:+.2f} ms" for mode in modes for key in ("added_p50_ms", "added_p99_ms")))
    return table


def report(results: dict) -> None:
    console.print(latency_table("Gateway overhead, upstream answering at once (chat completions, 16 tokens, "
                                "training mode)", results["levels"]))
    console.print(latency_table(f"Gateway overhead, upstream answering after {results['paced_ms']:g} ms",
                                results["paced"]))
    stream = results["stream_16"]
    console.print("streamed, 16 clients: " + ", ".join(
        f"{name} p50 {value['p50_ms']:.2f} ms p99 {value['p99_ms']:.2f} ms" for name, value in stream.items()))
    throughput = results["throughput"]
    console.print("max calls/s: " + ", ".join(f"{name} {value:,.0f}" for name, value in throughput.items()) +
                  f" (ack gateway = {throughput['ack'] / throughput['direct']:.2f}x direct)")
    console.print("CPU per call at max calls/s: " + "; ".join(
        f"{mode}: " + ", ".join(f"{part} {ms:.3f} ms" for part, ms in parts.items())
        for mode, parts in results["cpu_ms_per_call"].items()))
    if "ack-baseline" in throughput:
        cpu = results["cpu_ms_per_call"]
        console.print(f"ack against its baseline: max calls/s {throughput['ack'] / throughput['ack-baseline']:.2f}x, "
                      f"gateway CPU per call {cpu['ack']['gateway'] / cpu['ack-baseline']['gateway']:.2f}x")
    console.print("recorded: " + ", ".join(f"{mode} {v['events']}/{v['calls']}" for mode, v in results["recorded"].items()))
    console.print(f"load average before/after: {results['load_before']:.1f}/{results['load_after']:.1f} "
                  f"on {results['cpus']} CPUs (the client, upstreams, gateways and Kafka share them)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per target and level")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per level")
    parser.add_argument("--levels", type=lambda text: [int(x) for x in text.split(",")], default=[1, 16, 64])
    parser.add_argument("--throughput-clients", type=int, default=64)
    parser.add_argument("--paced-ms", type=float, default=20.0, help="the paced upstream's service time")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--baseline", type=Path, help="a checkout of another version: its gateway runs too, as "
                        "'ack-baseline', in the same rounds")
    parser.add_argument("--baseline-gateway", default=f"{sys.executable} -m agentstream.gateway",
                        help="the command that runs the baseline's gateway in its checkout (e.g. its own venv's "
                             "python, and the module by the name that version gives it)")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    report(results)
    if args.json:
        args.json.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


if __name__ == "__main__":
    main()

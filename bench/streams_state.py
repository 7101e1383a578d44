"""The streams worker's state against days of sessions: its memory and its recovery after kill -9, with the
table in memory (`--store memory`, the baseline) and on disk (`--store rocksdb`), in the same run.

For each `--days` D, the log gets D days of synthetic sessions (`--sessions-per-day`, each three calls of
about `--call-kb` KiB (prompt and completion token ids, logprobs), feedback about the last one, the
client's end), timed over the D days before now: what a worker holds for revisions under the default 30-day
`--session-retention-s`. Then each store's worker (an app id of its own, so a changelog of its own) reads it
all (every session settles into a trajectory); once its state is written, its resident memory is read,
it is killed -9 and started again, and the time until its table is recovered (from the spawn: the process's
start too) and its resident memory then (and its peak, VmHWM) are read.

    uv run python -m bench.streams_state [--days 1 3 10 30] [--sessions-per-day 100] [--call-kb 8]
        [--state-memory-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console

import agentstream.schemas as s
from agentstream.schemas.kafka import KafkaSettings, make_producer
from agentstream.schemas.sessions import session_rollout_id
from agentstream.stack.process import free_port, spawn, tail
from bench.report import Report
from bench.streams_assembly import ROOT, fresh_topics, kafka_broker

console = Console()
DAY_MS = 24 * 3600 * 1000
STORES = ("memory", "rocksdb")


def conversation(i: int, start: int, call_kb: int) -> list[s.Event]:
    """A session of three calls (~`call_kb` KiB each), feedback about the last, and the client's end."""
    session_id = f"chat-{i}"
    ids = dict(rollout_id=session_rollout_id(session_id), source="bench")
    prompt = [(i + n) % 50_000 for n in range(call_kb * 1024 // 8)]  # ~6 bytes a token id in JSON, 8 with logprobs
    calls = []
    for turn in range(3):
        completion = [(i * 7 + turn + n) % 50_000 for n in range(64)]
        calls.append(s.CallEvent(time=start + turn * 60_000, **ids, data=s.Call(
            api="chat.completions", model="tiny", status=200, started_at=start + turn * 60_000 - 500,
            latency_ms=500.0, request={}, response={"choices": [{"index": 0, "message": {"content": "ok"}}]},
            prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-0.5] * len(completion),
            weight_version=0, session_id=session_id)))
    feedback = s.FeedbackEvent(**ids, time=start + 200_000, data=s.Feedback(
        session_id=session_id, call_id=calls[-1].id, sender="key:bench", thumbs="up"))
    end = s.SessionEndedEvent(**ids, time=start + 210_000, data=s.SessionEnded(session_id=session_id,
                                                                               sender="key:bench"))
    return [*calls, feedback, end]


def sessions(days: int, per_day: int, call_kb: int) -> list[s.Event]:
    """`days` × `per_day` sessions, evenly over the `days` days before now (the last ending an hour ago)."""
    count = days * per_day
    first = s.now_ms() - days * DAY_MS
    step = (days * DAY_MS - 3_600_000) // count
    return [event for i in range(count) for event in conversation(i, first + i * step, call_kb)]


async def publish(kafka: KafkaSettings, events: list[s.Event]) -> int:
    producer = make_producer(kafka, linger_ms=20)
    await producer.start()
    size = 0
    try:
        pending = []
        for event in events:
            raw = s.encode(event)
            size += len(raw)
            pending.append(await producer.send(kafka.topics.name(event.topic), raw, key=event.key))
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return size


class Worker:
    """A streams worker with one store, its own app id and state folder: started, killed, started again."""

    def __init__(self, kafka: KafkaSettings, workdir: Path, store: str, memory_mb: int):
        self.port = free_port()
        self.log = workdir / f"{store}.log"
        self.data_dir = workdir / store
        self.cmd = [sys.executable, "-m", "agentstream.streams", "worker", "--bootstrap-servers", kafka.bootstrap_servers,
                    "--topic-prefix", kafka.topic_prefix, "--app-id", f"state-{store}", "--web-port", str(self.port),
                    "--data-dir", str(self.data_dir), "--store", store, "--state-memory-mb", str(memory_mb),
                    "--settle-s", "1", "--log-level", "warning"]
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> float:
        self.process = spawn(self.cmd, self.log, cwd=ROOT)
        return time.monotonic()

    def view(self) -> dict | None:
        try:
            response = httpx.get(f"http://127.0.0.1:{self.port}/analytics", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def until(self, condition, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not Path(f"/proc/{self.pid}").exists():
                raise SystemExit(f"the {what}: the worker exited; log ({self.log}):\n{tail(self.log)}")
            view = self.view()
            if view is not None and condition(view):
                return view
            time.sleep(0.2)
        raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}; log: {self.log}")

    def memory(self) -> dict[str, int]:
        """Resident memory now and its peak (VmRSS, VmHWM), bytes."""
        status = dict(line.split(":", 1) for line in Path(f"/proc/{self.pid}/status").read_text().splitlines())
        return {name: int(status[field].split()[0]) * 1024 for name, field in (("rss", "VmRSS"), ("peak", "VmHWM"))}

    def kill(self) -> None:
        """kill -9"""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)

    def disk_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.data_dir.rglob("*") if path.is_file())


def settled_all(count: int):
    def check(view: dict) -> bool:
        state, counts = view["state"], view["assembly"]
        return (counts.get("sessions", 0) >= count and state["unwritten_changes"] == 0
                and state.get("held_changes", 0) == 0)
    return check


def recovered(view: dict) -> bool:
    return view["state"]["recoveries"] > 0 and bool(view["assembly"]["partitions"])


def measure(kafka: KafkaSettings, workdir: Path, store: str, count: int, memory_mb: int) -> dict:
    worker = Worker(kafka, workdir, store, memory_mb)
    began = worker.start()
    try:
        worker.until(settled_all(count), timeout=1800, what=f"{count} sessions settled ({store})")
        read_s = time.monotonic() - began
        holding = worker.memory()
        worker.kill()
        began = worker.start()
        view = worker.until(recovered, timeout=1800, what=f"the table recovered ({store})")
        recovery_s = time.monotonic() - began
        after = worker.memory()
        return {"read_s": read_s, "rss_holding": holding["rss"], "peak_holding": holding["peak"],
                "recovery_s": recovery_s, "rss_recovered": after["rss"], "peak_recovering": after["peak"],
                "restored_records": view["state"].get("restored_records"), "disk_bytes": worker.disk_bytes(),
                "state_memory_bytes": view["state"].get("memory_bytes")}
    finally:
        worker.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=int, nargs="+", default=[1, 3, 10, 30])
    parser.add_argument("--sessions-per-day", type=int, default=100)
    parser.add_argument("--call-kb", type=int, default=8)
    parser.add_argument("--state-memory-mb", type=int, default=64)
    args = parser.parse_args()
    report = Report("streams_state", details={**vars(args), "runs": {}})
    mb = 1024 * 1024
    with tempfile.TemporaryDirectory() as folder, kafka_broker(Path(folder) / "kafka") as (bootstrap, _):
        for days in args.days:
            kafka = asyncio.run(fresh_topics(bootstrap))
            events = sessions(days, args.sessions_per_day, args.call_kb)
            with console.status(f"{days} days: publishing {len(events):,} events…"):
                size = asyncio.run(publish(kafka, events))
            count = days * args.sessions_per_day
            runs = {}
            for store in STORES:
                workdir = Path(folder) / f"{days}d"
                workdir.mkdir(exist_ok=True)
                with console.status(f"{days} days: the {store} store's worker…"):
                    runs[store] = measure(kafka, workdir, store, count, args.state_memory_mb)
                console.print(f"{days} days, {store}: {runs[store]}")
            report.details["runs"][days] = {"events": len(events), "log_bytes": size, **runs}
            memory, disk = runs["memory"], runs["rocksdb"]
            report.add(f"{days} d ({count:,} sessions, {size / mb:,.0f} MiB of events): RSS holding them, "
                       "memory → rocksdb (ratio: memory / rocksdb)",
                       f"{memory['rss_holding'] / mb:,.0f} → {disk['rss_holding'] / mb:,.0f} MiB",
                       memory["rss_holding"] / disk["rss_holding"])
            report.add(f"{days} d: recovery after kill -9 (spawn → table recovered), memory → rocksdb",
                       f"{memory['recovery_s']:.1f} → {disk['recovery_s']:.1f} s",
                       memory["recovery_s"] / disk["recovery_s"])
            report.add(f"{days} d: peak RSS recovering, memory → rocksdb; changelog records read",
                       f"{memory['peak_recovering'] / mb:,.0f} → {disk['peak_recovering'] / mb:,.0f} MiB; "
                       f"all → {disk['restored_records']}", memory["peak_recovering"] / disk["peak_recovering"])
            report.add(f"{days} d: rocksdb on disk; its databases' memory (budget {args.state_memory_mb} MiB)",
                       f"{disk['disk_bytes'] / mb:,.0f} MiB; {(disk['state_memory_bytes'] or 0) / mb:,.1f} MiB")
    report.print("ratio: memory store / rocksdb store, same run")


if __name__ == "__main__":
    main()

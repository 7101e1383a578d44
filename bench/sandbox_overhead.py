"""The local sandbox's cost: start-up and per-command overhead against a bare subprocess, same run.

Baseline: `/bin/bash -c COMMAND` run with subprocess (output piped, as the sandbox does), no isolation.
Measured, interleaved with the baseline so both see the same machine load (medians):
  - per command: `true` and `python3 -c pass` in an open sandbox;
  - start-up: creating a sandbox (uid lease, chown, namespaces), its first `true`, and closing it,
    with an empty workspace and with one of --files files (a repository's worth), where the chown
    on open and close is what grows;
  - whole-harness mode: HTTP requests to a local server through the gateway relay from inside,
    against the same client run bare on the host.

    uv run python -m bench.sandbox_overhead [--commands 40] [--files 5000]
(needs root and bubblewrap, like the sandbox)
"""

from __future__ import annotations

import argparse
import http.server
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agentstream.sandbox import hostfs
from agentstream.sandbox.contract import Limits, Network, SandboxSpec
from agentstream.sandbox.local import LocalSandbox
from agentstream.stack.process import free_port
from bench.report import Report

CLIENT = """
import sys, time, urllib.request
url, count = sys.argv[1], int(sys.argv[2])
urllib.request.urlopen(url).read()  # warm-up
began = time.perf_counter()
for _ in range(count):
    urllib.request.urlopen(url).read()
print((time.perf_counter() - began) / count)
"""


def bare(command: str) -> None:
    subprocess.run(["/bin/bash", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                   stderr=subprocess.STDOUT, check=True)


def timed(action: Callable[[], object]) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def paired(count: int, baseline: Callable[[], object], measured: Callable[[], object]) -> tuple[float, float]:
    """Medians of `count` alternating runs of each."""
    base, meas = [], []
    for _ in range(count):
        base.append(timed(baseline))
        meas.append(timed(measured))
    return statistics.median(base), statistics.median(meas)


def startup(workspace: Path) -> None:
    with LocalSandbox(SandboxSpec(workspace)) as box:
        assert box.run("true").ok


def fill(folder: Path, files: int) -> None:
    for n in range(files):
        sub = folder / f"pkg{n // 100}"
        sub.mkdir(exist_ok=True)
        (sub / f"m{n}.py").write_text("x = 1\n")


class Server:
    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commands", type=int, default=40)
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    report = Report("sandbox_overhead")
    root = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    try:
        workspace = root / "workspace"
        workspace.mkdir()
        with LocalSandbox(SandboxSpec(workspace, Limits(attempt_timeout_s=3600))) as box:
            for command in ("true", "/usr/bin/python3 -c pass"):
                base, sandboxed = paired(args.commands, lambda c=command: bare(c), lambda c=command: box.run(c))
                report.add(f"per command `{command}`: bare", f"{base * 1000:.1f} ms")
                report.add(f"per command `{command}`: sandboxed", f"{sandboxed * 1000:.1f} ms", sandboxed / base)
                report.details[f"command {command}"] = {"bare_s": base, "sandbox_s": sandboxed}

        rounds = max(5, args.commands // 4)
        base, opened = paired(rounds, lambda: bare("true"), lambda: startup(workspace))
        report.add("start-up + first `true` + close: empty workspace", f"{opened * 1000:.1f} ms", opened / base)
        big = root / "repository"
        big.mkdir()
        fill(big, args.files)
        base_big, opened_big = paired(rounds, lambda: bare("true"), lambda: startup(big))
        report.add(f"start-up + first `true` + close: {args.files} files", f"{opened_big * 1000:.1f} ms",
                   opened_big / base_big)
        report.details["startup"] = {"bare_s": base, "empty_s": opened, "files": args.files,
                                     "bare_big_s": base_big, "big_s": opened_big}

        server = Server()
        try:
            url = f"http://127.0.0.1:{server.port}/v1/models"
            script = root / "client.py"
            script.write_text(CLIENT)
            direct = float(subprocess.run(["/usr/bin/python3", str(script), url, str(args.requests)],
                                          capture_output=True, text=True, check=True).stdout)
            spec = SandboxSpec(workspace, network=Network.GATEWAY, gateway_url=url,
                               binds=[(script, Path("/client.py"))])
            with LocalSandbox(spec) as box:
                result = box.run(f"python3 /client.py {url} {args.requests}")
                assert result.ok, result.output
                relayed = float(result.output)
            report.add("HTTP request to the gateway: bare, on the host", f"{direct * 1000:.2f} ms")
            report.add("HTTP request to the gateway: through the relay", f"{relayed * 1000:.2f} ms", relayed / direct)
            report.details["relay"] = {"direct_s": direct, "relayed_s": relayed, "requests": args.requests}
        finally:
            server.close()
    finally:
        hostfs.remove_tree(root)
    report.print("ratio vs. the same thing as a bare subprocess (per command, start-up) or on the host (HTTP)")


if __name__ == "__main__":
    main()

"""The local sandbox (real bubblewrap), attacked by scripted agents (tests/sandbox/agents/).

Each attack runs through the real sandbox and must be contained and reported, and the next command
(or the next sandbox) must run normally. Workspaces live under pytest's tmp_path, inside a 0700
directory the sandbox uid could not traverse on its own: that exercises the staging of binds too.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentstream.sandbox.contract import WORKSPACE_MOUNT, Limits, Network, SandboxError, SandboxSpec
from agentstream.sandbox.local import (
    NPROC_MARGIN,
    UID_BASE,
    UID_SLOTS,
    LocalSandbox,
    inside_gateway_url,
    processes_of,
    python_binds,
)
from agentstream.sandbox.output import OUTPUT_LIMIT
from agentstream.stack.process import free_port
from tests.support.wait import wait_for

AGENTS = Path(__file__).parent / "agents"
AGENT_BINDS = ((AGENTS, Path("/agents")),)
FAST = Limits(command_timeout_s=20, attempt_timeout_s=120, processes=32)


def sandbox(tmp_path: Path, limits: Limits = FAST, binds=(), **spec) -> LocalSandbox:
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    return LocalSandbox(SandboxSpec(workspace, limits=limits, binds=(*AGENT_BINDS, *binds), **spec))


def report(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def assert_recovers(box: LocalSandbox) -> None:
    """The attack is over: nothing of it still runs, and the next command runs normally."""
    wait_for(lambda: processes_of(box.uid) == 0, timeout=10, what="the sandbox's processes to end")
    after = box.run("echo next; touch next-ran")
    assert after.ok and after.output == "next\n"
    assert (box.spec.workspace / "next-ran").exists()


class Upstream:
    """A tiny HTTP server on the host standing in for the gateway (the relay under test is plain TCP)."""

    def __init__(self, body: str, host: str = "127.0.0.1"):
        self.body, self.requests, self.host, self.port = body, 0, host, free_port()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests += 1
                payload = json.dumps({"body": outer.body, "path": self.path}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer((host, self.port), Handler)

    def __enter__(self) -> Upstream:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- what a command sees ----------------------------------------------------------------------


def test_a_command_runs_in_the_workspace_as_an_unprivileged_uid_with_the_rlimits(tmp_path: Path):
    with sandbox(tmp_path, Limits(cpu_seconds=7, memory_bytes=3 << 30, processes=40, file_size_bytes=5 << 20)) as box:
        assert UID_BASE <= box.uid < UID_BASE + UID_SLOTS
        result = box.run("pwd; id -u; grep -E '^(Cap(Eff|Prm|Bnd)|NoNewPrivs)' /proc/self/status; "
                         "ulimit -t -v -u -f -c; echo made > made.txt; ls /")
        assert result.ok, result.output
        lines = result.output.splitlines()
        assert lines[:2] == [str(WORKSPACE_MOUNT), "1000"]
        assert all(line.split()[-1] in ("0000000000000000", "1") for line in lines[2:6]), lines[2:6]
        named = ("cpu time", "virtual", "max user", "file size", "core")
        limits = [line.split()[-1] for line in lines if line.startswith(named)]
        nproc = 40 + (NPROC_MARGIN if box._cgroup else 0)  # the pids cgroup holds them at 40
        assert sorted(limits) == sorted(["7", str(3 << 20), str(nproc), str((5 << 20) // 1024), "0"])
        assert set(lines) >= {"bin", "etc", "proc", "tmp", "usr", "workspace"}
        assert not {"root", "home", "work", "opt", "srv"} & set(lines), "only the system and the workspace are there"
        # a whole process tree of the uid lives only as long as the command
        assert processes_of(box.uid) == 0
        etc = box.run("ls -A /etc /etc/ssl").output.split()
        assert {"passwd", "hosts", "ld.so.cache", "certs"} <= set(etc), etc
        assert not {"gitconfig", "pip.conf", "npmrc", "shadow", "gshadow", "ssh", "private", "environment"} & set(etc)
        assert "agent:x:1000" in box.run("cat /etc/passwd").output
        fds = box.run("ls /proc/self/fd").output.split()
        assert fds == ["0", "1", "2", "3"], "stdin, stdout, stderr and ls's own: nothing of the host inherited"
        nested = box.run("unshare -Ur id")  # no user namespace inside: no capabilities to be had there
        assert nested.exit_code != 0 and "unshare failed" in nested.output, nested  # user.max_user_namespaces=0
    made = tmp_path / "workspace" / "made.txt"
    assert made.read_text() == "made\n" and made.stat().st_uid == os.getuid(), "close hands files back to the owner"


def test_environment_is_the_specs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AGENTSTREAM_TOKEN", "parent-secret")
    with sandbox(tmp_path, env={"TASK": "t-1"}) as box:
        result = box.run("env")
        env = dict(line.split("=", 1) for line in result.output.splitlines())
        assert env["TASK"] == "t-1" and env["HOME"] == "/tmp" and "AGENTSTREAM_TOKEN" not in env
        assert set(env) <= {"TASK", "HOME", "PATH", "USER", "LANG", "PWD", "SHLVL", "_"}


def test_cwd_output_cap_and_exit_codes(tmp_path: Path):
    (tmp_path / "workspace" / "src").mkdir(parents=True)
    with sandbox(tmp_path) as box:
        assert box.run("pwd", cwd="src").output == "/workspace/src\n"
        assert box.run("pwd", cwd="/tmp").output == "/tmp\n"
        failed = box.run("echo out; echo err >&2; exit 3")
        assert (failed.exit_code, failed.output, failed.ok) == (3, "out\nerr\n", False)
        flood = box.run("head -c 3000000 /dev/zero | tr '\\0' a; echo; echo THE-END")
        assert flood.ok and len(flood.output) < OUTPUT_LIMIT + 200
        assert "[sandbox: output truncated: " in flood.output and flood.output.endswith("THE-END\n")


def test_a_venv_made_by_uv_runs_when_bound(tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    binds = python_binds(venv)
    assert binds[0] == (venv.resolve(), venv.resolve())
    with sandbox(tmp_path, binds=binds) as box:
        result = box.run(f"{venv}/bin/python -c 'import sys, json; print(sys.prefix, sys.version_info[:2])'; "
                         f"touch {venv}/planted")
        assert result.output.startswith(f"{venv.resolve()} ") or result.output.startswith(f"{venv} "), result.output
        assert "Read-only file system" in result.output and not (venv / "planted").exists()
    with pytest.raises(SandboxError, match="uv venv"):
        python_binds(tmp_path)


# --- attacks ----------------------------------------------------------------------------------


def test_snooping_agent_finds_neither_the_hidden_tests_nor_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    hidden = tmp_path / "grader" / "tests" / "test_hidden.py"
    hidden.parent.mkdir(parents=True)
    hidden.write_text("HIDDEN-TEST-CONTENT = 1\n")
    token_file = tmp_path / "controller" / "token"
    token_file.parent.mkdir()
    token_file.write_text("ROLLOUT-TOKEN-xyz")
    monkeypatch.setenv("AGENTSTREAM_TOKEN", "ROLLOUT-TOKEN-xyz")  # in the parent's env, and so in /proc/<parent>
    secrets = ",".join(secret.encode().hex() for secret in ("HIDDEN-TEST-CONTENT", "ROLLOUT-TOKEN-xyz"))
    with sandbox(tmp_path) as box:
        result = box.run(f"python3 /agents/snoop.py {secrets} {hidden},{token_file},../grader/tests/test_hidden.py")
        found = report(result)
        assert found["found"] == [] and found["tried"] > 20, found
        assert_recovers(box)


def test_writes_outside_the_workspace_are_refused(tmp_path: Path):
    outside = tmp_path / "outside.txt"  # under /tmp: inside, that path is in the private /tmp
    targets = [str(outside), str(AGENTS / "pwned"), "/workspace/../escaped.txt", "/usr/pwned", "/etc/pwned",
               "/pwned", "/agents/pwned", "/root/.cache/agentstream/pwned", "/proc/sys/kernel/pwned",
               "/dev/shm/../pwned", "/var/pwned"]
    with sandbox(tmp_path) as box:
        result = report(box.run(f"python3 /agents/escape_write.py {' '.join(targets)} /workspace/inside.txt "
                                "/dev/shm/x /var/tmp/y"))
        private = [target for target in targets if target.startswith("/tmp/")]  # inside: the sandbox's own /tmp
        assert result["written"] == [*private, "/workspace/inside.txt", "/dev/shm/x", "/var/tmp/y"], result
        assert "No such file" in box.run(f"cat {outside}").output, "each command's /tmp is its own"
        assert not outside.exists() and not (AGENTS / "pwned").exists() and not Path("/pwned").exists()
        assert not (tmp_path / "escaped.txt").exists() and (tmp_path / "workspace" / "inside.txt").exists()
        assert_recovers(box)


def test_links_planted_in_the_workspace_do_not_turn_close_against_the_host(tmp_path: Path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    os.chown(workspace, UID_BASE + 7, UID_BASE + 7)  # as a sandbox that crashed would leave it
    with sandbox(tmp_path) as box:
        planted = box.run("ln -s /etc/passwd passwd-link; ln -s / root-link; mkdir d; ln -s /usr/bin d/bin-link; "
                          "ln /etc/hosts hard-link; echo done")
        assert planted.output.endswith("done\n") and "hard-link" in planted.output  # the hard link is refused
    assert Path("/etc/passwd").stat().st_uid == 0 and Path("/usr/bin").stat().st_uid == 0
    assert Path("/").stat().st_uid == 0
    for name in ("passwd-link", "root-link", "d/bin-link"):
        assert (workspace / name).lstat().st_uid == tmp_path.stat().st_uid
    assert workspace.stat().st_uid == tmp_path.stat().st_uid, "a crashed sandbox's uid is not handed back"


def test_tools_only_sandbox_reaches_no_network(tmp_path: Path):
    with Upstream("gateway") as gateway, Upstream("host-service") as host_service:
        targets = [f"http://127.0.0.1:{gateway.port}/v1/models", f"127.0.0.1:{gateway.port}",
                   f"127.0.0.1:{host_service.port}", f"http://127.0.0.1:{host_service.port}/", "10.0.0.1:80",
                   "dns:pypi.org", "1.1.1.1:53"]
        with sandbox(tmp_path) as box:
            probe = report(box.run(f"python3 /agents/net_probe.py {' '.join(targets)}", timeout_s=30))
            assert probe["reached"] == [] and set(probe["failed"]) == set(targets), probe
            assert gateway.requests == 0 and host_service.requests == 0
            assert_recovers(box)


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_fork_bombs_are_stopped_at_the_process_limit(tmp_path: Path):
    with sandbox(tmp_path, Limits(processes=24, command_timeout_s=2.5)) as box:
        # returns by itself (its tree dies with the command's pid namespace): given a wall clock far past
        # what it needs, so that a loaded machine cannot turn it into a timeout
        classic = box.run(":(){ :|:& };:", timeout_s=60)
        assert classic.limit in (None, "processes"), classic
        assert_recovers(box)
        shell = box.run(":(){ :|:& wait; };:")  # every level waits for its children, so the tree stays
        assert shell.limit == "processes", shell.output[-500:]
        assert "fork: retry: Resource temporarily unavailable" in shell.output
        assert_recovers(box)
        held = box.run("python3 /agents/fork_bomb.py")  # keeps every child alive: ended at the wall clock
        assert (held.limit, held.exit_code) == ("processes", -signal.SIGKILL), held
        assert "fork refused after" in held.output and "reached the limit of 24 processes" in held.output
        assert_recovers(box)


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_a_command_past_its_time_is_killed_with_its_whole_tree(tmp_path: Path):
    with sandbox(tmp_path, Limits(command_timeout_s=1.5)) as box:
        result = box.run("(sleep 300 &); sleep 300 & sleep 300")
        assert (result.limit, result.exit_code) == ("command_timeout", -signal.SIGKILL)
        assert 1.5 <= result.duration_s < 10 and "ran past 1.5 s" in result.output
        assert_recovers(box)
        assert box.run("sleep 5", timeout_s=0.5).limit == "command_timeout", "a per-call timeout replaces the limit"


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_the_attempt_deadline_ends_a_command_and_refuses_the_next(tmp_path: Path):
    with sandbox(tmp_path, Limits(command_timeout_s=60, attempt_timeout_s=2)) as box:
        long = box.run("sleep 30")
        assert long.limit == "attempt_timeout" and long.duration_s < 10
        after = box.run("echo never")
        assert (after.limit, after.ok, after.duration_s) == ("attempt_timeout", False, 0.0)
        assert "never" not in after.output and processes_of(box.uid) == 0
    with sandbox(tmp_path) as next_attempt:
        assert next_attempt.run("echo fresh").output == "fresh\n"


@pytest.mark.slow  # runs into a limit of the kernel's or the clock's, which takes seconds
def test_cpu_memory_and_file_size_limits_are_reported(tmp_path: Path):
    limits = Limits(cpu_seconds=1, memory_bytes=512 << 20, file_size_bytes=1 << 20, command_timeout_s=60)
    with sandbox(tmp_path, limits) as box:
        spin = box.run("python3 -c 'while True: pass'")
        assert spin.limit == "cpu" and spin.exit_code == 128 + signal.SIGXCPU, spin
        hog = box.run("python3 -c 'x = bytearray(1 << 30)'")
        assert hog.limit == "memory" and "MemoryError" in hog.output, hog
        big = box.run("head -c 2000000 /dev/zero > big.bin")
        assert big.limit == "file_size" and (tmp_path / "workspace" / "big.bin").stat().st_size == 1 << 20, big
        big_python = box.run("python3 -c 'open(\"big2.bin\", \"wb\").write(bytes(2000000))'")
        assert big_python.limit == "file_size" and "File too large" in big_python.output
        assert_recovers(box)


def test_the_sandbox_dies_with_its_parent(tmp_path: Path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys
from pathlib import Path
from agentstream.sandbox.contract import SandboxSpec
from agentstream.sandbox.local import LocalSandbox
box = LocalSandbox(SandboxSpec(Path({str(workspace)!r})))
print(box.uid, flush=True)
box.run("sleep 300")
"""], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    uid = int(parent.stdout.readline())
    wait_for(lambda: processes_of(uid) >= 3, timeout=20, what="the sandboxed sleep")
    parent.kill()
    parent.wait()
    parent.stdout.close()
    wait_for(lambda: processes_of(uid) == 0, timeout=10, what="the sandbox to die with its parent")
    LocalSandbox(SandboxSpec(workspace)).close()  # the next one opens (the warden took the disk off: test_dead_holder)


# --- whole-harness mode -----------------------------------------------------------------------


def test_whole_harness_sandbox_reaches_the_gateway_and_nothing_else(tmp_path: Path):
    # the gateway on 127.0.0.2 (a host address the sandbox's own loopback would not answer for)
    with Upstream("gateway", host="127.0.0.2") as gateway, Upstream("other") as other:
        url = f"http://127.0.0.2:{gateway.port}/rollouts/r1/attempts/a1/v1"
        inside = inside_gateway_url(url)
        assert inside == f"http://127.0.0.1:{gateway.port}/rollouts/r1/attempts/a1/v1"
        with sandbox(tmp_path, network=Network.GATEWAY, gateway_url=url,
                     env={"OPENAI_BASE_URL": inside, "OPENAI_API_KEY": "attempt-token"}) as box:
            harness = box.run('python3 /agents/net_probe.py "$OPENAI_BASE_URL/models"')
            (reached,) = report(harness)["reached"]
            assert json.loads(reached[1]) == {"body": "gateway", "path": "/rollouts/r1/attempts/a1/v1/models"}
            targets = [f"127.0.0.1:{other.port}", f"127.0.0.2:{gateway.port}", f"127.0.0.2:{other.port}",
                       "dns:pypi.org", "10.0.0.1:80", "::1:22"]
            probe = report(box.run(f"python3 /agents/net_probe.py {' '.join(targets)}", timeout_s=30))
            assert probe["reached"] == [] and other.requests == 0, probe
            assert gateway.requests == 1 and box.relayed_connections == 1
            # a second command (a new bubblewrap) still finds the gateway, through the same relay
            assert report(box.run('python3 /agents/net_probe.py "$OPENAI_BASE_URL/again"'))["reached"]
            assert gateway.requests == 2


def test_a_gateway_name_resolves_to_the_relay_inside(tmp_path: Path):
    with Upstream("named") as gateway:
        url = f"http://localhost:{gateway.port}/v1"
        assert inside_gateway_url(url) == url
        with sandbox(tmp_path, network=Network.GATEWAY, gateway_url=url) as box:
            assert report(box.run(f"python3 /agents/net_probe.py {url}/models"))["reached"]


def test_gateway_port_taken_on_the_host_does_not_matter(tmp_path: Path):
    """The relay listens inside the sandbox's own network namespace, so two sandboxes (or the host)
    may use the gateway's port at the same time."""
    with Upstream("gw") as gateway:
        url = f"http://127.0.0.1:{gateway.port}/v1"
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with sandbox(tmp_path / "a", network=Network.GATEWAY, gateway_url=url) as one, \
                sandbox(tmp_path / "b", network=Network.GATEWAY, gateway_url=url) as two:
            assert one.uid != two.uid
            for box in (one, two):
                assert report(box.run(f"python3 /agents/net_probe.py {url}/models"))["reached"]
        with socket.create_connection(("127.0.0.1", gateway.port)):
            pass  # and the host's own listener was never disturbed


# --- the caller's errors --------------------------------------------------------------------


def test_callers_errors_name_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(SandboxError, match="is not a directory"):
        LocalSandbox(SandboxSpec(tmp_path / "missing"))
    (tmp_path / "ws").mkdir()
    with pytest.raises(SandboxError, match=r"needs SandboxSpec\.gateway_url"):
        LocalSandbox(SandboxSpec(tmp_path / "ws", network=Network.GATEWAY))
    with pytest.raises(SandboxError, match="bind source"):
        LocalSandbox(SandboxSpec(tmp_path / "ws", binds=[(tmp_path / "nope", Path("/x"))]))
    box = LocalSandbox(SandboxSpec(tmp_path / "ws"))
    missing = box.run("true", cwd="no/such/dir")  # the agent's own mistake: a failed command, not an error
    assert missing.exit_code == 1 and "Can't chdir to /workspace/no/such/dir" in missing.output
    box.close()
    box.close()
    with pytest.raises(SandboxError, match="closed"):
        box.run("true")
    tools = tmp_path / "bin-without-bwrap"
    tools.mkdir()
    for tool in ("nsenter", "prlimit"):
        (tools / tool).symlink_to(f"/usr/bin/{tool}")
    monkeypatch.setenv("PATH", str(tools))
    with pytest.raises(SandboxError, match="apt-get install -y bubblewrap"):
        LocalSandbox(SandboxSpec(tmp_path / "ws"))


def test_the_cli_runs_one_command(tmp_path: Path):
    from typer.testing import CliRunner

    from agentstream.cli import app

    (tmp_path / "workspace").mkdir()
    result = CliRunner().invoke(app, ["sandbox", "run", str(tmp_path / "workspace"), "echo $GREETING; exit 3",
                                      "--env", "GREETING=hello"])
    assert (result.exit_code, result.output) == (3, "hello\n")
    timed_out = CliRunner().invoke(app, ["sandbox", "run", str(tmp_path / "workspace"), "sleep 30", "--timeout", "0.5"])
    assert timed_out.exit_code == 128 + signal.SIGKILL and "command_timeout limit" in timed_out.output

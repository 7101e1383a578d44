"""The tests' launcher: starts the test process (`child.py`), reads its outcomes from a pipe, and, once it
has exited and every other process of the sandbox is killed, prints the verdict, signed, as the last line of
the output.

    exec python -I launch.py RUN_FILE           (exec: the launcher must be the sandbox's pid 2)

RUN_FILE is a JSON object the grader wrote before anything of the agent ran: the tree, the test ids, the
tripwire's id and the verdict's key. None of it is on a command line: the sandbox's pid 1 keeps its
command in a /proc/1/cmdline any process of the uid reads, and the launcher's own would show the ids
without the tripwire. The launcher makes itself non-dumpable first, so no process of the same uid can
trace it, read its memory or open its descriptors; then it reads the run file and removes it, and ignores
every signal the test process could end it with but SIGKILL and SIGSTOP. The verdict frame carries the
HMAC of its JSON under the key: a frame written by anything else (a test process that killed the
launcher, a daemon) does not verify, and a killed or stopped launcher writes none; either pays 0.

A test id passes only when its setup, call and teardown were reported once each and passed, and it was not
an expected failure (XFAIL and XPASS are not passes; skipped and missing ids neither). The tripwire, a test
the grader added that must fail, is given among the ids at a random place; its status is reported apart
(`tripwire`). The run as a whole counts only when the session reported its exit status and that status is
the exit code the kernel gives for the test process; otherwise `consistent` is false and `problems` say why.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

FRAME = "@@agentstream-verdict@@ "
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGPIPE,
           signal.SIGALRM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGVTALRM, signal.SIGPROF)
"""what the test process could send the launcher to end it early: ignored (SIGKILL and SIGSTOP cannot be, and
end the run without a signed verdict, which pays 0)"""
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
PR_SET_DUMPABLE = 4
MAX_RECORDS = 200_000


def undumpable() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def kill_the_rest() -> None:
    """SIGKILL every process of the sandbox but pid 1 and this one, until none is left (a fork racing a
    kill is caught by the next round)."""
    me = os.getpid()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me) and alive(p)]
        if not others:
            return
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.01)


def alive(pid: str) -> bool:
    """Not a zombie (pid 1 reaps those)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def read_records(fd: int, records: list[bytes]) -> None:
    pending = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        records.extend(lines[: MAX_RECORDS - len(records)])


def verdict(records: list[bytes], ids: list[str], exit_code: int, tripwire: str | None = None) -> dict[str, Any]:
    phases: dict[str, dict[str, tuple[str, bool]]] = {}
    problems: list[str] = []
    collected: list[str] | None = None
    exitstatus = None
    for line in records:
        try:
            record = json.loads(line)
        except ValueError:
            problems.append("an unreadable record on the outcome channel")
            continue
        if "collected" in record:
            if collected is not None:
                problems.append("collection reported twice")
            collected = list(record["collected"])
        elif "exitstatus" in record:
            if exitstatus is not None:
                problems.append("the exit status reported twice")
            exitstatus = record["exitstatus"]
        else:
            seen = phases.setdefault(str(record.get("nodeid")), {})
            when = str(record.get("when"))
            if when in seen:
                problems.append(f"{record.get('nodeid')}: its {when} reported twice")
            seen[when] = (str(record.get("outcome")), bool(record.get("xfail")))
    if exitstatus is None:
        problems.append("the session never reported its end (the test process exited early)")
    elif exitstatus != exit_code:
        problems.append(f"the session reported exit status {exitstatus}, the test process exited with {exit_code}")
    statuses = {test: status(phases.get(test, {})) for test in ids}
    wire = None if tripwire is None else status(phases.get(tripwire, {}))
    if all(s == "PASSED" for s in statuses.values()):  # a pass must add up; a failure needs no more checks
        expected = 0 if tripwire is None else 1  # the tripwire fails: pytest's "some tests failed"
        if exit_code != expected and wire in (None, "FAILED"):
            problems.append(f"every test passed but the test process exited with {exit_code}")
        wanted = len(set(ids)) + (tripwire is not None and tripwire not in ids)
        if collected is None or len(collected) != wanted:
            problems.append(f"{'no' if collected is None else len(collected)} tests collected for {wanted} ids")
    return {"statuses": statuses, "tripwire": wire, "exit_code": exit_code, "exitstatus": exitstatus,
            "collected": None if collected is None else len(collected),
            "consistent": not problems, "problems": problems[:20]}


def status(phases: dict[str, tuple[str, bool]]) -> str:
    if not phases:
        return "NOT RUN"
    setup, call, teardown = (phases.get(when) for when in ("setup", "call", "teardown"))
    if any(p and p[1] for p in (setup, call)):
        return "XPASS" if call and call[0] == "passed" else "XFAIL"
    if (setup and setup[0] == "failed") or (teardown and teardown[0] == "failed"):
        return "ERROR"
    if (setup and setup[0] == "skipped") or (call and call[0] == "skipped"):
        return "SKIPPED"
    if call is None or teardown is None or setup is None:
        return "INCOMPLETE"
    return "PASSED" if call[0] == "passed" else "FAILED"


def tests_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The test process's environment: no pytest plugin loaded by its entry point (the child names the test
    environment's own with -p) and no options from PYTEST_ADDOPTS, which the workspace does not choose."""
    env = {name: value for name, value in environ.items() if name != "PYTEST_ADDOPTS"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def signed(result: dict[str, Any], key: bytes) -> bytes:
    """The verdict frame: FRAME, the HMAC-SHA256 of the JSON under the grader's key, the JSON."""
    body = json.dumps(result, ensure_ascii=True)
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    return ("\n" + FRAME + mac + " " + body + "\n").encode()


def default_signals() -> None:
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_DFL)


def main(argv: list[str]) -> int:
    undumpable()  # first: what this process reads is out of reach of its uid from now
    with open(argv[0], "rb") as handle:
        run = json.loads(handle.read())
    os.unlink(argv[0])
    key, tree, ids, tripwire = bytes.fromhex(run["key"]), run["tree"], list(run["ids"]), run.get("tripwire")
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    given = list(ids)
    if tripwire is not None:  # anywhere among the ids, so its place does not give it away
        given.insert(random.SystemRandom().randrange(len(given) + 1), tripwire)
    read_end, write_end = os.pipe()
    child = subprocess.Popen([sys.executable, "-I", CHILD, str(write_end), tree, *given], pass_fds=[write_end],
                             env=tests_environment(os.environ), preexec_fn=default_signals)
    os.close(write_end)
    records: list[bytes] = []
    reader = threading.Thread(target=read_records, args=(read_end, records), daemon=True)
    reader.start()
    exit_code = child.wait()
    kill_the_rest()  # nothing the tests started can write after this, to the pipe or to the output
    reader.join(timeout=5)
    result = verdict(list(records), ids, exit_code, tripwire)
    if reader.is_alive():
        result["consistent"] = False
        result["problems"].append("the outcome channel stayed open after every other process was killed")
    os.write(1, signed(result, key))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

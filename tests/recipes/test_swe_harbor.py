"""Harbor-format tasks (tests/data/harbor: two tasks in Harbor's real layout) load like an SWE-bench file and are
graded by their own tests/test.sh in the real bubblewrap sandbox (also through the controller, the gateway and the
grader service, given the folder itself): a correct scripted agent scores 1, a wrong one 0
(or the partial credit reward.json says), an agent hunting for the hidden tests finds nothing, and code that
writes a reward of its own while the tests run does not get it."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from agentstream.recipes.swe.environment import SandboxEnvironment
from agentstream.recipes.swe.grader import Grader
from agentstream.recipes.swe.harbor import HarborTaskError, harbor_spec
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.repos import default_envs_dir
from agentstream.recipes.swe.task_files import read_instances, write_task_files
from agentstream.recipes.swe.tasks import InstanceFileError, by_id, load
from agentstream.recipes.swe.workspace import TaskInput, checkout, final_diff
from agentstream.schemas.events import RewardEvent, TrajectoryEvent
from agentstream.stack.process import stop_pid, tail
from tests.support.gateway import gateway_settings, running_gateway
from tests.support.streams import StreamsWorker, TopicWatch
from tests.support.swe import await_exit, grader_process, run_controller

TASKS = Path(__file__).resolve().parents[1] / "data" / "harbor"
FIX_ADD = "sed -i 's/return a - b/return a + b/' calc.py"
FIX_WORDS = "sed -i 's/len(text.splitlines())/len(text.split())/' src/words.py"


def loaded(tmp_path: Path) -> dict[str, Instance]:
    return by_id(load(TASKS, tmp_path / "repos"))


def attempt(tmp_path: Path, instance: Instance, commands: list[str]) -> tuple[str, list[str]]:
    """A scripted agent's attempt, as the harness makes one: the task's environment checked out into a fresh
    workspace, each command in the agent's sandbox (tools-only, no network), the diff taken inside it."""
    workspace = tmp_path / f"attempt-{instance.instance_id}"
    task = TaskInput.of(instance).located(tmp_path / "tasks" / "index.jsonl")
    baseline = checkout(task, workspace, tmp_path / "repos")
    env = SandboxEnvironment(workspace=str(workspace), timeout=60, attempt_timeout=300)
    try:
        outputs = [env.execute({"command": command})["output"] for command in commands]
        diff, _ = final_diff(env.sandbox, baseline)
    finally:
        env.close()
        shutil.rmtree(workspace, ignore_errors=True)
    return diff, outputs


@pytest.fixture
def harbor(tmp_path: Path) -> dict[str, Instance]:
    instances = loaded(tmp_path)
    write_task_files(list(instances.values()), tmp_path / "tasks")
    return instances


def test_a_folder_of_harbor_tasks_loads_like_an_swe_bench_file(tmp_path):
    instances = loaded(tmp_path)
    assert sorted(instances) == ["agentstream__count-words", "fix-add"], "[task] name, else the folder's name"
    fix = instances["fix-add"]
    assert fix.problem_statement == (TASKS / "fix-add" / "instruction.md").read_text().strip()
    assert fix.repo == "harbor/fix-add" and (tmp_path / "repos" / "harbor__fix-add" / "HEAD").exists()
    spec = harbor_spec(fix)
    assert spec is not None and spec.verifier_timeout_s == 60.0 and spec.env == {"PYTHONDONTWRITEBYTECODE": "1"}
    assert harbor_spec(instances["agentstream__count-words"]).verifier_env == {"EXPECTED_UNIT": "words"}  # type: ignore[union-attr]
    assert {i.split for i in instances.values()} == {"train", "validation"}, "a stable split by id, as built tasks get"

    again = by_id(load(TASKS / "fix-add", tmp_path / "other-repos"))
    assert again["fix-add"].base_commit == fix.base_commit, "the same files make the same commit anywhere"

    train, validation, instances_file = write_task_files(list(instances.values()), tmp_path / "tasks")
    rows = train.read_text() + validation.read_text()
    assert "hidden_calc" not in rows and "task_dir" not in rows and "test.sh" not in rows, \
        "the controller's task rows hold the id and the instruction, nothing of the verifier"
    reloaded = by_id(load(instances_file, tmp_path / "repos"))
    assert harbor_spec(reloaded["fix-add"]) == spec, "the grader's instances file keeps the Harbor spec"
    assert read_instances(instances_file)[0].model_extra


def _broken(tmp_path: Path, edit: str) -> Path:
    task = tmp_path / "task"
    shutil.copytree(TASKS / "fix-add", task)
    dockerfile = task / "environment" / "Dockerfile"
    if edit == "no-instruction":
        (task / "instruction.md").unlink()
    elif edit == "bad-timeout":
        (task / "task.toml").write_text('[verifier]\ntimeout_sec = "soon"\n')
    elif edit == "not-toml":
        (task / "task.toml").write_text("[verifier\n")
    elif edit == "compose":
        (task / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    elif edit == "no-test-sh":
        (task / "tests" / "test.sh").unlink()
    else:
        lines = {"run": "RUN pip install requests", "workdir": "WORKDIR /app", "from": "FROM ubuntu:22.04",
                 "copy-from": "COPY --from=builder /out /workspace/", "copy-out": "COPY ../tests/hidden_calc.py ./",
                 "add-url": "ADD https://example.com/data.txt ./"}
        dockerfile.write_text(dockerfile.read_text().replace("ENV PYTHONDONTWRITEBYTECODE=1", lines[edit])
                              .replace("FROM python:3.11-slim", lines[edit] if edit == "from" else "FROM python:3.11-slim"))
    return task


@pytest.mark.parametrize(("edit", "said"), [
    ("no-instruction", "task/instruction.md: missing"),
    ("bad-timeout", "task/task.toml: verifier.timeout_sec: Input should be a valid number"),
    ("not-toml", "task/task.toml: not TOML"),
    ("compose", "docker-compose.yaml: several containers"),
    ("no-test-sh", "task/tests/test.sh: missing"),
    ("run", "Dockerfile:7: RUN: the image is not built here"),
    ("workdir", "Dockerfile:7: WORKDIR /app: the sandbox's one writable tree is /workspace"),
    ("from", "Dockerfile:1: FROM: image 'ubuntu:22.04' cannot be built or pulled here"),
    ("copy-from", "Dockerfile:7: COPY: --from=builder: only files of environment/"),
    ("copy-out", "Dockerfile:7: COPY: ../tests/hidden_calc.py is outside environment/"),
    ("add-url", "Dockerfile:7: ADD: https://example.com/data.txt: nothing is fetched here"),
])
def test_a_task_folder_that_cannot_run_here_is_refused_naming_its_file_and_field(tmp_path, edit, said):
    task = _broken(tmp_path, edit)
    with pytest.raises(HarborTaskError) as error:
        load(task, tmp_path / "repos")
    assert said in str(error.value), str(error.value)
    assert not (tmp_path / "repos").exists() or not any((tmp_path / "repos").iterdir()), "nothing was committed"


def test_a_folder_with_one_bad_task_among_good_ones_names_it_and_loads_none(tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS, tasks)
    (tasks / "count-words" / "task.toml").write_text("[agent]\ntimeout_sec = -5\n")
    with pytest.raises(HarborTaskError, match=r"count-words/task.toml: agent.timeout_sec: Input should be greater"):
        load(tasks, tmp_path / "repos")
    (empty := tmp_path / "empty").mkdir()
    with pytest.raises(InstanceFileError, match=r"no task\.toml"):
        load(empty, tmp_path / "repos")


@pytest.mark.slow  # attempts in the sandbox and test.sh in a fresh one: seconds each
def test_a_correct_scripted_agent_scores_1_and_a_wrong_one_0(tmp_path, harbor):
    grader = Grader(repos_dir=tmp_path / "repos", envs_dir=default_envs_dir())
    fix, words = harbor["fix-add"], harbor["agentstream__count-words"]

    right, _ = attempt(tmp_path, fix, ["cat calc.py", FIX_ADD])
    graded = grader.grade(fix, right)
    assert graded.reward == 1.0 and graded.details["resolved"], graded.details
    assert graded.details["harbor"]["reward_file"] == "reward.txt"

    wrong, _ = attempt(tmp_path, fix, ["sed -i 's/return a - b/return a * b/' calc.py"])
    graded = grader.grade(fix, wrong)
    assert graded.reward == 0.0 and graded.details["applied"] and "1 failed" in graded.details["output_tail"]

    assert grader.grade(words, attempt(tmp_path, words, [FIX_WORDS])[0]).reward == 1.0
    partial = grader.grade(words, "")
    assert partial.reward == pytest.approx(1 / 3), "reward.json's reward: one case of three counted right unfixed"
    assert partial.details["harbor"]["rewards"] == {"reward": pytest.approx(1 / 3), "passed": 1.0, "total": 3.0}

    junk = grader.grade(fix, "--- a/nothing.py\n+++ b/nothing.py\n@@ -1 +1 @@\n-x\n+y\n")
    assert junk.reward == 0.0 and "does not apply" in junk.details["error"]


@pytest.mark.slow
def test_an_agent_hunting_for_the_hidden_tests_finds_nothing_and_cannot_plant_a_reward(tmp_path, harbor):
    fix = harbor["fix-add"]
    secret_dir = TASKS / "fix-add" / "tests"
    _, outputs = attempt(tmp_path, fix, [
        f"cat {secret_dir}/hidden_calc.py {secret_dir}/test.sh; ls -la /tests /logs {TASKS}",
        "find / -xdev \\( -name 'hidden_calc.py' -o -name 'test.sh' -o -name 'solve.sh' \\) 2>/dev/null | head",
        "grep -rl 'assert add(2, 3)' /workspace /tmp /home /root /srv /opt /mnt /work 2>/dev/null | head",
        "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt; echo planted=$?",
    ])
    seen = "\n".join(outputs)
    assert "assert add" not in seen and "pytest" not in seen and "sed -i" not in seen, seen
    assert "No such file or directory" in outputs[0]
    assert outputs[1].strip() == "", f"no file of the verifier or the solution is visible: {outputs[1]}"

    # the agent's code writes a reward of its own when the tests import it, and from a process left behind
    cheat = (
        "cat > calc.py <<'EOF'\n"
        "import os, time\n"
        "for where in ('/logs/verifier/reward.txt', '/logs/verifier/reward.json'):\n"
        "    try:\n        open(where, 'w').write('1')\n    except OSError:\n        pass\n"
        "if os.fork() == 0:\n"
        "    os.setsid(); time.sleep(1.5)\n"
        "    open('/logs/verifier/reward.txt', 'w').write('1'); os._exit(0)\n"
        "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\nEOF"
    )
    diff, _ = attempt(tmp_path, fix, [cheat])
    graded = Grader(repos_dir=tmp_path / "repos", envs_dir=default_envs_dir()).grade(fix, diff)
    assert graded.details["applied"] and graded.reward == 0.0, graded.details


@pytest.mark.slow  # a broker, the gateway, the controller, the harness and the grader service as processes
async def test_the_controller_runs_a_harbor_task_and_the_grader_service_scores_it_from_the_folder(kafka, tmp_path):
    """The grader service is given the Harbor folder itself (`--tasks DIR`); the controller the task rows and the
    harness the public index written from it: a scripted mini-swe-agent fixes the bug in one attempt (reward 1
    from test.sh's reward.txt) and breaks it differently in another (0)."""
    repos = tmp_path / "repos"
    fix = by_id(load(TASKS / "fix-add", repos))["fix-add"]
    write_task_files([fix.model_copy(update={"split": "train"})], tmp_path / "tasks")
    worker = StreamsWorker(kafka, tmp_path / "streams", tmp_path / "streams.log", args=("--reward-grace-s", "120")).start()
    grader = grader_process(kafka, TASKS / "fix-add", repos, default_envs_dir(), tmp_path / "grader.log")
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
    try:
        async with running_gateway(gateway_settings(kafka, ["tiny=http://127.0.0.1:9"])) as gw:
            for run, script in (("right", [FIX_ADD, submit]), ("wrong", ["sed -i 's/a - b/b - a/' calc.py", submit])):
                env = {"AGENTSTREAM_SWE_REPOS": str(repos), "AGENTSTREAM_SWE_INDEX": str(tmp_path / "tasks" / "index.jsonl"),
                       "AGENTSTREAM_SWE_SCRIPT": json.dumps(script), "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "ws")}
                controller = run_controller(kafka, gw.url, tmp_path / "tasks" / "train.jsonl", tmp_path / run, env,
                                            "--run-id", f"harbor-{run}", agent=f"{sys.executable} -m agentstream.recipes.swe.harness")
                assert await await_exit(controller) == 0, tail(tmp_path / run / "controller.log")
            async with TopicWatch(kafka, "rollouts", "rewards", "trajectories") as watch:
                events = await watch.until(lambda es: sum(isinstance(e, TrajectoryEvent) for e in es) == 2,
                                           timeout=240, what="the two trajectories, graded")
    finally:
        worker.stop()
        stop_pid(grader.pid, grace=10)
    assert "grading 1 tasks" in (tmp_path / "grader.log").read_text(), tail(tmp_path / "grader.log")
    rewards = sorted(e.data.value for e in events if isinstance(e, RewardEvent))
    trajectories = sorted(e.data.reward or 0.0 for e in events if isinstance(e, TrajectoryEvent))
    assert rewards == trajectories == [0.0, 1.0], tail(tmp_path / "grader.log")
    [paid] = [e for e in events if isinstance(e, RewardEvent) and e.data.value == 1.0]
    assert paid.data.details["harbor"]["reward_file"] == "reward.txt" and paid.data.reward_fn == "recipes.swe.grader"

"""The coding recipe's settings: what the environment says reaches the harness, the grader's folders and
the re-grade, a bad value is refused naming its variable, and an empty variable counts as unset."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agentstream.recipes.swe import repos
from agentstream.recipes.swe.grade_service import GradeSettings
from agentstream.recipes.swe.harness import HarnessSettings
from agentstream.recipes.swe.regrade import grade_diff
from agentstream.recipes.swe.settings import (
    DEFAULT_CONFIG,
    AttemptSettings,
    SweSettings,
    WholeHarnessSettings,
    from_environment,
)
from agentstream.schemas.errors import ConfigurationError
from agentstream.streams.rewards import RewardError


def test_the_environment_reaches_the_settings_typed_and_empty_means_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTSTREAM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AGENTSTREAM_SWE_STEP_LIMIT", "7")
    monkeypatch.setenv("AGENTSTREAM_SWE_SCRIPT", '["ls", "cat calc.py"]')
    monkeypatch.setenv("AGENTSTREAM_SWE_MODEL_KWARGS", '{"stop": ["</cmd>"]}')
    monkeypatch.setenv("AGENTSTREAM_SWE_REPOS", "")
    monkeypatch.setenv("AGENTSTREAM_SWE_CONFIG", "")
    attempt = from_environment(AttemptSettings)
    assert attempt.step_limit == 7 and attempt.script == ["ls", "cat calc.py"]
    assert attempt.model_kwargs == {"stop": ["</cmd>"]} and attempt.config == DEFAULT_CONFIG
    assert from_environment(SweSettings).repos == tmp_path / "home" / "swe" / "repos"
    monkeypatch.setenv("AGENTSTREAM_WHOLE_ARGS", '["--tools", "Bash"]')
    monkeypatch.setenv("AGENTSTREAM_CODEX", "/opt/codex/bin/codex.js")
    whole = from_environment(WholeHarnessSettings)
    assert whole.whole_args == ["--tools", "Bash"] and whole.codex == "/opt/codex/bin/codex.js"


def test_one_repositories_folder_for_the_harness_the_grader_and_the_regrade(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTSTREAM_SWE_REPOS", str(tmp_path / "repos"))
    monkeypatch.setenv("AGENTSTREAM_SWE_MAX_TOKENS", "many")  # the harness's to refuse, not the grader's
    monkeypatch.setenv("AGENTSTREAM_SWE_ENVS", str(tmp_path / "envs"))
    grade = GradeSettings(tasks=tmp_path / "tasks.jsonl")
    assert (grade.repos_dir, grade.envs_dir) == (tmp_path / "repos", tmp_path / "envs")
    assert repos.default_repos_dir() == from_environment(SweSettings).repos == tmp_path / "repos"


@pytest.mark.parametrize(("variable", "value"), [("AGENTSTREAM_SWE_STEP_LIMIT", "twenty"),
                                                  ("AGENTSTREAM_SWE_SCRIPT", "[ls"),
                                                  ("AGENTSTREAM_SWE_MODEL_KWARGS", '["not", "an object"]')])
def test_a_bad_value_is_refused_naming_its_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable):
        from_environment(AttemptSettings)


def test_the_regrade_says_what_to_set_rather_than_grading_with_nothing(monkeypatch):
    monkeypatch.delenv("AGENTSTREAM_SWE_INSTANCES", raising=False)
    monkeypatch.setenv("AGENTSTREAM_SWE_STEP_LIMIT", "x")  # the harness's setting: not the re-grade's concern
    with pytest.raises(RewardError, match="set AGENTSTREAM_SWE_INSTANCES"):
        grade_diff(None)  # type: ignore[arg-type]  # refused before the sample is looked at


def test_the_harness_without_the_controllers_variables_says_who_sets_them(monkeypatch):
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "AGENTSTREAM_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    with pytest.raises(SystemExit, match="OPENAI_API_KEY, AGENTSTREAM_TASK not set; the controller sets them"):
        HarnessSettings.from_env()


def test_the_harness_process_refuses_a_bad_setting_before_any_work(tmp_path):
    task = tmp_path / "task.json"
    task.write_text('{"instance_id": "calc-1", "problem_statement": "p"}')
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
           "OPENAI_API_KEY": "k", "AGENTSTREAM_TASK": str(task), "AGENTSTREAM_SWE_MAX_TOKENS": "many",
           "AGENTSTREAM_SWE_WORKSPACE": str(tmp_path / "ws")}
    done = subprocess.run([sys.executable, "-m", "agentstream.recipes.swe.harness"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0 and "AGENTSTREAM_SWE_MAX_TOKENS" in done.stderr, done.stderr[-2000:]
    assert not Path(tmp_path / "ws").exists(), "a workspace was made for an attempt that cannot run"

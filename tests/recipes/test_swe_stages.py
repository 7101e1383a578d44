"""`agentstream recipe swe`, the one command (recipes/swe/stages.py): its run folder, what a rerun skips and
resumes, the memory check before a trainer stage, and every stage end to end on SmolLM2 (`make heavy`: ~5 min on
an idle machine; the tiny model's context does not hold a demonstration)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from agentstream.recipes.swe import stages
from agentstream.recipes.swe.stages import SFT, RunConfig, Stages, check_memory, run_stages
from agentstream.stack import StackError
from agentstream.trainer.settings import TrainerSettings

QWEN_05B = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
            "intermediate_size": 4864, "vocab_size": 151936, "model_type": "qwen2", "tie_word_embeddings": False}
"""Qwen2.5-Coder-0.5B's shape (config.json): what the memory estimate reads"""


def test_the_same_command_finds_the_same_run_folder_under_agentstream_home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTSTREAM_HOME", str(tmp_path))
    folder = RunConfig(seed=11).run_folder()
    assert folder.parent == tmp_path / "runs" and folder.name.startswith("recipe-swe-qwen-coder-0.5b-")
    assert RunConfig(seed=11, stages=("rl",), concurrency=8).run_folder() == folder, "stages and pace name no run"
    assert RunConfig(seed=12).run_folder() != folder
    assert RunConfig(seed=11, flags={"sft": ["--lr", "1e-4"]}).run_folder() != folder, "other settings, another run"
    assert RunConfig(out=tmp_path / "mine").run_folder() == tmp_path / "mine"
    assert RunConfig(seed=11, teacher="big=http://127.0.0.1:8001").run_folder() != folder, "another teacher's run"


def test_a_teacher_that_is_not_one_stops_the_command_before_anything_starts(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agentstream.cli import app

    monkeypatch.setenv("AGENTSTREAM_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["recipe", "swe", "--teacher", "gpt-5", "--stages", "tasks"])
    assert result.exit_code == 1 and "--teacher takes 'expert' or 'MODEL=URL'" in result.output
    assert not (tmp_path / "runs").exists(), "no run folder for a command refused"


def test_a_rerun_skips_the_stages_done_and_runs_the_interrupted_one_again_in_a_fresh_attempt(tmp_path, monkeypatch):
    """The stage glue alone (each stage's own work is the e2e test's): a stage is done when its result is written;
    one interrupted leaves none, and the rerun runs it in attempt 2, whose name (its topic prefix) is new."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")  # a configured broker: the glue starts none
    calls: list[tuple[str, Path]] = []

    def stage(name: str, interrupt: list[bool]) -> Any:
        def run(run: Stages) -> dict[str, Any]:
            folder = run.attempt(name)
            folder.mkdir()
            calls.append((name, folder))
            if interrupt and interrupt.pop():
                raise KeyboardInterrupt
            return {"attempts": 3, "pass_at_1": 0.5, "pass_at_1_interval_95": [0.1, 0.9], "folder": folder.name}
        return run

    interrupt_once = [True]
    monkeypatch.setattr(stages, "STAGE_RUNS", {"baseline": stage("baseline", []),
                                               "probe": stage("probe", interrupt_once)})
    config = RunConfig(model="tiny", stages=("baseline", "probe"), out=tmp_path / "run", vllm_name="stages-unit")
    with pytest.raises(KeyboardInterrupt):
        run_stages(config, Console(width=120))
    assert json.loads((tmp_path / "run" / "baseline.json").read_text())["folder"] == "run-baseline-1"
    assert not (tmp_path / "run" / "probe.json").exists(), "an interrupted stage wrote no result"

    summary = run_stages(config, Console(width=120))
    assert [(name, folder.name) for name, folder in calls] == [
        ("baseline", "run-baseline-1"), ("probe", "run-probe-1"), ("probe", "run-probe-2")]
    assert summary["stages"]["baseline"] and summary["stages"]["probe"]
    assert summary["pass_at_1_by_version"][0]["version"] == "base"


def test_a_trainer_stage_that_cannot_fit_is_refused_before_it_starts_naming_the_recipes_flag(tmp_path, monkeypatch):
    from agentstream.trainer import memory

    # the machine as the figures assume it, whatever else runs here now (MemAvailable caps the given limit)
    monkeypatch.setattr(memory, "available_memory", lambda limit_gib: memory.Available(int(limit_gib * memory.GIB),
                                                                                      "--memory-limit-gib"))
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    warm = {**SFT.model_dump(include=SFT.model_fields_set), "memory_limit_gib": 10.0, "groups_per_batch": 48}
    with pytest.raises(StackError) as refused:  # 4 rows of 2,048 tokens at once: 23 GiB of logits alone
        check_memory(TrainerSettings.model_validate({**warm, "micro_batch_size": 4}), tmp_path, "sft")
    said = str(refused.value)
    assert "peak estimate" in said and "available 10.0 GiB" in said
    assert "try --sft.gradient-checkpointing --sft.micro-batch-size 1" in said and "(--sft.no-memory-check" in said
    # left free, the same settings fit: the trainer picks the micro-batch and the checkpointing itself (9.6 GiB)
    check_memory(TrainerSettings.model_validate(warm), tmp_path, "sft")


@pytest.mark.heavy  # every stage of a real model, ~5 min idle: in `make heavy`, so `make test` stays near 25 min
@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_every_stage_on_smollm2_then_a_rerun_skips_them_all(kafka_bootstrap, tmp_path, monkeypatch):
    """Tasks built, the base model measured, the expert's demonstrations recorded and graded, the SFT warm start,
    one GRPO version from it, pass@1 by version; then the same command again runs nothing. SmolLM2, not the tiny
    model: the tiny model's context (its tokens are characters) cannot hold a demonstration's prompt."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    config = RunConfig(model="smollm2", stages=("tasks", "baseline", "demonstrate", "sft", "rl"), limit=4, seed=0,
                       train_tasks=1, groups_per_batch=1, versions=1, step_limit=3, attempt_timeout_s=240,
                       concurrency=2, out=tmp_path / "run", vllm_name="stages-ci")
    summary = run_stages(config, Console(width=160))
    root = tmp_path / "run"

    tasks = json.loads((root / "tasks.json").read_text())
    assert tasks["train"] >= 1 and tasks["validation"] >= 1
    demonstrated = json.loads((root / "demonstrate.json").read_text())
    assert demonstrated["rewarded"] >= 1, "the expert's one-line fixes pass the hidden tests"
    sft = json.loads((root / "sft.json").read_text())
    assert Path(sft["checkpoint"]).is_dir() and sft["version"] == 1 and sft["demonstrations"] == demonstrated["rewarded"]
    assert sft["settings"]["lora_rank"] == "32" and sft["settings"]["loss"] == "sft"
    versions = [row["version"] for row in summary["pass_at_1_by_version"]]
    assert versions == ["base", 0, 1]
    assert all(row["pass_at_1"] is not None and row["samples"] for row in summary["pass_at_1_by_version"])
    rl = json.loads((root / "rl.json").read_text())
    assert rl["per_version"]["1"]["trained_on"] >= 1

    before = {path: path.stat().st_mtime_ns for path in root.glob("*.json") if path.name != "summary.json"}
    again = run_stages(config, Console(width=160))
    assert {path: path.stat().st_mtime_ns for path in before} == before, "a rerun runs no stage again"
    assert again["pass_at_1_by_version"] == summary["pass_at_1_by_version"]


def test_rl_goes_on_in_its_attempt_folder_when_interrupted_or_asked_for_more_versions(tmp_path):
    """The glue alone: RL resumes its newest attempt (not a fresh one) unless none was made, and a finished RL stage
    with fewer versions than --versions is not done; the plan line says which and from where."""
    config = RunConfig(model="tiny", versions=4, out=tmp_path / "run")
    run = Stages(config, Console(width=120))
    assert run.rl_attempt().name == "run-rl-1" and run.done("rl") is None
    assert run.plan("rl").startswith("4 versions:"), "a fresh RL stage continues nothing"

    for n in (1, 2, 10):  # attempts sort by number, not by name
        (tmp_path / "run" / "rl" / f"run-rl-{n}").mkdir(parents=True)
    assert run.rl_attempt().name == "run-rl-10"
    assert run.plan("rl").startswith("continuing run-rl-10 (interrupted) from its checkpoint v0, 0 versions measured:")

    (tmp_path / "run" / "rl" / "run-rl-10" / "versions.json").write_text(json.dumps({
        "0": {"validation_pass_at_1": 0.5}, "1": {"validation_pass_at_1": None}}))
    run.save("rl", {"versions": 2, "per_version": {}})
    assert run.done("rl") is None, "2 versions of 4: the long run grows its horizon"
    assert "(rl.json has 2 versions < --versions 4)" in run.plan("rl") and "1 versions measured" in run.plan("rl")
    assert Stages(config.model_copy(update={"versions": 2}), Console()).done("rl") == {"versions": 2, "per_version": {}}


def test_what_a_resumed_run_measures_and_what_it_reports_lost():
    from agentstream.recipes.swe.recipe import Resumed

    fresh = Resumed()
    assert (fresh.version, fresh.from_version, fresh.lost) == (0, 0, [])

    class Latest:  # a checkpoint's version is all `Resumed` reads of it
        version = 3

    measured_the_last = Resumed(Latest(), frozenset({0, 1, 2, 3}))  # type: ignore[arg-type]
    assert (measured_the_last.from_version, measured_the_last.lost) == (4, [])
    # v2 was being measured when v3 replaced it on the server: v3 is measured next, v2 never can be
    cut_short = Resumed(Latest(), frozenset({0, 1}))  # type: ignore[arg-type]
    assert (cut_short.from_version, cut_short.lost) == (3, [2])
    assert cut_short.summary() == {"from_version": 3, "measured_before": [0, 1], "not_measured": [2]}


# its own tiny vLLM server (kept across the two runs of the RL stage, so not the session's): 17 min at load 10-13, 10
# of them the start; `make heavy`, not `make test`, keeps CI's budget
@pytest.mark.heavy
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_rl_stopped_by_sigterm_resumes_its_attempt_and_versions_on_the_rerun(tiny_model_dirs, kafka_bootstrap,
                                                                              tmp_path, monkeypatch):
    """The RL stage on the tiny model, SIGTERM'd once two versions are measured; the same command then goes on in the
    same attempt folder and topics: the trainer from its checkpoint (each trajectory trained once), the versions
    measured before kept (none measured twice), the rest run to --versions. The first run starts the vLLM server
    (with the glue's patient timeout: a loaded machine takes minutes) and the glue's stop at its end is held back,
    so that the rerun reuses it, reset, as a rerun of a command killed -9 would; the test stops it."""
    import asyncio
    import os
    import signal
    import threading
    import time

    from agentstream.recipes.swe.task_files import build_recipe_tasks
    from agentstream.schemas.codec import decode
    from agentstream.schemas.events import EvalEvent, WeightsEvent
    from agentstream.schemas.kafka import KafkaSettings
    from agentstream.schemas.scan import scan
    from agentstream.stack.process import Stopped
    from agentstream.stack.vllm import LocalVLLM

    class KeptServer(LocalVLLM):
        def stop(self, grace: float = 20.0) -> bool:
            return False

    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setattr(stages, "LocalVLLM", KeptServer)
    name = f"rlresume-{os.getpid()}"
    instances = build_recipe_tasks(tmp_path / "built", 1, 1, say=lambda _: None)[2]
    config = RunConfig(model="tiny", tasks_file=instances, stages=("tasks", "rl"), train_tasks=1, groups_per_batch=1,
                       versions=3, step_limit=2, max_tokens=16, attempt_timeout_s=180, concurrency=2,
                       base_model=tiny_model_dirs[0], out=tmp_path / "run", vllm_name=name)
    attempt = tmp_path / "run" / "rl" / "run-rl-1"

    def measured() -> dict[str, Any]:
        path = attempt / "versions.json"
        rows = json.loads(path.read_text()) if path.exists() else {}
        return {v: row for v, row in rows.items() if row["validation_pass_at_1"] is not None}

    def stop_after_two_versions() -> None:
        deadline = time.monotonic() + 1200
        while len(measured()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)  # polling a file another process writes: the condition, with a deadline
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=stop_after_two_versions, daemon=True)
    watcher.start()
    try:
        with pytest.raises(Stopped):
            run_stages(config, Console(width=160))
        watcher.join()
        before = measured()
        assert len(before) >= 2 and not (tmp_path / "run" / "rl.json").exists(), "stopped before the stage ended"

        summary = run_stages(config, Console(width=160))
    finally:
        LocalVLLM(name).stop()

    assert sorted(p.name for p in (tmp_path / "run" / "rl").iterdir() if p.is_dir()) == ["run-rl-1"], "no new attempt"
    rl = json.loads((tmp_path / "run" / "rl.json").read_text())
    assert rl["attempt"] == "run-rl-1" and rl["resumed"]["from_version"] >= 1, rl["resumed"]
    lost = set(rl["resumed"]["not_measured"])
    assert set(rl["per_version"]) >= {"0", "1", "2", "3"}
    for version, row in before.items():  # measured once, before the stop: the same figures, the same time
        assert rl["per_version"][version]["validation_measured_at"] == row["validation_measured_at"]
        assert rl["per_version"][version]["validation_pass_at_1"] == row["validation_pass_at_1"]
    assert all(rl["per_version"][str(v)]["validation_pass_at_1"] is not None for v in range(4) if v not in lost)
    assert [row["version"] for row in summary["pass_at_1_by_version"]] == [0, 1, 2, 3]

    async def events() -> list[Any]:
        kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix="run-rl-1.")
        found = []
        for topic in (kafka.topics.weights, kafka.topics.metrics):
            async for batch in scan(kafka, topic):
                found += [decode(record.value) for record in batch]
        return found

    found = asyncio.run(events())
    weights = {e.id: e for e in found if isinstance(e, WeightsEvent)}  # a checkpoint announced again: one id
    assert sorted(e.data.version for e in weights.values()) == [1, 2, 3], "each version trained once"
    lineages = [set(e.data.lineage) for e in weights.values()]
    assert all(lineages) and len(set().union(*lineages)) == sum(map(len, lineages)), "a trajectory trained twice"
    evals = [e.data.weight_version for e in found if isinstance(e, EvalEvent)]
    assert len(evals) == len(set(evals)) and set(evals) == set(range(4)) - lost, "a version measured twice, or not"


def test_a_rerun_stops_the_services_a_killed_command_left_running_and_no_other_process(tmp_path):
    """A `kill -9` of the command leaves its services running (each in a session of its own): the rerun stops those
    its services file names, and not a process that merely has a recorded pid (another start time)."""
    import subprocess
    import sys

    from agentstream.recipes.swe.recipe import SERVICES_FILE, Recipe, RecipeConfig
    from agentstream.stack.process import pid_alive, start_time

    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        recipe = Recipe(RecipeConfig(model="tiny", out=tmp_path / "attempt"), Console(width=120))
        (recipe.out / "logs").mkdir(parents=True)
        (recipe.out / "logs" / SERVICES_FILE).write_text(json.dumps([
            {"name": "trainer", "pid": left.pid, "started": start_time(left.pid)},
            {"name": "gateway", "pid": other.pid, "started": (start_time(other.pid) or 0) - 5}]))  # a reused pid
        recipe.stop_leftovers()
        assert left.wait(timeout=30) is not None and pid_alive(other.pid)
        assert not (recipe.out / "logs" / SERVICES_FILE).exists()
    finally:
        for process in (left, other):
            process.kill()
            process.wait()

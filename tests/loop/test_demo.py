"""`agentstream demo` and `agentstream demo --production`, short: every service as its own process, a few weight
versions end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from agentstream.demo import DemoConfig, reset_weights, run_demo
from agentstream.production_demo import ProductionConfig, run_production_demo
from agentstream.stack.vllm import LocalVLLM, running_servers

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]


def test_a_short_demo_trains_swaps_and_reports(vllm_server, kafka_bootstrap, tmp_path, monkeypatch):
    """On the session's tiny-model server (reset to its starting weights by the demo, and after)."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    name = next(n for n, state in running_servers().items() if state.url == vllm_server.url)
    config = DemoConfig(versions=2, samples=4, tasks=2, concurrency=4, out=tmp_path / "demo", vllm_name=name,
                        base_model=vllm_server.model_dir, keep_stack=True)
    try:
        result = run_demo(config, Console(width=120, record=True))
    finally:
        assert LocalVLLM(name).state() is not None, "the demo stopped a server it did not start"
        assert reset_weights(vllm_server.url, vllm_server.model_dir)
    assert any((config.out / "attempts").rglob("task.json")), "no agent's task file where agents_of looks"
    assert agents_of(config.out.resolve()) == [], "an agent outlived the demo (its controller was killed first?)"

    assert json.loads((tmp_path / "demo" / "summary.json").read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "demo" / "reward.png").stat().st_size > 0
    versions = result["per_version"]
    # every new version trained on a full batch and swapped in; the starting weights and the last
    # version wrote answers (a middle one may not: with staleness 1 the next can follow it at once)
    assert sorted(versions) == [0, 1, 2]
    assert all(versions[v]["trained_on"] == 8 and versions[v]["pause_ms"] > 0 for v in (1, 2))
    assert versions[0]["answers"] >= 8 and versions[2]["answers"] >= 8
    assert result["reward_start"] is not None and result["reward_end"] is not None
    assert 0 < result["pause_ms_p50"] <= result["pause_ms_max"]
    assert result["samples_per_version"] == 8


def agents_of(out: Path) -> list[str]:
    """Live processes whose task file is under `out`: the run's agents (the controller gives each its own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()  # empty for a zombie
        except OSError:
            continue
        if f"AGENTSTREAM_TASK={out}/".encode() in environ:
            found.append(pid)
    return found


def test_a_short_production_demo_learns_from_sessions_and_decides_its_canary(vllm_server, second_vllm_server,
                                                                              kafka_bootstrap, tmp_path, monkeypatch):
    """`agentstream demo --production`, short: users' rated sessions train a version, which goes out as a canary on
    a second server and is promoted or rolled back by the decision service. On the session's two tiny-model servers
    (the second is the one the demo names its canary server), reset to their starting weights by the demo, and after."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    servers = {state.url: n for n, state in running_servers().items()}
    name = servers[vllm_server.url]
    config = ProductionConfig(versions=1, sessions_per_version=16, min_sessions=6, max_sessions=12, late_share=0.3,
                              out=tmp_path / "production", vllm_name=name, base_model=vllm_server.model_dir,
                              keep_stack=True, timeout_s=600)
    assert servers[second_vllm_server.url] == config.canary_vllm_name, "the demo would start a canary server of its own"
    try:
        result = run_production_demo(config, Console(width=160, record=True))
    finally:
        for server in (vllm_server, second_vllm_server):
            kept = LocalVLLM(servers[server.url]).state()
            assert kept is not None and kept.url == server.url, "the demo stopped a server it did not start"
            assert reset_weights(server.url, server.model_dir)

    assert json.loads((config.out / "summary.json").read_text()) == json.loads(json.dumps(result))
    assert (config.out / "reward.png").stat().st_size > 0
    versions = result["per_version"]
    # the starting weights served rated sessions; version 1 trained on a full batch of them and swapped in
    assert versions[0]["sessions"] >= 6 and versions[0]["reward_mean"] is not None
    assert versions[1]["trained_on"] == 16 and versions[1]["pause_ms"] > 0
    assert result["sessions_trained_on"] == 16
    # its canary was decided by the rule, with both arms' numbers: stable v0 first, then the canary
    [decision] = result["decisions"]
    assert decision["version"] == 1 and decision["action"] in ("promote", "rollback")
    assert decision["decided_by"] == "rule" and decision["p_value"] is not None
    assert [arm["version"] for arm in decision["arms"]] == [0, 1]
    assert all(arm["sessions"] >= 6 for arm in decision["arms"])
    assert (result["promoted"] or result["rolled_back"]) == [1]
    users = (config.out / "logs" / "users.log").read_text().splitlines()
    assert any('"late": true' in line for line in users), "no user rated after the feedback window"

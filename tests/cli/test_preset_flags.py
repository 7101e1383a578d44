"""A preset's command takes any setting of the services it runs as `--<service>.<field>` (demo/overrides.py): read by
the service's own parser over what the preset derives, a default declared once (the service's or the model's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentstream.cli import app
from agentstream.demo.loop import Loop, Stack
from agentstream.demo.overrides import split
from agentstream.demo.preset import DEMO_MODELS, DemoConfig
from agentstream.schemas.flags import BadSetting
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack.process import ServerState
from agentstream.trainer.settings import TrainerSettings


def stack(out: Path) -> Stack:
    return Stack(kafka=KafkaSettings(bootstrap_servers="127.0.0.1:19092", topic_prefix="run."), model_dir=out / "m",
                 servers=[ServerState(pid=1, url="http://127.0.0.1:8000", log="", details={})], gateway_port=18080,
                 token_secret="s", api_key="k", out=out)


def test_a_service_flag_goes_over_the_presets_and_the_models_values(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTSTREAM_LR", raising=False)
    flags = split(["--trainer.lr", "1e-4", "--trainer.no-save-optimizer", "--streams.settle-s=1"], Loop.settings_types())
    assert flags == {"trainer": ["--lr", "1e-4", "--no-save-optimizer"], "streams": ["--settle-s=1"]}
    config = DemoConfig(out=tmp_path, samples=4, flags=flags)
    derived, loop = config.loop(stack(tmp_path)), config.loop(stack(tmp_path)).overridden(flags)
    assert derived.trainer is not None and loop.trainer is not None and loop.streams.settle_s == 1
    assert derived.trainer.lr == DEMO_MODELS["tiny"].trainer.lr == 3e-3, "the model's value where none is given"
    assert (loop.trainer.lr, loop.trainer.save_optimizer, loop.trainer.group_size) == (1e-4, False, 4)
    assert loop.gateway == derived.gateway, "a service given no flag is as the preset made it"


def test_a_model_default_is_a_partial_of_the_services_own_settings(monkeypatch):
    assert DEMO_MODELS["smollm2"].trainer.model_fields_set == {"lr", "micro_batch_tokens"}
    # the shell's settings are not the preset's: a demo on KAFKA_BOOTSTRAP_SERVERS gave the trainer it twice
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:19092")
    from agentstream.demo.overrides import given, partial
    assert given(partial(TrainerSettings, lr=3e-3)) == {"lr": 3e-3}
    assert TrainerSettings.model_fields["lr"].default == 1e-6
    with pytest.raises(ValueError, match="no setting learning_rate"):
        from agentstream.demo.overrides import partial
        partial(TrainerSettings, learning_rate=1.0)


def test_a_flag_for_a_service_the_run_does_not_start_is_refused(tmp_path):
    flags = split(["--releases.alpha=0.1"], Loop.settings_types())
    with pytest.raises(RuntimeError, match="this run starts no releases"):
        DemoConfig(out=tmp_path).loop(stack(tmp_path)).overridden(flags)
    with pytest.raises(BadSetting, match="unexpected argument 'stray'"):
        split(["stray"], Loop.settings_types())


def test_the_command_hands_the_flags_to_the_preset_and_takes_old_names(monkeypatch):
    seen: list[DemoConfig] = []
    monkeypatch.setattr("agentstream.demo.run_demo", lambda config, console: seen.append(config) or {
        "reward_start": 0.0, "reward_end": 1.0})
    result = CliRunner().invoke(app, ["demo", "--versions", "2", "--trainer.lr", "1e-4", "--lora-rank", "8",
                                      "--controller.timeout-s=30"])
    assert result.exit_code == 0, result.output
    assert seen[0].versions == 2
    assert seen[0].flags == {"trainer": ["--lr", "1e-4", "--lora-rank", "8"], "controller": ["--timeout-s=30"]}


def test_the_tenant_demo_gives_each_tenant_a_key_a_task_file_a_controller_and_the_controller_flags(tmp_path):
    from agentstream.demo.tenants import TenantDemoConfig, TenantLoop

    flags = split(["--controller.timeout-s=30", "--trainer.lora-rank", "16"], TenantLoop.settings_types())
    config = TenantDemoConfig(tenants=2, out=tmp_path, flags=flags)
    loop = config.loop(stack(tmp_path)).overridden(flags)
    assert set(config.keys) == set(loop.tenants) == {"agent-digits", "agent-vowels"}
    ring = loop.gateway.key_ring
    assert {ring.tenant_of(key) for key in config.keys.values()} == set(config.keys)
    assert {ring.scope_of(key) for key in config.keys.values()} == {"app"}
    assert {name: c.tenant for name, c in loop.tenants.items()} == {name: name for name in loop.tenants}
    assert {c.tasks.name for c in loop.tenants.values()} == {"tasks-agent-digits.jsonl", "tasks-agent-vowels.jsonl"}
    assert all(c.timeout_s == 30 for c in loop.tenants.values()), "--controller.* sets every tenant's controller"
    assert loop.trainer is not None and loop.trainer.tenant_adapters and loop.trainer.lora_rank == 16
    assert [service.name for service in loop.traffic()] == ["controller-agent-digits", "controller-agent-vowels"]


def test_the_tenant_demo_takes_one_to_three_tenants():
    result = CliRunner().invoke(app, ["demo", "--tenants", "4"])
    assert result.exit_code == 1 and "--tenants: the demo has a task for each of 1 to 3 tenants, not 4" in result.output

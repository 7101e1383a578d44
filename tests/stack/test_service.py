"""A service started from its settings model reads exactly those settings: for every process of every preset's
loop, the flags `Service.argv` gives parse (with the service's own parser) back into the same settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, SecretStr
from pydantic_settings import BaseSettings, CliApp

from agentstream.demo.loop import Loop, Stack
from agentstream.demo.preset import DemoConfig
from agentstream.examples.production_users import parser as users_parser
from agentstream.gateway.settings import GatewaySettings
from agentstream.production_demo import ProductionConfig
from agentstream.recipes.swe.recipe import Recipe, RecipeConfig
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack.process import ServerState
from agentstream.stack.service import Service, cli_args

# a secret that starts with "-" reads as a flag to argparse unless it is joined to its flag by "="
SECRET = "-starts-like-a-flag"


def stack(out: Path, servers: int = 1) -> Stack:
    return Stack(kafka=KafkaSettings(bootstrap_servers="127.0.0.1:19092", topic_prefix="run-1."),
                 model_dir=out / "model", out=out, gateway_port=18080, token_secret=SECRET, api_key="-key",
                 servers=[ServerState(pid=1, url=f"http://127.0.0.1:{8000 + n}", log="", details={})
                          for n in range(servers)])


def parsed(service: Service) -> BaseModel:
    """The settings the service's process builds from its argv (past `python -m module [command]`)."""
    flags = service.argv()[3 + len(service.command):]
    if isinstance(service.settings, BaseSettings):
        return CliApp.run(type(service.settings), cli_args=flags)
    return type(service.settings).model_validate(vars(users_parser().parse_args(flags)))


def revealed(settings: BaseModel) -> dict[str, object]:
    return {name: value.get_secret_value() if isinstance(value, SecretStr) else
            [v.get_secret_value() if isinstance(v, SecretStr) else v for v in value] if isinstance(value, list) else value
            for name, value in settings if name in settings.model_fields_set}


def recipe_loop(out: Path) -> Loop:
    (out / "tasks").mkdir(parents=True)
    (out / "tasks" / "index.jsonl").write_text("")
    recipe = Recipe(RecipeConfig(out=out), console=None)  # type: ignore[arg-type]  # the loop needs no console
    recipe.tasks = (out / "tasks" / "train.jsonl", out / "tasks" / "validation.jsonl", out / "tasks" / "instances.jsonl")
    return recipe.loop(stack(out))


LOOPS = {
    "demo": lambda out: DemoConfig(out=out).loop(stack(out)),
    "demo-smollm2": lambda out: DemoConfig(out=out, model="smollm2", flags={"trainer": ["--lora-rank", "8"]}).loop(stack(out)),
    "production": lambda out: ProductionConfig(out=out).loop(stack(out, servers=2)),
    "recipe": recipe_loop,
}


@pytest.mark.parametrize("preset", sorted(LOOPS))
def test_every_process_of_a_preset_reads_the_settings_it_was_described_with(preset, tmp_path, monkeypatch):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    loop = LOOPS[preset](tmp_path)
    services = loop.services() + loop.traffic()
    assert [s.name for s in services][:2] == ["gateway", "streams"]
    for service in services:
        assert revealed(parsed(service)) == revealed(service.settings), service.name
        if isinstance(service.settings, KafkaSettings):
            assert service.settings.topic_prefix == "run-1."
            assert service.settings.bootstrap_servers == "127.0.0.1:19092"


def test_the_gateway_gets_its_secrets_and_computes_its_own_defaults(tmp_path):
    gateway = DemoConfig(out=tmp_path).loop(stack(tmp_path)).gateway
    args = cli_args(gateway)
    assert f"--token-secret={SECRET}" in args and '--api-keys=["-key"]' in args
    assert not any(arg.startswith("--replica-id") for arg in args), "a default factory is the service's to compute"
    read = CliApp.run(GatewaySettings, cli_args=args)
    assert read.token_secret.get_secret_value() == SECRET and read.keys == frozenset({"-key"})
    assert read.upstreams == ["tiny=http://127.0.0.1:8000"]


def test_booleans_and_missing_values_take_the_clis_forms():
    class Flags(BaseModel):
        shuffle: bool = True
        progress: bool = False
        limit: int | None = 3
        weights: dict[str, float] = {}

    flags = Flags(shuffle=False, progress=True, limit=None, weights={"grader": 0.5})
    assert cli_args(flags) == ["--no-shuffle", "--progress", "--limit=null", '--weights={"grader": 0.5}']
    assert cli_args(Flags()) == []


def test_a_preset_setting_the_service_refuses_fails_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="max_versions"):
        DemoConfig(out=tmp_path, versions=-1).loop(stack(tmp_path))


def test_the_users_flags_are_the_programs_own():
    from agentstream.production_demo import Users

    assert set(Users.model_fields) <= {action.dest for action in users_parser()._actions}

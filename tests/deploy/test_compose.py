"""compose.yaml is valid and names only what exists; and, where asked, the stack it describes runs.

The file is checked by the legacy Python `docker-compose config` (a real validator against the
compose specification's schema that needs no engine), installed from PyPI into a throwaway
environment with uvx. Then every image, build target, command and AGENTSTREAM_* variable it names
is checked against the project. The last test brings the stack up from the built images
(deploy/compose_check.py, `make compose-check`).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from agentstream.cli import app

pytestmark = pytest.mark.slow  # each check runs docker-compose (or a service's --help) in a process of its own
ROOT = Path(__file__).parents[2]
COMPOSE = ROOT / "compose.yaml"
CONSTRAINTS = Path(__file__).parents[1] / "data" / "compose-build-constraints.txt"
PROFILES = ([], ["cpu"], ["gpu"], ["cpu", "run"])
OFFICIAL_IMAGES = ("apache/kafka:", "vllm/vllm-openai:")
SETTINGS = {
    "agentstream.gateway": "agentstream.gateway.settings:GatewaySettings",
    "agentstream.streams": "agentstream.streams.settings:StreamsSettings",
    "agentstream.controller": "agentstream.controller.settings:ControllerSettings",
    "agentstream.trainer": "agentstream.trainer.settings:TrainerSettings",
    "agentstream.dashboard": "agentstream.dashboard.settings:DashboardSettings",
    "agentstream.releases": "agentstream.releases.settings:ReleasesSettings",
    "agentstream": "agentstream.schemas.kafka:KafkaSettings",
}


def uv() -> list[str]:
    found = shutil.which("uv")
    return [found] if found else [sys.executable, "-m", "uv"]


SECRETS = {"AGENTSTREAM_TOKEN_SECRET": "a-token-secret-of-ours", "AGENTSTREAM_API_KEYS": "an-operator-key-of-ours"}
"""what compose.yaml requires from the shell (it has no default for either)"""


def compose(*args: str, secrets: dict[str, str] = SECRETS) -> subprocess.CompletedProcess:
    shell = {name: value for name, value in os.environ.items() if name not in SECRETS}
    return subprocess.run(
        [*uv(), "tool", "run", "--python", "3.11", "--from", "docker-compose==1.29.2", "docker-compose",
         "-f", str(COMPOSE), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**shell, **secrets, "UV_BUILD_CONSTRAINT": str(CONSTRAINTS)},
    )


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict]:
    """The services as compose resolves them (anchors merged, variables at their defaults), all profiles."""
    result = compose("--profile", "cpu", "--profile", "gpu", "--profile", "run", "config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


@pytest.mark.parametrize("profiles", PROFILES, ids=lambda p: "+".join(p) or "default")
def test_compose_file_validates(profiles):
    result = compose(*[arg for profile in profiles for arg in ("--profile", profile)], "config", "-q")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_the_stack_does_not_start_without_secrets_of_its_own(missing):
    """No placeholder to fall back on: the gateway listens beyond loopback in its container and would refuse one."""
    result = compose("--profile", "cpu", "--profile", "run", "config", "-q",
                     secrets={name: value for name, value in SECRETS.items() if name != missing})
    assert result.returncode != 0 and f"set {missing} to" in result.stderr, result.stderr
    assert ":-change-me" not in COMPOSE.read_text()


def test_the_secrets_reach_the_services_that_use_them(resolved):
    for service in ("gateway", "controller"):
        assert resolved[service]["environment"]["AGENTSTREAM_TOKEN_SECRET"] == SECRETS["AGENTSTREAM_TOKEN_SECRET"]
    for service in ("gateway", "dashboard"):
        assert resolved[service]["environment"]["AGENTSTREAM_API_KEYS"] == SECRETS["AGENTSTREAM_API_KEYS"]


def test_the_validator_rejects_a_broken_file(tmp_path):
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("restart: on-failure", "restart: on-failure\n    no_such_key: 1", 1))
    result = subprocess.run(
        [*uv(), "tool", "run", "--python", "3.11", "--from", "docker-compose==1.29.2", "docker-compose",
         "-f", str(broken), "config", "-q"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, **SECRETS, "UV_BUILD_CONSTRAINT": str(CONSTRAINTS)})
    assert result.returncode != 0 and "no_such_key" in result.stderr


def test_images_are_official_or_built_here(resolved):
    targets = set(re.findall(r"^FROM \S+ AS (\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE))
    for name, service in resolved.items():
        if "build" in service:
            assert service["build"]["target"] in targets, f"{name}: no Dockerfile stage {service['build']['target']}"
            assert service["image"].startswith("agentstream:"), name
        else:
            assert service["image"].startswith(OFFICIAL_IMAGES), f"{name}: unexpected image {service['image']}"


def test_inference_servers_record_the_logprobs_the_trainer_reproduces(resolved):
    """The local stack's vLLM flags (stack/vllm.py) hold in compose too: the sampled distribution's logprobs."""
    expected = ["--logprobs-mode", "processed_logprobs"]
    for name in ("vllm", "vllm-cpu"):
        command = resolved[name]["command"]
        assert command[command.index("--logprobs-mode"):command.index("--logprobs-mode") + 2] == expected, name


def entry_point(command: list[str]) -> str | None:
    """The project entry point a command runs: a module or the CLI; None for third-party images."""
    if command[:2] == ["python", "-m"]:
        return command[2]
    if command[0] == "agentstream":
        return "agentstream"
    return None


def test_commands_are_real_entry_points(resolved):
    runner = CliRunner()
    for name, service in resolved.items():
        command = service.get("command")
        target = entry_point(command) if command else None
        if "build" not in service or target is None:
            continue
        if target == "agentstream":
            result = runner.invoke(app, [*command[1:], "--help"])
            assert result.exit_code == 0, f"{name}: `{' '.join(command)}` is not an agentstream command"
        else:
            module = importlib.import_module(f"{target}.__main__")
            assert callable(getattr(module, "main", None)), f"{name}: {target} has no main(argv)"
            result = subprocess.run([sys.executable, "-m", *command[2:], "--help"], capture_output=True,
                                    text=True, timeout=120, cwd=ROOT)
            assert result.returncode == 0, f"{name}: `{' '.join(command)} --help` failed: {result.stderr[-500:]}"


def settings_class(command: list[str]):
    module, _, cls = SETTINGS[entry_point(command)].partition(":")
    return getattr(importlib.import_module(module), cls)


def test_every_setting_named_exists_and_parses(resolved, monkeypatch):
    for name, service in resolved.items():
        command = service.get("command")
        if "build" not in service or not command or entry_point(command) is None:
            continue
        cls = settings_class(command)
        environment = service.get("environment") or {}
        known = {f"AGENTSTREAM_{field.upper()}" for field in cls.model_fields} | {"KAFKA_BOOTSTRAP_SERVERS"}
        unknown = sorted(set(environment) - known)
        assert not unknown, f"{name}: {cls.__name__} has no setting for {unknown}"
        for variable in [v for v in os.environ if v.startswith("AGENTSTREAM_") or v == "KAFKA_BOOTSTRAP_SERVERS"]:
            monkeypatch.delenv(variable)
        for variable, value in environment.items():
            monkeypatch.setenv(variable, str(value))
        cls()  # the values parse as the service would read them


def _engine() -> str | None:
    for engine in ("docker", "podman"):
        if shutil.which(engine) and subprocess.run([engine, "info"], capture_output=True).returncode == 0:
            return engine
    return None


def test_the_stack_runs_and_trains():
    """deploy/compose_check.py: the stack up, an outside agent trained to a new weight version, down.

    About ten minutes, so it runs only where asked (AGENTSTREAM_COMPOSE_CHECK=1) and the images exist:
    `make compose-check` runs the same script with its progress shown."""
    if os.environ.get("AGENTSTREAM_COMPOSE_CHECK") != "1":
        pytest.skip("the compose stack check takes ~10 minutes: set AGENTSTREAM_COMPOSE_CHECK=1 (or run "
                    "`make compose-check`, which builds the images first)")
    engine = _engine()
    if engine is None:
        pytest.skip("no container engine answers (docker info / podman info): `make container-tools`")
    targets = ("services", "trainer", "vllm-cpu", "kafka")
    missing = [t for t in targets if subprocess.run([engine, "image", "inspect", f"agentstream:{t}"],
                                                      capture_output=True).returncode != 0]
    if missing:
        pytest.skip(f"images not built: {', '.join(f'agentstream:{t}' for t in missing)} (`make images`)")
    env = {**os.environ, "ENGINE": engine}
    if engine == "podman":
        env["CONTAINERS_CONF"] = str(ROOT / "deploy" / "images" / "containers.conf")
    result = subprocess.run([sys.executable, str(ROOT / "deploy" / "compose_check.py")], capture_output=True,
                            text=True, timeout=50 * 60, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "compose check passed" in result.stdout and "networks left: none" in result.stdout

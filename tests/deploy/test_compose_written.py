"""compose.yaml's services are written from the loop's settings models (agentstream.demo.compose), never by hand."""

from __future__ import annotations

import yaml

from agentstream.demo.compose import COMPOSE, compose_loop, main, render


def test_the_committed_file_is_what_the_loop_writes():
    text = COMPOSE.read_text()
    assert render(text, compose_loop()) == text, (
        "compose.yaml differs from the loop's settings: run `uv run python -m agentstream.demo.compose`")


def test_a_hand_edit_of_a_written_environment_is_caught(tmp_path):
    edited = tmp_path / "compose.yaml"
    edited.write_text(COMPOSE.read_text().replace("      AGENTSTREAM_WEB_HOST: 0.0.0.0\n",
                                                  "      AGENTSTREAM_WEB_HOST: 0.0.0.0\n      AGENTSTREAM_WEB_PORT: '1'\n"))
    assert main(["--check", "--file", str(edited)]) == 1
    assert main(["--file", str(edited)]) == 0  # written anew: the stray setting is gone
    assert edited.read_text() == COMPOSE.read_text()


def test_a_change_to_the_loop_reaches_the_containers():
    loop = compose_loop()
    moved = loop.model_copy(update={"gateway": loop.gateway.model_copy(update={"port": 8181})})
    services = yaml.safe_load(render(COMPOSE.read_text(), moved))["services"]
    assert services["gateway"]["environment"]["AGENTSTREAM_PORT"] == "8181"
    assert services["gateway"]["command"] == ["python", "-m", "agentstream.gateway"]
    assert services["streams"]["command"] == ["python", "-m", "agentstream.streams", "worker"]


def test_the_writer_does_not_read_its_own_environment(monkeypatch):
    """The settings models' constructors read AGENTSTREAM_* variables; the file must not depend on the shell."""
    monkeypatch.setenv("AGENTSTREAM_PORT", "9999")
    monkeypatch.setenv("AGENTSTREAM_GATEWAY_URL", "http://elsewhere:1")
    assert render(COMPOSE.read_text(), compose_loop()) == COMPOSE.read_text()


def test_the_written_values_are_the_services_settings():
    """Each written variable, with compose's defaults in place, parses back to the loop's value."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    loop = compose_loop()
    gateway = services["gateway"]["environment"]
    assert gateway["KAFKA_BOOTSTRAP_SERVERS"] == loop.gateway.bootstrap_servers
    assert gateway["AGENTSTREAM_PARTITIONS"] == "${AGENTSTREAM_PARTITIONS:-8}" and loop.gateway.partitions == 8
    assert services["trainer"]["environment"]["AGENTSTREAM_CHECKPOINT_DIR"] == str(loop.trainer.checkpoint_dir)
    assert services["controller"]["environment"]["AGENTSTREAM_PROGRESS"] == "false"

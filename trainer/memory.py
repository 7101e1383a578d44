"""The trainer's peak memory, estimated before the model is loaded, and the settings that make it fit.

    config.json + safetensors headers ─▶ Shape ─▶ Estimate(settings) ─▶ fits what is available?
        no ─▶ a smaller micro-batch, then gradient checkpointing (what the settings left free)
        nothing fits ─▶ DoesNotFit: one line with the estimate, the memory available and the flags that fix it

The terms, in bytes, of one process training on the CPU (float32 master weights, `grpo.Policy.load`):
weights 4·P; gradients 4·T and AdamW's two moments 8·T, T the trainable parameters (all of them, or
the LoRA adapters'); under bfloat16 autocast a 2·P cache of cast weights; activations, per token of a
micro-batch, per layer the tensors a Llama/Qwen decoder layer keeps for its backward pass (norms,
projections, rotary, attention output, the MLP's gate, up and product), only the layer's input with
gradient checkpointing (plus one layer's during its recompute); the logits, kept in float32 a few
times over (the head's output, log-softmax, their gradients); and the runtime (Python, torch, the
libraries). A micro-batch is as many rows as `--micro-batch-size` (or the mini-batch, or the batch)
at `--max-seq-len`, or `--micro-batch-tokens`. The constants are measured: bench/trainer_memory.py
compares the estimate with the trainer's peak RSS.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from agentstream.trainer.errors import TrainerError
from agentstream.trainer.settings import TrainerSettings

GIB = 1024**3
RUNTIME_BYTES = int(0.9 * GIB)
"""Python, torch, transformers, verl and the Kafka client, imported (bench/trainer_memory.py)"""
LAYER_TENSORS_HIDDEN = 10
LAYER_TENSORS_KV = 4
LAYER_TENSORS_INTERMEDIATE = 4
"""per token and layer, the activations kept for the backward pass, in vectors of the hidden size, of the
key/value size and of the MLP's intermediate size (counted from the decoder layer's autograd graph)"""
LOGITS_COPIES = 5
"""float32 vocabulary-sized vectors per token at the peak: logits, log-softmax, their gradients, and a cast
(4 undercounted SmolLM2 at 2,048 tokens: estimate ÷ peak RSS 1.01, bench/trainer_memory.py)"""


class DoesNotFit(TrainerError):
    """The trainer cannot fit in the memory available, whatever it may choose: it does not start (exit 2)."""

    exit_code = 2


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model: its parameter count and its layers' sizes."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    kv: int
    """the width of the key (and of the value) projection: key/value heads × head size"""
    vocab: int

    @classmethod
    def of(cls, folder: Path) -> Shape:
        config = json.loads((folder / "config.json").read_text())
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_size = config.get("head_dim") or hidden // heads
        layers, intermediate, vocab = config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]
        kv = config.get("num_key_value_heads", heads) * head_size
        biased = config.get("attention_bias", config.get("model_type") == "qwen2")  # Qwen2's q, k, v have biases
        parameters = stored_parameters(folder) or counted_parameters(
            hidden, intermediate, kv, heads * head_size, layers, vocab, config.get("tie_word_embeddings", False),
            biased)
        return cls(parameters, layers, hidden, intermediate, kv, vocab)

    def lora_parameters(self, rank: int) -> int:
        """The adapters' parameters on every linear layer of the decoder layers ('all-linear' leaves the head
        out): rank × (inputs + outputs) for q, k, v, o, gate, up and down."""
        h, i, kv = self.hidden, self.intermediate, self.kv
        per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)
        return self.layers * rank * per_layer


def counted_parameters(hidden: int, intermediate: int, kv: int, q: int, layers: int, vocab: int, tied: bool,
                       biased: bool) -> int:
    """A Llama/Qwen2 model's parameters from its config."""
    attention = hidden * q + 2 * hidden * kv + q * hidden + ((q + 2 * kv) if biased else 0)
    mlp = 3 * hidden * intermediate
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * (attention + mlp + 2 * hidden) + embeddings + hidden


def stored_parameters(folder: Path) -> int:
    """The parameters the folder's safetensors files hold, from their headers alone (0: none there)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(size))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                total += count
    return total


@dataclass(frozen=True)
class Estimate:
    """The trainer's peak memory in bytes, by term."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    runtime: int = RUNTIME_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.runtime

    def describe(self) -> str:
        terms = (("weights", self.weights), ("gradients", self.gradients), ("AdamW", self.optimizer),
                 ("activations", self.activations), ("logits", self.logits), ("runtime", self.runtime))
        return f"{gib(self.total)} GiB ({', '.join(f'{name} {gib(value)}' for name, value in terms)})"


def gib(size: int) -> str:
    return f"{size / GIB:.1f}"


def micro_batch_tokens(settings: TrainerSettings) -> tuple[int, int]:
    """The largest micro-batch the settings allow: (rows, tokens per row), each row at --max-seq-len."""
    s = settings
    if s.micro_batch_tokens:  # a row longer than the budget goes alone
        rows = max(1, s.micro_batch_tokens // s.max_seq_len)
        return rows, s.max_seq_len
    rows = s.micro_batch_size or s.mini_batch_size or s.group_size * s.groups_per_batch
    return rows, s.max_seq_len


def estimate(shape: Shape, settings: TrainerSettings, bfloat16: bool) -> Estimate:
    s = settings
    trainable = shape.lora_parameters(s.lora_rank) if s.lora_rank else shape.parameters
    weights = 4 * shape.parameters + (2 * shape.parameters if bfloat16 else 0)
    rows, length = micro_batch_tokens(s)
    tokens = rows * length
    width = 2 if bfloat16 else 4
    layer = width * (LAYER_TENSORS_HIDDEN * shape.hidden + LAYER_TENSORS_KV * shape.kv
                     + LAYER_TENSORS_INTERMEDIATE * shape.intermediate)
    if s.gradient_checkpointing:  # every layer's input, and one layer's activations while it is recomputed
        activations = tokens * (shape.layers * width * shape.hidden + layer)
    else:
        activations = tokens * shape.layers * layer
    logits = tokens * shape.vocab * 4 * LOGITS_COPIES
    return Estimate(weights=weights, gradients=4 * trainable, optimizer=8 * trainable, activations=activations,
                    logits=logits)


# --- the memory there is ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Available:
    size: int
    source: str
    """where the figure comes from: 'the cgroup's limit', 'MemAvailable', '--memory-limit-gib'"""


def available_memory(limit_gib: float = 0.0, proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) \
        -> Available:
    """What this process may still grow to: its own RSS plus the smaller of what the machine has available
    and what its cgroup's limit leaves (v2 memory.max, or v1 memory.limit_in_bytes), capped by a given limit."""
    own = rss(proc / "self" / "status")
    found = [Available(own + meminfo(proc / "meminfo"), "MemAvailable")]
    if (headroom := cgroup_headroom(proc / "self" / "cgroup", cgroups)) is not None:
        found.append(Available(own + headroom, "the cgroup's limit"))
    if limit_gib:
        found.append(Available(int(limit_gib * GIB), "--memory-limit-gib"))
    return min(found, key=lambda a: a.size)


def rss(status: Path) -> int:
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def meminfo(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise TrainerError(f"{path} has no MemAvailable line: give --memory-limit-gib")


def cgroup_headroom(membership: Path, root: Path) -> int | None:
    """The limit of this process's memory cgroup less its usage (its inactive page cache counted free), the
    smallest over the cgroup and its ancestors that have a limit; None: no limit."""
    headrooms = []
    for line in membership.read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            files, base = ("memory.max", "memory.current", "inactive_file"), root
        elif "memory" in controllers.split(","):  # v1
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"), root / "memory"
        else:
            continue
        folder = base / path.lstrip("/")
        while True:  # a container sees its own cgroup as the root: walk up while the folders exist
            if (found := _headroom(folder, *files)) is not None:
                headrooms.append(found)
            if folder == base or not folder.is_relative_to(base):
                break
            folder = folder.parent
    return min(headrooms, default=None)


def _headroom(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        usage = int((folder / usage_file).read_text())
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 2**62:  # v1 says "no limit" with a huge number
        return None
    return int(limit) - usage + int(stat.get(inactive_key, 0))


# --- the decision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    settings: TrainerSettings
    estimate: Estimate
    available: Available
    chosen: dict[str, object]
    """what was changed to fit (empty: the settings fit as they are)"""

    def describe(self) -> str:
        chosen = f"; chose {flags(self.chosen)} to fit" if self.chosen else ""
        return (f"memory: peak estimate {self.estimate.describe()}, available {gib(self.available.size)} GiB "
                f"({self.available.source}){chosen}")


def flags(changes: dict[str, object]) -> str:
    return " ".join(f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
                    for name, value in changes.items())


def candidates(settings: TrainerSettings, free: set[str]) -> list[dict[str, object]]:
    """The changes to try, cheapest first: a smaller micro-batch (on a CPU barely slower per token), then
    gradient checkpointing (a third more time) with each micro-batch size."""
    rows, _length = micro_batch_tokens(settings)
    sizes: list[dict[str, object]] = [{}]
    if {"micro_batch_size", "micro_batch_tokens"} <= free and not settings.micro_batch_tokens:
        size = rows // 2
        while size >= 1:
            sizes.append({"micro_batch_size": size})
            size //= 2
    checkpointing: list[dict[str, object]] = [{}]
    if "gradient_checkpointing" in free and not settings.gradient_checkpointing:
        checkpointing.append({"gradient_checkpointing": True})
    return [{**c, **m} for c in checkpointing for m in sizes]


def fit(settings: TrainerSettings, shape: Shape, available: Available, bfloat16: bool) -> Fit:
    """The settings with the first change that fits, among those the user left free; DoesNotFit otherwise,
    naming the flags that would fit if any do."""
    free = set(TrainerSettings.model_fields) - settings.model_fields_set
    for change in candidates(settings, free):
        changed = settings.model_copy(update=change)
        if (needed := estimate(shape, changed, bfloat16)).total <= available.size:
            return Fit(changed, needed, available, change)
    needed = estimate(shape, settings, bfloat16)
    fixes = [c for c in candidates(settings, set(TrainerSettings.model_fields)) if c
             and estimate(shape, settings.model_copy(update=c), bfloat16).total <= available.size]
    advice = f"try {flags(fixes[0])}" if fixes else \
        "nothing the micro-batch and gradient checkpointing can do fits: try --lora-rank 16, a smaller --max-seq-len " \
        "or a smaller model, or free memory"
    raise DoesNotFit(f"does not fit in memory: peak estimate {needed.describe()}, available {gib(available.size)} GiB "
                     f"({available.source}): {advice} (--no-memory-check starts anyway)")


def fit_to_memory(settings: TrainerSettings, folder: Path, bfloat16: bool) -> Fit | None:
    """`fit` for the trainer about to load `folder` in this process; None where it is not checked (the check
    off, a GPU, or ranks in other processes)."""
    if not settings.memory_check or settings.device != "cpu" or settings.ranks > 1:
        return None
    return fit(settings, Shape.of(folder), available_memory(settings.memory_limit_gib), bfloat16)


def peak_rss(pid: int | str = "self") -> int:
    """A process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


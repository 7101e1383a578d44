"""The update on N ranks: Ray actors that shard the model with FSDP2 and train one batch together.

    service (Kafka, ledger, checkpoint)           rank actors (Ray), one torch.distributed group
    ───────────────────────────────────           ──────────────────────────────────────────────
    samples ─▶ tensors ─▶ advantages (verl)
      ─▶ split each mini-batch by tokens ──────▶  rank r: its rows, micro-batches by token budget
                                                    forward/backward (grpo's loss; FSDP2 all-gathers
                                                    parameters, reduce-scatters gradients)
                                                    clip (global norm) ─▶ AdamW on its shard
    metrics ◀──── summed over ranks ◀────────────
    checkpoint folder ◀─── rank 0 writes the gathered full state dict

The service stays the one Kafka consumer and ledger owner (`trainer.service`); `RankedPolicy` has
the interface of `grpo.Policy` (load, update, save, save_optimizer), so the service's order
(train, checkpoint, announce, commit) is the same for one rank and for many.

One result, however many ranks. The service computes the advantages on the whole batch (group
statistics need whole groups) and splits every mini-batch's rows across the ranks, balanced by
token count (longest first, each to the rank with the fewest tokens so far). Each rank's loss is
normalised by the whole mini-batch's token and sequence counts and scaled by the number of ranks
(verl's `agg_loss(dp_size=…)`); FSDP averages the ranks' gradients, which makes them the gradients
one process computes on the whole mini-batch. FSDP runs a collective in every forward and backward,
so every rank must run as many micro-batches: a rank with fewer splits its largest ones, and a rank
with nothing left to split runs a padding row whose loss mask is zero (its gradient is zero).

A rank that dies (killed, out of memory, a lost node) fails the whole step: the service kills the
other ranks, nothing is checkpointed, announced or committed, and the batch is trained again on
fresh ranks loaded from the newest checkpoint (`RanksFailed`, `--rank-restarts`).

GPU: one GPU per rank (Ray places them), NCCL, FSDP2 mixed precision (bfloat16 parameters and
compute, float32 gradient reduction and master weights) when `--dtype` resolves to bfloat16,
`PYTORCH_CUDA_ALLOC_CONF` from `--cuda-alloc-conf`, optional CPU offload of the sharded
parameters and optimizer state (`--fsdp-cpu-offload`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from verl.workers.config import ActorConfig

from agentstream.trainer.batcher import Sample
from agentstream.trainer.errors import RanksFailed, TrainerError
from agentstream.trainer.grpo import (
    Policy,
    PolicyLoss,
    Tensors,
    chunks,
    compute_advantages,
    compute_dtype,
    micro_batches,
    optimizer_step,
    rows_with_signal,
    to_tensors,
)
from agentstream.trainer.settings import TrainerSettings

log = logging.getLogger("trainer.ranks")

# --- splitting a batch across ranks (runs in the service) -----------------------------------------


@dataclass
class Shard:
    """What one rank trains on in one update: its rows, and per mini-batch its micro-batches (local
    row indices; as many on every rank) with the whole mini-batch's token and sequence counts."""

    batch: Tensors
    advantages: torch.Tensor
    minis: list[list[torch.Tensor]]
    tokens: list[float]
    sequences: list[int]


def balance(lengths: list[int], ranks: int) -> list[list[int]]:
    """Positions of `lengths` split into `ranks` parts of nearly equal sums: longest first, each to
    the part with the smallest sum so far (ties: the lower rank)."""
    parts: list[list[int]] = [[] for _ in range(ranks)]
    sums = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (sums[r], len(parts[r]), r))
        parts[r].append(i)
        sums[r] += lengths[i]
    return [sorted(part) for part in parts]


def even_out(micro: list[torch.Tensor], count: int, padding: int) -> list[torch.Tensor]:
    """`micro` made `count` micro-batches long: the one with most rows split in two while any has
    more than one row, then padding micro-batches (the padding row alone)."""
    micro = list(micro)
    while len(micro) < count:
        largest = max(range(len(micro)), key=lambda i: len(micro[i]), default=None)
        if largest is None or len(micro[largest]) < 2:
            micro.append(torch.tensor([padding]))
            continue
        rows = micro.pop(largest)
        micro[largest:largest] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return micro


def select(batch: Tensors, rows: torch.Tensor) -> Tensors:
    return dataclasses.replace(batch, index=batch.index[rows.numpy()], **{
        name: getattr(batch, name)[rows] for name in
        ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "temperatures", "weights", "rewards")})


def shard_batch(batch: Tensors, advantages: torch.Tensor, ranks: int, settings: TrainerSettings) -> list[Shard]:
    lengths = batch.attention_mask.sum(-1)
    plans: list[list[list[torch.Tensor]]] = [[] for _ in range(ranks)]  # per rank, per mini-batch: micro-batches
    tokens: list[float] = []
    sequences: list[int] = []
    for mini in chunks(batch.rows, settings.mini_batch_size):
        rows = rows_with_signal(batch, advantages, mini, settings)
        parts = balance(lengths[rows].tolist(), ranks)
        micro = [micro_batches(batch, rows[part], settings) if part else [] for part in parts]
        count = max(len(m) for m in micro)
        for r in range(ranks):
            plans[r].append(even_out(micro[r], count, padding=-1))
        tokens.append(batch.loss_mask[mini].sum().item())
        sequences.append(int((batch.loss_mask[mini].sum(-1) > 0).sum()))
    shortest = int(lengths.argmin())
    shards = []
    for plan in plans:
        mine = sorted({int(row) for micro in plan for rows in micro for row in rows if row >= 0})
        local = {row: i for i, row in enumerate(mine)}
        local[-1] = len(mine)  # the padding row: the batch's shortest, nothing of it scored
        rows = torch.tensor([*mine, shortest])
        part, part_advantages = select(batch, rows), advantages[rows]
        part.loss_mask[-1] = 0
        minis = [[torch.tensor([local[int(row)] for row in rows]) for rows in micro] for micro in plan]
        shards.append(Shard(part, part_advantages, minis, tokens, sequences))
    return shards


# --- one rank (a Ray actor) ------------------------------------------------------------------------


class Rank:
    """One member of the process group: a shard of the model and of its optimizer state."""

    # set by start()
    device: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    policy_loss: PolicyLoss
    config: ActorConfig

    def __init__(self, rank: int, world: int, settings: TrainerSettings):
        self.rank, self.world, self.settings = rank, world, settings

    def endpoint(self) -> tuple[str, int]:
        """Where the group meets (asked of rank 0): this node's address and a free port."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((address, 0))
            port: int = probe.getsockname()[1]
            return address, port

    def start(self, master: tuple[str, int], folder: str, optimizer_file: str | None) -> int:
        """Join the group, load the model in `folder` and shard it; return this process's id."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        s = self.settings
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        cuda = s.device.startswith("cuda")
        if cuda:  # Ray gives each rank its own GPU: it is device 0 of this process
            torch.cuda.set_device(0)
        self.device = "cuda:0" if cuda else "cpu"
        self.settings = s = s.model_copy(update={"device": self.device})
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world)
        mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))
        torch.manual_seed(s.seed)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if s.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        low = compute_dtype(s)
        offload = CPUOffloadPolicy() if s.fsdp_cpu_offload else OffloadPolicy()
        precision = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) \
            if low != torch.float32 else MixedPrecisionPolicy()
        for layer in [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]:
            # one all-gather per decoder layer, freed after use
            fully_shard(layer, mesh=mesh, offload_policy=offload, mp_policy=precision)
        fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=precision)  # embeddings, final norm, head
        if not s.fsdp_cpu_offload:
            model.to(self.device)
        self.model = model
        policy = Policy(model, s)  # the same AdamW, policy loss and verl config as one process
        self.optimizer, self.policy_loss, self.config = policy.optimizer, policy.policy_loss, policy.config
        if optimizer_file:
            self._load_optimizer(optimizer_file)
        return os.getpid()

    def train(self, shard: Shard) -> list[dict[str, float]]:
        """Every optimizer step of the update on this rank's rows."""
        s = self.settings
        shard = dataclasses.replace(shard, batch=shard.batch.to(self.device), advantages=shard.advantages.to(self.device))
        self.model.train()
        history = []
        for _epoch in range(s.epochs):
            for micro, tokens, sequences in zip(shard.minis, shard.tokens, shard.sequences):
                history.append(optimizer_step(self.model, self.optimizer, self.policy_loss, self.config,
                                              shard.batch, shard.advantages, micro, tokens, sequences,
                                              dp_size=self.world, settings=s))
        self.optimizer.zero_grad(set_to_none=True)
        return history

    def save_weights(self, folder: str | None) -> None:
        """Gather the full state dict (every rank takes part); rank 0 writes it into `folder`."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from agentstream.trainer.checkpoint import save_model

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0 and folder is not None:
            full = cast(dict[str, torch.Tensor], state)  # full_state_dict: one whole tensor per name
            save_model(full, self.model.config, Path(folder), getattr(self.model, "generation_config", None))

    def save_optimizer(self, path: str | None) -> None:
        """The same for the AdamW state, in the one-process format (keyed by parameter position), so a
        restart may use another number of ranks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # AdamW's: "state" keyed by parameter name, "param_groups" a list of groups naming their parameters
        state = cast(dict[str, Any], get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
        if self.rank == 0 and path is not None:
            position = {name: i for i, name in enumerate(self._trainable_names())}
            torch.save({"state": {position[name]: value for name, value in state["state"].items()},
                        "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                                         for group in state["param_groups"]]}, path)

    def _load_optimizer(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        s, names = self.settings, self._trainable_names()
        saved = torch.load(path, weights_only=True, map_location="cpu")
        by_name: dict[str, Any] = {
            "state": {names[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**group, "lr": s.lr, "betas": (s.adam_beta1, s.adam_beta2), "eps": s.adam_eps,
                              "weight_decay": s.weight_decay, "params": [names[i] for i in group["params"]]}
                             for group in saved["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, by_name, options=StateDictOptions(full_state_dict=True))

    def _trainable_names(self) -> list[str]:
        return [name for name, p in self.model.named_parameters() if p.requires_grad]


# --- the service's handle on the ranks -------------------------------------------------------------


class LocalRay:
    """A Ray node on 127.0.0.1 run as a child process (`ray start --block`): the head of a cluster of
    its own, or with `head` (the head's address) one more node of that cluster, with a temp dir of
    its own, as a second machine would be. Only the CPUs/GPUs the ranks need, no dashboard, and its
    agents' ports chosen here: the raylet otherwise waits a fixed 15 s for the agents to report ports
    they pick themselves, which a busy machine misses (Ray then fails to start). `stop()` ends every
    process of it (SIGTERM to the `ray start` process, which stops its children); `kill()` SIGKILLs
    them all at once, as a lost machine."""

    PORTS = ("port", "node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")

    def __init__(self, cpus: int, gpus: int = 0, object_store_mb: int = 512, temp_dir: Path | None = None,
                 head: str = ""):
        self.cpus, self.gpus, self.object_store_mb, self.head = cpus, gpus, object_store_mb, head
        self.temp_dir = temp_dir or Path(tempfile.mkdtemp(prefix="agentstream-ray-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, attempts: int = 3) -> str:
        """Start it; a start that fails (the raylet gives its agents a fixed 15 s to come up, which a
        loaded machine can miss) is tried again."""
        self._ensure_token()
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except TrainerError:
                if attempt == attempts:
                    raise
                log.warning("a local Ray failed to start (attempt %d of %d); trying again", attempt, attempts)
        raise AssertionError("unreachable")

    @staticmethod
    def _ensure_token() -> None:
        """The cluster and its clients authenticate with a token (`ray_env`), which `ray start` does not
        make: Ray's own command makes one where none is found (~/.ray/auth_token; one there is kept)."""
        command = [str(Path(sys.executable).with_name("ray")), "get-auth-token", "--generate"]
        made = subprocess.run(command, env=ray_env(), capture_output=True, text=True, timeout=120)
        if made.returncode:
            raise TrainerError(f"could not make a Ray authentication token (`{' '.join(command)}`): "
                               f"{made.stderr[-2000:]} — set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to a token of your own")

    def _start_once(self, timeout: float = 180) -> str:
        ports = {name: _free_port() for name in self.PORTS if name != "port" or not self.head}
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        role = ["--address", self.head] if self.head else ["--head", "--include-dashboard", "false"]
        command = [str(Path(sys.executable).with_name("ray")), "start", *role, "--block",
                   "--node-ip-address", "127.0.0.1", "--num-cpus", str(self.cpus), "--num-gpus", str(self.gpus),
                   "--disable-usage-stats", "--temp-dir", str(self.temp_dir),
                   "--object-store-memory", str(self.object_store_mb * 2**20),
                   *[arg for name, port in ports.items() for arg in (f"--{name}", str(port))]]
        self.log = self.temp_dir / "ray-start.log"
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=ray_env(),
                                            start_new_session=True, preexec_fn=_child_setup)
        self.address = self.head or f"127.0.0.1:{ports['port']}"
        deadline = time.monotonic() + timeout
        while b"Ray runtime started" not in self.log.read_bytes():
            self._report_agent_ports(ports)
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-2000:]
                raise TrainerError(f"a local Ray did not start within {timeout:.0f} s (log {self.log}):\n{tail}")
            time.sleep(0.2)
        with contextlib.suppress(OSError):  # started: back to everybody's priority
            os.setpriority(os.PRIO_PGRP, self.process.pid, 0)
        return self.address

    AGENT_PORT_FILES: ClassVar[dict[str, str]] = {"dashboard_agent_listen_port": "dashboard-agent-listen-port",
                                                  "metrics_agent_port": "dashboard-agent-grpc-port",
                                                  "metrics_export_port": "metrics-export-port",
                                                  "runtime_env_agent_port": "runtime-env-agent-port"}

    def _report_agent_ports(self, ports: dict[str, int]) -> None:
        """Write the port files the raylet waits for (at most 15 s, fixed) on the agents' behalf: the
        ports were chosen here, so their content is known before the agents, slow to import on a busy
        machine, write the same. They are named by the node's id, which the raylet is given."""
        node_id = self._raylet_node_id()
        if node_id is None:
            return
        for session in self.temp_dir.glob("session_*/"):
            for name, flag in self.AGENT_PORT_FILES.items():
                target = session / f"{name}_{node_id}"
                if not target.exists():
                    partial = target.with_name(f".{target.name}.tmp")
                    partial.write_text(str(ports[flag]))
                    partial.rename(target)

    def _raylet_node_id(self) -> str | None:
        """The `--node_id` of this node's raylet, once it runs (a process of the `ray start` group)."""
        for pid in self._pids():
            with contextlib.suppress(OSError):
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if args[0].endswith(b"/raylet"):
                    return next((arg.partition(b"=")[2].decode() for arg in args if arg.startswith(b"--node_id=")),
                                None)
        return None

    def _pids(self) -> list[int]:
        """The processes of this node: the `ray start` process and its descendants (its raylet, agents, and
        the workers the raylet starts, which are not in its process group)."""
        if self.process is None:
            return []
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
        pids, frontier = [], [self.process.pid]
        while frontier:
            pid = frontier.pop()
            pids.append(pid)
            frontier += children.get(pid, [])
        return pids

    def kill(self) -> list[int]:
        """SIGKILL every process of this node at once, as when its machine is lost; their pids."""
        assert self.process is not None, "not started"
        pids = self._pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        self.process = None
        return pids

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None


RAY_DEFAULTS = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no calls home
    "RAY_AUTH_MODE": "token",  # the cluster and its clients share ~/.ray/auth_token (LocalRay makes it)
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",  # under `uv run` Ray would start its workers with `uv run`, outside this env
}
"""Ray's settings for the cluster and this process, where the environment does not set them already"""


def ray_env() -> dict[str, str]:
    """The environment of `ray start` (and so of the raylet and the rank workers it starts)."""
    return {**RAY_DEFAULTS, **os.environ}


def join_with_token() -> None:
    """Set this process up to join: token authentication, and workers run with this Python.

    The one place the trainer writes its environment: a Ray driver reads these settings only from
    the process environment (Ray's C++ config when it is initialised; ray_constants when ray is first
    imported, which verl does), and ray.init has no argument for them. So they are set, and both
    configs refreshed, here."""
    for name, value in RAY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    from ray._private import ray_constants
    from ray._raylet import Config  # type: ignore[attr-defined]  # a Cython class its stub leaves out

    Config.initialize("")
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False


def _child_setup() -> None:
    """In the `ray start` child: die with the trainer (SIGTERM when its parent dies, even by SIGKILL:
    no Ray is left behind; the parent is the thread that started it, which must outlive it); and as Ray's start-up races a fixed timeout, take the CPU first where we
    may (root) until it is up."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.geteuid() == 0:
        os.nice(-10)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def connect(settings: TrainerSettings) -> LocalRay | None:
    """Join `--ray-address`, or start a `LocalRay` with what the ranks need (returned: the caller
    stops it); reuse a Ray already initialised in this process."""
    import ray

    if ray.is_initialized():
        return None
    join_with_token()
    local, address = None, settings.ray_address
    if not address:
        cuda = settings.device.startswith("cuda")
        local = LocalRay(settings.ranks, settings.ranks if cuda else 0, settings.ray_object_store_mb)
        address = local.start()
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True,
                 _node_ip_address="127.0.0.1" if address.startswith("127.0.0.1") else None)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if local is not None:
            local.stop()
        raise TrainerError(f"cannot join the Ray cluster at {address} ({exc}): check --ray-address (`ray status` on "
                           "the head node prints it), or leave it empty to start a local Ray") from exc
    return local


def place(ranks: int, cuda: bool, settings: TrainerSettings) -> Any:
    """A placement group of one bundle per rank (a CPU, and a GPU on CUDA), placed by
    `--rank-placement` (STRICT_SPREAD: one rank per node), once the cluster has room for all of it.
    Waits up to `--rank-placement-timeout-s` (a node being replaced comes back meanwhile)."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group

    bundle = {"CPU": 1.0, **({"GPU": 1.0} if cuda else {})}
    group = placement_group([bundle] * ranks, strategy=settings.rank_placement)
    try:
        ray.get(group.ready(), timeout=settings.rank_placement_timeout_s)
    except GetTimeoutError:
        ray.util.remove_placement_group(group)
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        raise RanksFailed(f"the Ray cluster has no room for {ranks} ranks of {bundle} placed {settings.rank_placement} "
                          f"after {settings.rank_placement_timeout_s:g} s (its live nodes: {nodes}); check `ray status`, "
                          "--ranks and --rank-placement") from None
    return group


class RankedPolicy:
    """`grpo.Policy`'s interface over `--ranks` rank actors."""

    rank_class: ClassVar[type[Rank]] = Rank
    """what each rank's actor runs: a subclass of `Rank` extends every rank (e.g. measures its steps)"""

    def __init__(self, settings: TrainerSettings, ranks: list[Any], pids: list[int], local: LocalRay | None,
                 group: Any = None):
        """`ranks`: Ray actor handles of `Rank` (Any: Ray's annotations do not describe a method's `.remote`);
        `group`: the placement group they run in (removed with them)"""
        self.settings, self.ranks, self.pids, self.local, self.group = settings, ranks, pids, local, group

    @classmethod
    def load(cls, folder: Path, settings: TrainerSettings, optimizer_file: Path | None = None) -> RankedPolicy:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        local = connect(settings)
        n, cuda = settings.ranks, settings.device.startswith("cuda")
        group = place(n, cuda, settings)
        env = {"PYTORCH_CUDA_ALLOC_CONF": settings.cuda_alloc_conf} if cuda and settings.cuda_alloc_conf else {}
        ranks: list[Any] = [ray.remote(cls.rank_class).options(
            num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0, runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote(rank, n, settings) for rank in range(n)]
        policy = cls(settings, ranks, [], local, group)
        try:
            master = policy._all([ranks[0].endpoint.remote()], "meet")[0]
            policy.pids = policy._all([r.start.remote(master, str(folder), optimizer_file and str(optimizer_file))
                                       for r in ranks], "load the model")
        except RanksFailed:
            policy.close()
            raise
        log.info("%d ranks on Ray (%s, pids %s)", n, "NCCL" if cuda else "gloo", policy.pids)
        return policy

    def update(self, samples: list[Sample]) -> dict[str, float]:
        started = time.perf_counter()
        s = self.settings
        batch = to_tensors(samples, s.max_seq_len, s.turn_rewards)
        advantages = compute_advantages(batch, s)
        shards = shard_batch(batch, advantages, len(self.ranks), s)
        per_rank = self._all([rank.train.remote(shard) for rank, shard in zip(self.ranks, shards)],
                             "train")
        history = [merge(steps, len(self.ranks)) for steps in zip(*per_rank)]
        metrics = {name: sum(step[name] for step in history) / len(history) for name in history[0]}
        metrics["nonfinite_grad_steps"] = sum(step["nonfinite_grad_steps"] for step in history)
        metrics["optimizer_steps"] = float(len(history))
        metrics["lr"] = s.lr
        metrics["ranks"] = float(len(self.ranks))
        metrics["rank_tokens_max_share"] = max(shard.batch.loss_mask.sum().item() for shard in shards) / max(
            batch.loss_mask.sum().item(), 1)
        metrics.update(Policy._batch_metrics(samples, batch, advantages))
        metrics["train_s"] = time.perf_counter() - started
        return metrics

    def save(self, folder: Path) -> None:
        self._all([rank.save_weights.remote(str(folder) if r == 0 else None) for r, rank in enumerate(self.ranks)],
                  "gather the weights")

    def save_optimizer(self, path: Path) -> None:
        self._all([rank.save_optimizer.remote(str(path) if r == 0 else None) for r, rank in enumerate(self.ranks)],
                  "gather the optimizer state")

    def restart(self, folder: Path, optimizer_file: Path | None, settings: TrainerSettings) -> RankedPolicy:
        """Fresh ranks loaded from `folder` (on the same Ray; these are killed). Fresh ranks that die as they
        start are placed again (up to `--rank-placement-timeout-s`): Ray marks a lost node dead only after
        missing its heartbeats for a while, and until then may place a rank on it."""
        from ray.exceptions import RayActorError

        self.close(keep_ray=True)
        deadline = time.monotonic() + settings.rank_placement_timeout_s
        while True:
            try:
                fresh = RankedPolicy.load(folder, settings, optimizer_file)
                break
            except RanksFailed as exc:
                if not isinstance(exc.__cause__, RayActorError) or time.monotonic() > deadline:
                    raise
                log.warning("%s: placing fresh ranks again (a lost node is not marked dead yet)", exc)
        fresh.local, self.local = self.local, None
        return fresh

    def close(self, keep_ray: bool = False) -> None:
        import ray

        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.ranks = []
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None
        if self.local is not None and not keep_ray:
            ray.shutdown()
            self.local.stop()
            self.local = None

    def _all(self, refs: list[Any], what: str) -> list[Any]:
        """The results of every rank, or RanksFailed as soon as one rank fails: the others are then
        killed (they would wait in a collective for the dead one)."""
        import ray
        from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

        pending, failure = list(refs), None
        while pending and failure is None:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done)
            except (RayActorError, RayTaskError, OutOfMemoryError) as exc:  # the last: Ray's memory monitor killed it
                failure = exc
        if failure is not None:
            for rank in self.ranks:
                ray.kill(rank, no_restart=True)
            first_line = str(failure).strip().splitlines()[0] if str(failure).strip() else type(failure).__name__
            raise RanksFailed(f"a rank failed to {what}: {first_line}") from failure
        return ray.get(refs)


def merge(steps: tuple[dict[str, float], ...], world: int) -> dict[str, float]:
    """One optimizer step's metrics from every rank's: kl and clipfrac are already weighted by the
    global token count (sum them); each rank's loss was scaled by the number of ranks (average it);
    the gradient norm is global (every rank has it)."""
    merged = {name: sum(step[name] for step in steps) for name in ("kl", "clipfrac")}
    merged.update({name: sum(step[name] for step in steps) / world for name in ("loss", "entropy")})
    merged.update(grad_norm=steps[0]["grad_norm"], nonfinite_grad_steps=steps[0]["nonfinite_grad_steps"])
    return merged


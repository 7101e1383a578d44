"""The ranks on two Ray nodes of this machine (a head and a worker node, two `ray start` processes with
temp dirs of their own, as two machines would be): `--ranks 2 --rank-placement STRICT_SPREAD` puts one
rank on each, FSDP2 over gloo between them; the worker node killed -9 whole (raylet, agents, its rank)
mid-step voids the step, a replacement node joins, and the batch is trained once. Real broker, tiny model."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from agentstream.trainer.checkpoint import CheckpointStore
from agentstream.trainer.grpo import Policy
from agentstream.trainer.ranks import LocalRay, RankedPolicy, join_with_token
from agentstream.trainer.service import Trainer
from agentstream.trainer.settings import TrainerSettings
from tests.support.trainer import arithmetic_groups, committed_and_end, publish, read_all, samples_of, trainer_settings
from tests.trainer.test_ranks import RANKS_ATOL

log = logging.getLogger("tests.ranks_nodes")


@pytest.fixture
def ray_dir():
    """The nodes' temp dirs: short, as Ray's sockets in them must be (107 bytes at most)."""
    folder = Path(tempfile.mkdtemp(prefix="ray-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def nodes(ray_dir, monkeypatch):
    """A head and a worker node (one CPU each: room for one rank each) that this process has joined; later
    nodes (replacements) go in the same list. Nothing of any of them is left after."""
    import ray

    # the head marks a node dead after 4 missed heartbeats 0.5 s apart (Ray's default: 5 × 3 s), so that a
    # replacement's ranks are placed sooner; the wait for the lost node is tested all the same
    for name, value in {"period_ms": "500", "timeout_ms": "1000", "failure_threshold": "4"}.items():
        monkeypatch.setenv(f"RAY_health_check_{name}", value)
    # no memory monitor: it kills a node's workers when the whole machine, shared by other tests, is 95 % full
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    head = LocalRay(cpus=1, object_store_mb=100, temp_dir=ray_dir / "head")
    started = [head]
    try:
        address = head.start()
        started.append(LocalRay(cpus=1, object_store_mb=100, temp_dir=ray_dir / "node-1", head=address))
        started[-1].start()
        join_with_token()
        ray.init(address=address, _node_ip_address="127.0.0.1", logging_level="WARNING")
        yield started
    finally:
        ray.shutdown()
        for node in reversed(started):
            node.stop()
    leftovers = subprocess.run(["pgrep", "-f", str(ray_dir)], capture_output=True, text=True).stdout
    assert not leftovers.strip(), f"Ray processes left behind: {leftovers}"


@pytest.mark.slow  # three Ray nodes started, two steps of two ranks across nodes
async def test_a_worker_node_killed_mid_step_voids_the_step_and_the_batch_trains_once(
        kafka, tiny_model_dirs, nodes, ray_dir, tmp_path, caplog, monkeypatch):
    import ray

    head, worker = nodes
    base = tiny_model_dirs[0]
    events = arithmetic_groups(base, groups=2, group_size=4)
    await publish(kafka, events)
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, ranks=2, ray_address=head.address, dtype="float32",
                                rank_placement="STRICT_SPREAD", rank_restarts=1, max_versions=1)
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2

    # the fault, from outside: as the step starts, every process of the worker node is SIGKILLed (the
    # rank on the head then meets the step's first collective alone); a replacement node joins meanwhile
    update, placed, joining, ended = RankedPolicy.update, [], [], threading.Event()

    def losing_a_node(policy: RankedPolicy, *args, **kwargs):
        placed.append({node.temp_dir.name: sorted(set(policy.pids) & set(node._pids())) for node in nodes})
        if len(placed) == 1:
            worker.kill()
            nodes.append(LocalRay(cpus=1, object_store_mb=100, temp_dir=ray_dir / "node-2", head=head.address))
            joining.append(threading.Thread(target=start_and_keep, args=(nodes[-1],)))
            joining[-1].start()
        return update(policy, *args, **kwargs)

    def start_and_keep(node: LocalRay) -> None:
        """Start a node and live as long as the test: a node is sent SIGTERM when the thread that started it
        ends (PR_SET_PDEATHSIG follows the thread)."""
        try:
            node.start()
        except Exception:
            log.exception("the replacement node failed to start")
            raise
        finally:
            ended.wait()

    monkeypatch.setattr(RankedPolicy, "update", losing_a_node)
    try:
        (event,) = await Trainer(settings).run()
    finally:
        ended.set()
        for thread in joining:
            thread.join()

    # one rank per node, before and after the loss
    assert [{name: len(pids) for name, pids in where.items()} for where in placed] == [
        {"head": 1, "node-1": 1}, {"head": 1, "node-1": 0, "node-2": 1}], placed
    assert "the step is void; restarting the ranks" in caplog.text
    # the batch trained once: one version, its lineage the batch, the offsets committed to the end
    assert (event.data.version, event.data.step) == (1, 1)
    assert sorted(event.data.lineage) == sorted(e.id for e in events)
    assert await read_all(kafka, kafka.topics.weights) == [event]
    assert CheckpointStore(settings.checkpoint_dir).versions() == [1]
    committed, ends = await committed_and_end(kafka, settings.consumer_group)
    assert {p: committed[p] for p in ends if ends[p]} == {p: e for p, e in ends.items() if e}
    # and its weights are those of one clean step on the batch in one process
    torch.manual_seed(0)
    reference = Policy.load(base, TrainerSettings(lr=1e-3, group_size=4, seed=0, dtype="float32"))
    reference.update(samples_of(events))
    weights = load_file(tmp_path / "ckpt" / "v000001" / "model.safetensors")
    for name, tensor in reference.model.state_dict().items():
        assert torch.allclose(weights[name], tensor, atol=RANKS_ATOL), name

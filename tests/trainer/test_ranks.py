"""The update on Ray ranks (real Ray, real gloo process groups, FSDP2 on CPU): one result however many
ranks, a rank killed in a step voids the step and the batch is trained once, the service with
`--ranks 2` publishes versions that vLLM serves. One local Ray for the module, stopped at its end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from agentstream.trainer.checkpoint import CheckpointStore
from agentstream.trainer.errors import TrainerError
from agentstream.trainer.grpo import Policy
from agentstream.trainer.ranks import LocalRay, RankedPolicy, balance, even_out, join_with_token
from agentstream.trainer.service import Trainer
from agentstream.trainer.settings import TrainerSettings
from tests.support.trainer import arithmetic_groups, committed_and_end, publish, read_all, samples_of, trainer_settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


RANKS_ATOL = 5e-5
"""how far the ranks' weights may be from one process's after a step of lr 1e-3 (which moves a weight by up
to ~1e-3): the ranks sum in another order, and AdamW divides by the gradient's own scale, so an element
whose gradient is near zero carries that rounding into its step (1.1e-5 and more seen on an AVX-512 machine)"""


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """A local Ray with 2 CPUs (one per rank) that this process has joined; nothing of it is left after."""
    import ray

    local = LocalRay(cpus=2, temp_dir=tmp_path_factory.mktemp("ray"))
    address = local.start()
    join_with_token()
    ray.init(address=address, _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        yield address
    finally:
        ray.shutdown()
        local.stop()
        leftovers = subprocess.run(["pgrep", "-f", str(local.temp_dir)], capture_output=True, text=True).stdout
        assert not leftovers.strip(), f"Ray processes left behind: {leftovers}"


def test_balance_splits_by_tokens_and_evens_out_micro_batches():
    parts = balance([100, 90, 10, 10, 10, 10, 5, 5], 2)
    sums = [sum([100, 90, 10, 10, 10, 10, 5, 5][i] for i in part) for part in parts]
    assert sorted(i for part in parts for i in part) == list(range(8)) and abs(sums[0] - sums[1]) <= 10
    micro = even_out([torch.tensor([0, 1, 2, 3])], 3, padding=9)
    assert [m.tolist() for m in micro] == [[0], [1], [2, 3]]
    assert [m.tolist() for m in even_out([torch.tensor([4])], 2, padding=9)] == [[4], [9]]


@pytest.mark.slow  # a local Ray and two ranks' optimizer steps
def test_two_ranks_give_the_update_of_one_process(tiny_model_dirs, ray_address, tmp_path):
    base = tiny_model_dirs[0]
    samples = samples_of(arithmetic_groups(base, groups=4, group_size=8))
    # a token budget that packs the ranks' rows into different numbers of micro-batches
    settings = TrainerSettings(lr=1e-3, group_size=8, seed=0, dtype="float32", micro_batch_tokens=200,
                               mini_batch_size=16)
    torch.manual_seed(0)
    one = Policy.load(base, settings)
    expected = one.update(samples)

    ranked = RankedPolicy.load(base, settings.model_copy(update={"ranks": 2, "ray_address": ray_address}))
    try:
        metrics = ranked.update(samples)
        ranked.save(tmp_path)
        ranked.save_optimizer(tmp_path / "optimizer.pt")
    finally:
        ranked.close()
    assert metrics["optimizer_steps"] == expected["optimizer_steps"] == 2
    for name in ("loss", "kl", "clipfrac", "grad_norm", "entropy", "tokens", "reward_mean"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    assert metrics["rank_tokens_max_share"] < 0.6, "the ranks' token counts are not balanced"
    weights = load_file(tmp_path / "model.safetensors")
    for name, tensor in one.model.state_dict().items():
        assert torch.allclose(weights[name], tensor, atol=RANKS_ATOL), name
    assert not torch.equal(weights["model.embed_tokens.weight"], load_file(base / "model.safetensors")[
        "model.embed_tokens.weight"]), "the update did not move the weights"
    # the optimizer state is saved in the one-process format: a restart may change the number of ranks
    saved, own = torch.load(tmp_path / "optimizer.pt", weights_only=True), one.optimizer.state_dict()
    assert saved["param_groups"][0]["params"] == own["param_groups"][0]["params"]
    for i, state in own["state"].items():
        assert torch.allclose(saved["state"][i]["exp_avg_sq"], state["exp_avg_sq"], atol=1e-9)


def kill_a_rank_at_the_next_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault, from outside the ranks: the next update's last rank is SIGKILLed as the update starts, so
    the others run into the step's first collective without it. Once: the ranks a restart loads live."""
    update, armed = RankedPolicy.update, [True]

    def killing(policy: RankedPolicy, *args, **kwargs):
        if armed[0]:
            armed[0] = False
            os.kill(policy.pids[-1], signal.SIGKILL)
        return update(policy, *args, **kwargs)

    monkeypatch.setattr(RankedPolicy, "update", killing)


async def test_a_rank_killed_in_a_step_voids_the_step_and_the_batch_is_trained_once(
        kafka, tiny_model_dirs, ray_address, tmp_path, caplog, monkeypatch):
    base = tiny_model_dirs[0]
    events = arithmetic_groups(base, groups=2, group_size=4)
    await publish(kafka, events)
    settings = trainer_settings(kafka, tmp_path / "ckpt", base, ranks=2, ray_address=ray_address, dtype="float32",
                                rank_restarts=0, max_versions=1)

    # with no restarts allowed the trainer stops
    kill_a_rank_at_the_next_update(monkeypatch)
    with pytest.raises(TrainerError, match="a rank failed to train"):
        await Trainer(settings).run()
    assert await read_all(kafka, kafka.topics.weights) == []
    assert CheckpointStore(settings.checkpoint_dir).versions() == []
    committed, _ = await committed_and_end(kafka, settings.consumer_group)
    assert set(committed.values()) == {None}, "offsets were committed for a failed step"

    # again, with restarts: the step fails the same way, fresh ranks train the same batch, once
    kill_a_rank_at_the_next_update(monkeypatch)
    trainer = Trainer(settings.model_copy(update={"rank_restarts": 1}))
    (event,) = await trainer.run()
    assert "the step is void; restarting the ranks" in caplog.text
    assert (event.data.version, event.data.base_version, event.data.step) == (1, 0, 1)
    assert sorted(event.data.lineage) == sorted(e.id for e in events)
    assert await read_all(kafka, kafka.topics.weights) == [event]
    committed, ends = await committed_and_end(kafka, settings.consumer_group)
    assert {p: committed[p] for p in ends if ends[p]} == {p: e for p, e in ends.items() if e}
    # trained exactly once: the weights are those of one clean step on the batch in one process
    torch.manual_seed(0)
    reference = Policy.load(base, TrainerSettings(lr=1e-3, group_size=4, seed=0, dtype="float32"))
    reference.update(samples_of(events))
    weights = load_file(tmp_path / "ckpt" / "v000001" / "model.safetensors")
    for name, tensor in reference.model.state_dict().items():
        assert torch.allclose(weights[name], tensor, atol=RANKS_ATOL), name


@pytest.mark.vllm
async def test_the_service_with_two_ranks_publishes_versions_vllm_serves(kafka, vllm_server, ray_address, tmp_path):
    from tests.support.vllm import hf_logprobs, served_logprobs, swap

    base = vllm_server.model_dir
    events = arithmetic_groups(base, groups=4, group_size=4)  # 2 versions
    await publish(kafka, events)
    settings = trainer_settings(kafka, tmp_path / "ckpt", base)
    log = tmp_path / "trainer.log"
    command = [sys.executable, "-m", "agentstream.trainer", "--bootstrap-servers", settings.bootstrap_servers,
               "--topic-prefix", settings.topic_prefix, "--base-model", str(base),
               "--checkpoint-dir", str(settings.checkpoint_dir), "--consumer-group", settings.consumer_group,
               "--group-size", "4", "--groups-per-batch", "2", "--lr", "1e-2", "--max-versions", "2",
               "--ranks", "2", "--ray-address", ray_address]
    with log.open("wb") as out:
        result = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=300,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, log.read_text()[-3000:]
    published = await read_all(kafka, kafka.topics.weights)
    assert [e.data.version for e in published] == [1, 2]
    assert sorted(i for e in published for i in e.data.lineage) == sorted(e.id for e in events)
    assert all(e.data.metrics["ranks"] == 2 for e in published)
    # each version swaps into the real server, which then serves exactly the checkpoint's weights
    tokens = events[0].data.sequences[0].token_ids
    try:
        for event in published:
            swap(vllm_server.url, event.data.uri, str(event.data.version))
            assert torch.allclose(served_logprobs(vllm_server, tokens), hf_logprobs(event.data.uri, tokens),
                                  atol=2e-3)
    finally:
        swap(vllm_server.url, base, "0")
    assert (hf_logprobs(published[-1].data.uri, tokens) - hf_logprobs(base, tokens)).abs().max() > 0.01

"""The tiny model's output gain: what a LoRA adapter (which trains neither the final norm nor the head) can make the
model say. The tenant demo's tasks are shares of characters; its base must let an adapter reach them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentstream.demo.tenants import TASKS, TINY_OUTPUT_GAIN
from agentstream.models.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # (builds the model three times and climbs six spheres: seconds)


def best_share(head: torch.Tensor, gain: float, characters: str) -> float:
    """The largest probability of `characters` any final hidden state gives: the norm puts that state on the sphere
    of radius gain·√hidden, whatever the adapters did before it; found by gradient ascent over the sphere."""
    ids = [ord(character) for character in characters]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (600 steps of a 259×128 product: threads only wait on each other, for minutes at load)
    torch.manual_seed(0)
    state = torch.randn(head.shape[1], requires_grad=True)
    optimizer = torch.optim.Adam([state], lr=0.05)
    for _ in range(600):
        normed = state / state.norm() * gain * head.shape[1] ** 0.5
        share = torch.softmax(head @ normed, -1)[ids].sum()
        optimizer.zero_grad()
        (-share.log()).backward()
        optimizer.step()
    torch.set_num_threads(threads)
    return float(share.detach())


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    folder = build_tiny_model(Path(tmp_path_factory.mktemp("tiny")) / "tiny")
    return AutoModelForCausalLM.from_pretrained(folder).lm_head.weight.detach()


def test_the_gain_is_the_final_norms_weight_and_leaves_the_rest_as_the_seed_made_it(tmp_path):
    plain = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "plain")).state_dict()
    wide = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "wide", output_gain=4.0)).state_dict()
    assert torch.equal(wide["model.norm.weight"], torch.full_like(plain["model.norm.weight"], 4.0))
    assert all(torch.equal(plain[name], wide[name]) for name in plain if name != "model.norm.weight")


def test_no_adapter_can_teach_the_plain_tiny_model_a_tenants_task_but_the_demos_base_can(head):
    for task in TASKS:
        # a fresh model's logits stay within ±2.6: no hidden state gives even a quarter of the answer
        assert best_share(head, 1.0, task.characters) < 0.25, task.name
        assert best_share(head, TINY_OUTPUT_GAIN, task.characters) > 0.9, task.name

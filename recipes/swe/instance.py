"""A coding task in the SWE-bench instance format (what SWE-smith, SWE-Gym and SWE-bench files hold)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentstream.schemas.events import Task

VALIDATION_SHARE = 0.25
"""the share of generated tasks whose instance id hashes into the validation split"""


class Instance(BaseModel):
    # SWE-bench files carry more fields (created_at, version, hints_text, …): kept, not required
    model_config = ConfigDict(extra="allow")

    instance_id: str
    repo: str = Field(description="the repository, e.g. 'owner/name'; resolved to a local source by the task set")
    base_commit: str
    problem_statement: str
    patch: str = Field(description="the gold patch (never shown to the agent)")
    test_patch: str = Field(description="the hidden tests (never in the agent's workspace)")
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    split: Literal["train", "validation"] = "train"

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        # SWE-bench's published files hold these lists as JSON text
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("a list of test ids, or a JSON string of one") from None
        return value

    def agent_task(self) -> dict[str, str]:
        """What the agent may see: the id and the problem statement (never a patch or the tests)."""
        return {"instance_id": self.instance_id, "problem_statement": self.problem_statement}

    def rollout_task(self) -> Task:
        """The rollout's task: the agent's view as its input (the controller writes it where the agent
        reads it); no reward function, as the grader's reward comes from outside the streams (`reward_source`:
        the agent's token says so, and the gateway refuses a reward the agent posts)."""
        return Task(id=self.instance_id, input=self.agent_task(), reward_fn=None,
                    metadata={"repo": self.repo, "base_commit": self.base_commit, "split": self.split,
                              "reward_source": "grader"})


def split_of(instance_id: str, validation_share: float = VALIDATION_SHARE) -> Literal["train", "validation"]:
    """A stable split: the first 8 bytes of sha256(instance_id) as a fraction of 2**64."""
    return "validation" if _fraction(instance_id) < validation_share else "train"


def _fraction(instance_id: str) -> float:
    return int.from_bytes(hashlib.sha256(instance_id.encode()).digest()[:8], "big") / 2**64


def assign_splits(instance_ids: list[str], validation_share: float = VALIDATION_SHARE,
                  minimum: float = 0.2) -> dict[str, Literal["train", "validation"]]:
    """`split_of` for each id, topped up (lowest hashes first) so at least `minimum` are validation."""
    splits = {i: split_of(i, validation_share) for i in instance_ids}
    short = -(-int(minimum * 1000) * len(instance_ids) // 1000) - sum(s == "validation" for s in splits.values())
    for instance_id in sorted((i for i in instance_ids if splits[i] == "train"), key=_fraction)[:max(short, 0)]:
        splits[instance_id] = "validation"
    return splits

"""A coding task in the SWE-bench instance format (what SWE-smith, SWE-Gym and SWE-bench files hold)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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

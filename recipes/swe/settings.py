"""The coding recipe's settings: every variable of the environment the recipe reads is read here.

The processes that need them are started by others (the harness by the controller, as an agent;
the re-grade reward function inside `replay rebuild`; the grader by the recipe or by hand), so
the environment is how settings reach them. A model is read when it is used
(`from_environment(SweSettings)`), not at import, so a process sees the environment it runs with; an
empty variable counts as unset.

    SweSettings           AGENTSTREAM_SWE_* folders: where the repositories, test environments,
                          workspaces, public index and re-grade instances are
    AttemptSettings       AGENTSTREAM_SWE_* of the harness: how it runs an attempt (its own model, so a
                          bad value there never stops the grader or the builder)
    AgentEnvironment      what the controller gives every agent (controller/README.md)
    WholeHarnessSettings  the installed CLI agents (AGENTSTREAM_CODEX, AGENTSTREAM_CLAUDE_CODE, AGENTSTREAM_OPENCODE) and
                          their own extra arguments (AGENTSTREAM_WHOLE_ARGS)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from agentstream.schemas.errors import ConfigurationError
from agentstream.settings import agentstream_home

DEFAULT_CONFIG = Path(__file__).parent / "mini.yaml"


class SweSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTSTREAM_SWE_", env_ignore_empty=True, extra="ignore")

    repos: Path = Field(default_factory=lambda: agentstream_home() / "swe" / "repos",
                        description="where the task repositories are, as <owner>__<name> git repositories")
    envs: Path = Field(default_factory=lambda: agentstream_home() / "swe" / "envs",
                       description="where the test environments (a venv with pytest per repository) are")
    index: Path | None = Field(None, description="the public index of the tasks (instance_id, repo, base_commit), "
                                                 "for task inputs that carry only the instance id")
    instances: Path | None = Field(None, description="the instances file (with the hidden tests) `regrade` "
                                                     "grades with")
    workspace: Path | None = Field(None, description="parent folder of the attempts' workspaces (default: a temp "
                                                     "folder)")


class AttemptSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTSTREAM_SWE_", env_ignore_empty=True, extra="ignore")

    config: Path = Field(DEFAULT_CONFIG, description="the mini-swe-agent YAML the harness starts from")
    step_limit: int = Field(20, description="model calls of one attempt")
    max_tokens: int = Field(512, description="tokens of one model answer")
    temperature: float = Field(1.0, description="sampling temperature of the model's answers")
    command_timeout_s: int = Field(60, description="wall clock of one command in the sandbox")
    attempt_timeout_s: int = Field(1800, description="wall clock of all of an attempt's commands in the sandbox")
    script: list[str] | None = Field(None, description="a JSON list of commands run instead of asking a model "
                                                       "(the scripted baseline)")
    model_kwargs: dict[str, Any] = Field(default_factory=dict,
                                         description="JSON object added to litellm's arguments, e.g. stop words")
    demonstrations: Path | None = Field(None, description="a demonstrations file (`tasks swe demonstrate`): the "
                                                          "served model is made to answer its task's expert answers")


class AgentEnvironment(BaseSettings):
    """The variables every agent the controller starts is given, under their own names."""

    model_config = SettingsConfigDict(env_ignore_empty=True, extra="ignore")

    openai_base_url: str = Field("", description="the attempt's gateway URL (…/rollouts/{id}/attempts/{id}/v1)")
    openai_api_key: str = Field("", description="the rollout token, the agent's one credential")
    agentstream_task: Path | None = Field(None, description="the JSON file of the task's input")
    agentstream_model: str = Field("default", description="the model name to ask the gateway for")


class WholeHarnessSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTSTREAM_", env_ignore_empty=True, extra="ignore")

    codex: str | None = Field(None, description="the `codex` command: bin/codex.js of the pinned npm package "
                                                "(scripts/npm-tool.sh codex prints it)")
    claude_code: str | None = Field(None, description="the `claude` binary (scripts/npm-tool.sh claude-code prints it)")
    opencode: str | None = Field(None, description="the `opencode` binary (scripts/npm-tool.sh opencode prints it)")
    opencode_config: dict[str, Any] = Field(default_factory=dict, description="a JSON object merged over the "
                                                                               "opencode config the harness makes")
    whole_args: list[str] = Field(default_factory=list, description="a JSON list of extra arguments for the "
                                                                    "harness (its own config)")


S = TypeVar("S", bound=BaseSettings)


def from_environment(model: type[S]) -> S:
    """The settings as the environment says now; a bad value is a ConfigurationError naming its variable."""
    try:
        return model()
    except ValidationError as exc:
        prefix = model.model_config.get("env_prefix", "")
        problems = [f"{prefix}{'.'.join(str(part) for part in error['loc']).upper()}: {error['msg']}"
                    for error in exc.errors(include_url=False)]
        raise ConfigurationError(f"bad settings in the environment: {'; '.join(problems)} (what each takes: "
                                 "recipes/swe/settings.py)") from exc

"""Settings of the local stack itself (each service has its own settings model): read from the environment here,
and nowhere else."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class StackSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTSTREAM_", env_ignore_empty=True, extra="ignore")

    home: Path = Field(Path("~/.cache/agentstream"), description="where the local stack keeps its caches and data")
    java_home: Path | None = Field(None, validation_alias=AliasChoices("JAVA_HOME"),
                                   description="the Java the local Kafka broker runs on (default: `java` on PATH)")
    vllm_cpu_kvcache_space: int | None = Field(
        None, validation_alias=AliasChoices("VLLM_CPU_KVCACHE_SPACE"),
        description="GiB of KV cache of a local vLLM-CPU server (default: what one sequence of its context needs)")


def agentstream_home() -> Path:
    """Where the local stack keeps its caches and data: AGENTSTREAM_HOME, else ~/.cache/agentstream."""
    return StackSettings().home.expanduser()

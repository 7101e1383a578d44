"""The decision service's settings: environment (AGENTSTREAM_*), or the same names as `python -m agentstream.releases` flags."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from agentstream.schemas.kafka import KafkaSettings


class ReleasesSettings(KafkaSettings):
    """Decide each canary: promote it to every session, or roll it back (`releases/rule.py`)."""

    model_config = SettingsConfigDict(cli_prog_name="python -m agentstream.releases")

    alpha: float = Field(0.05, gt=0, lt=1, description="chance of promoting a canary that is no better (and of "
                         "rolling back one that is `min_lift` better), however often the service looks")
    lift: float = Field(0.1, gt=0, description="the lift in mean reward the test is tuned to find (its mixture's "
                        "scale), and the one whose power the `measure` events report")
    min_lift: float = Field(0.0, ge=0, description="roll back once the canary is known to be less than this much "
                            "better; 0: once it is known to be worse")
    min_sessions: int = Field(30, ge=2, description="sessions with a reward each arm needs before any test")
    max_sessions: int = Field(0, ge=0, description="sessions per arm after which a canary that is not better is "
                              "rolled back (keep what is known); 0: wait for as long as it takes")
    min_calls: int = Field(30, ge=1, description="calls each arm needs before the error and latency guards apply")
    max_error_rate_increase: float = Field(
        0.05, ge=0, description="roll back when the canary's share of 5xx calls exceeds the stable's by more")
    max_latency_ratio: float = Field(
        1.5, gt=0, description="roll back when the canary's p95 latency exceeds the stable's by this factor")
    interval_s: float = Field(5.0, gt=0, description="seconds between evaluations (and `measure` events)")
    source: str = Field("releases", description="the `source` of the events this service writes")
    log_level: str = Field("info", description="debug, info, warning or error")

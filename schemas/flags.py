"""Every entrypoint's settings from its command line and environment: `parse(Model, argv)`.

A service's flags are its settings model's fields (pydantic-settings' CLI, kebab-case, `--help` from the
descriptions). A bad setting stops the process before it does anything, with one line that names the setting
(its flag and its variable), the value given, and why it is refused, and exit code 2 (a usage error), never a
traceback: `error: --lr (AGENTSTREAM_LR) = '-1': Input should be greater than 0`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from pydantic import AliasChoices, BaseModel, ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, CliApp, SettingsError

from agentstream.schemas.errors import ConfigurationError

Settings = TypeVar("Settings", bound=BaseSettings)

USAGE = 2
"""the exit code of a bad setting (argparse's, for a usage error)"""


class BadSetting(ConfigurationError):
    """A setting refused, said in one line naming it (`str()`)."""


def parse(model: type[Settings], argv: Sequence[str] | None = None, flag_prefix: str = "") -> Settings:
    """`model` from `argv` (default: this process's arguments) and the environment; a bad setting is one line on
    stderr and exit code 2. `flag_prefix` names the flags as a preset takes them (`trainer.`: `--trainer.lr`)."""
    try:
        return read(model, argv, flag_prefix)
    except BadSetting as exc:
        refuse(str(exc))


def read(model: type[Settings], argv: Sequence[str] | None = None, flag_prefix: str = "",
         given: Mapping[str, Any] | None = None) -> Settings:
    """`model` from `argv` over `given` over the environment; a bad setting raises `BadSetting`, one line."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return CliApp.run(model, cli_args=args, cli_exit_on_error=False, **(given or {}))
    except ValidationError as exc:
        raise BadSetting(said(model, exc.errors(include_url=False), flag_prefix)) from None
    except SettingsError as exc:  # what argparse refuses (an unknown flag) or a value that is not JSON
        raise BadSetting(" ".join(str(exc).removeprefix("error parsing CLI: ").split())) from None


def said(model: type[BaseModel], errors: Sequence[ErrorDetails], flag_prefix: str = "") -> str:
    """Validation errors as one line: each setting's flag and variable, the value given, why it is refused."""
    return "; ".join(problem(model, error, flag_prefix) for error in errors)


def problem(model: type[BaseModel], error: ErrorDetails, flag_prefix: str = "") -> str:
    why = " ".join(error["msg"].removeprefix("Value error, ").split())
    if not error["loc"]:
        return why
    field, *inner = (str(part) for part in error["loc"])
    where = f"--{flag_prefix}{field.replace('_', '-')}" + "".join(f"[{part}]" for part in inner)
    if field in model.model_fields:
        where += f" ({env_name(model, field)})"
    if error["type"] == "missing":
        return f"{where}: missing"
    return f"{where} = {shown(error['input'])}: {why}"


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "…"


def env_name(model: type[BaseModel], field: str) -> str:
    """The variable a settings model reads a field from: its alias in capitals where it has one
    (KAFKA_BOOTSTRAP_SERVERS), else the model's prefix and the field's name."""
    alias = model.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        named = [choice for choice in alias.choices if isinstance(choice, str) and choice.isupper()]
        if named:
            return named[0]
    return f"{model.model_config.get('env_prefix', '')}{field.upper()}"


def refuse(message: str) -> NoReturn:
    """A bad setting's one line on stderr, and exit code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE)

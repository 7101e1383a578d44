"""Any service setting of a preset's loop, set from the preset's command line as `--<service>.<field>`.

`agentstream demo --trainer.lr 1e-4 --streams.settle-s 1` gives the trainer `--lr 1e-4` and the streams worker
`--settle-s 1` over what the preset derives for them: the service's own settings model reads them with its own
parser (`schemas.flags`), so no preset declares a service's setting again, and a bad one is refused before anything
starts, named as the preset takes it (`--trainer.lr`).

A preset's per-model defaults are partial settings of the services (`partial(TrainerSettings, lr=3e-3)`): typed,
checked as the service checks them, and only the fields given apply (`given`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsError

from agentstream.schemas.flags import BadSetting, read, said

Settings = TypeVar("Settings", bound=BaseSettings)
Model = TypeVar("Model", bound=BaseModel)

ServiceFlags = dict[str, list[str]]
"""service name (a field of the preset's `Loop`) → the flags given to it: `--trainer.lr 1e-4` → {"trainer": ["--lr",
"1e-4"]}"""


def split(args: Sequence[str], services: Mapping[str, type[BaseSettings]]) -> ServiceFlags:
    """The preset's extra arguments by service, each checked with the service's own parser (what the preset gives
    it, e.g. the required task file, aside): a bad one raises `BadSetting` naming it as given."""
    flags: ServiceFlags = {}
    current: list[str] | None = None
    for arg in args:
        name, dot, rest = arg.removeprefix("--").partition(".")
        if arg.startswith("--") and dot:
            if name not in services:
                raise BadSetting(f"{arg.partition('=')[0]}: this command runs no {name!r}; its services: "
                                 f"{', '.join(services)} (--SERVICE.SETTING VALUE)")
            current = flags.setdefault(name, [])
            current.append(f"--{rest}")
        elif current is not None and not arg.startswith("--"):
            current.append(arg)
        else:
            raise BadSetting(f"unexpected argument {arg!r}: a service's setting is --SERVICE.SETTING VALUE")
    for name, given_flags in flags.items():
        check(services[name], given_flags, f"{name}.")
    return flags


def check(kind: type[BaseSettings], flags: list[str], flag_prefix: str) -> None:
    """The flags as the service reads them; only what the preset itself gives may be missing."""
    try:
        CliApp.run(kind, cli_args=flags, cli_exit_on_error=False)
    except ValidationError as exc:
        errors = [error for error in exc.errors(include_url=False) if error["type"] != "missing" and error["loc"]]
        if errors:
            raise BadSetting(said(kind, errors, flag_prefix)) from None
    except SettingsError as exc:  # argparse names the flags as the service takes them: named as given here
        said_there = " ".join(str(exc).removeprefix("error parsing CLI: ").split())
        raise BadSetting(said_there.replace(" --", f" --{flag_prefix}")) from None


def overridden(settings: Settings, flags: list[str], flag_prefix: str) -> Settings:
    """`settings` as the service reads them with `flags` over them (its own parser: flags win)."""
    return read(type(settings), flags, flag_prefix, given(settings))


def partial(kind: type[Model], **fields: Any) -> Model:
    """Settings of `kind` that a preset gives (only these apply: `given`), checked as the service checks them; a
    name the service does not have is refused."""
    if unknown := sorted(set(fields) - set(kind.model_fields)):
        raise ValueError(f"{kind.__name__} has no setting {', '.join(unknown)}")
    # checked by validation, which reads the environment as a settings model's constructor does; built from the
    # given fields alone, so that KAFKA_BOOTSTRAP_SERVERS in the shell is not a field the preset "gives"
    checked = kind.model_validate(fields)
    return kind.model_construct(_fields_set=set(fields), **{name: getattr(checked, name) for name in fields})


def given(settings: BaseModel) -> dict[str, Any]:
    """The fields `settings` was given, as values its model takes back."""
    return {name: getattr(settings, name) for name in settings.model_fields_set}

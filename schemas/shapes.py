"""The models' shapes for the native check (`agentstream_native.Shape`, native/src/shapes.rs): a batch
whose records all fit is read without pydantic, straight into columns or with orjson.

A record fits when pydantic's strict validation (`codec.decode`) would take it and give the values
read without it: the model's keys and no others (a missing one only where it has a fixed default),
each value of its field's type. Never looser than pydantic: where in doubt (NaN, an int beyond 64
bits, a repeated key, a lone surrogate) a record does not fit, and its reader decodes it as before.
"""

from __future__ import annotations

import types
import typing
from functools import cache
from typing import TYPE_CHECKING, Any

from agentstream_native import Shape
from pydantic import BaseModel

from agentstream.schemas.events import SCHEMA_VERSION, Event

if TYPE_CHECKING:
    from agentstream_native import Form

FRESH = frozenset({"id", "time"})
"""envelope fields whose default is made when decoding (a new id, the clock): a record without them
differs run to run, so it does not fit, and pydantic decodes it as before"""


@cache
def shape(model: type[Event], tagged: bool = False, take: tuple[str, ...] = ()) -> Shape:
    """The native check of an event type. `tagged`: the `type` key is required, as when an event is
    decoded as any event (the union picks the model by it); otherwise it may be left out (its default).
    `take`: envelope keys (texts: `id`, `rollout_id`) whose values `Shape.check` also returns."""
    return Shape(_object(model, envelope=True, tagged=tagged), list(take))


def _object(model: type[BaseModel], envelope: bool = False, tagged: bool = False) -> Form:
    # a form checks types only: a validator or a constraint (ge=, max_length=, ...) would make it looser
    # than pydantic, so a model with one has no form (and `shape` fails where it is made: a test builds all)
    decorators = model.__pydantic_decorators__
    if decorators.field_validators or decorators.model_validators or decorators.validators:
        raise TypeError(f"{model.__name__} has validators: no native form checks them")
    members = []
    for name, info in model.model_fields.items():
        if info.metadata:
            raise TypeError(f"{model.__name__}.{name} is constrained ({info.metadata}): no native form checks it")
        required = info.is_required() or (envelope and (name in FRESH or name == "schema_version"
                                                        or (name == "type" and tagged)))
        form = ("range", 1, SCHEMA_VERSION) if envelope and name == "schema_version" else _form(info.annotation)
        members.append((name, form, required))
    return ("object", members)


def _form(annotation: Any) -> Form:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        if len(present) != 1:
            raise TypeError(f"no native form for {annotation}")
        return ("optional", _form(present[0])) if len(present) < len(args) else _form(present[0])
    if origin is typing.Literal and all(type(a) is str for a in args):
        return ("literal", list(args))
    if origin is list:
        return ("list", _form(args[0]))
    if origin is dict and args[0] is str:
        return ("dict", _form(args[1]))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _object(annotation)
    if annotation is Any:
        return "any"
    forms = {bool: "bool", int: "int", float: "float", str: "str"}  # (`is`: bool is an int to issubclass)
    for kind, form in forms.items():
        if annotation is kind:
            return form
    raise TypeError(f"no native form for {annotation}")

"""`agentstream canary`: the releases the log holds, and a human's promote or rollback (releases/manual.py)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import typer

from agentstream.cli.options import TopicPrefix, kafka_settings
from agentstream.cli.output import console, fail

ModelOption = Annotated[str | None, typer.Option("--model", help="the served model name")]
Reason = Annotated[str, typer.Option(help="why (recorded in the event)")]


def canary_status(model: ModelOption = None, topic_prefix: TopicPrefix = "") -> None:
    """Each model's release as the log says: running, promoted or rolled back, with the arms' numbers (JSON)."""
    import orjson

    from agentstream.releases.manual import release_states
    from agentstream.schemas.releases import summary

    states = asyncio.run(release_states(kafka_settings(topic_prefix)))
    chosen = [state for name, state in sorted(states.items()) if model is None or name == model]
    if model is not None and not chosen:
        fail(f"model {model!r} has no release in the log (known: {', '.join(sorted(states)) or 'none'})")
    print(orjson.dumps([summary(state) for state in chosen], option=orjson.OPT_INDENT_2).decode())


def canary_promote(model: ModelOption = None, reason: Reason = "", topic_prefix: TopicPrefix = "") -> None:
    """Promote the running canary of a model to every session now."""
    _decide(model, "promote", reason, topic_prefix)


def canary_rollback(model: ModelOption = None, reason: Reason = "", topic_prefix: TopicPrefix = "") -> None:
    """Roll back the running canary of a model: its sessions return to the stable version."""
    _decide(model, "rollback", reason, topic_prefix)


def _decide(model: str | None, action: Literal["promote", "rollback"], reason: str, topic_prefix: str) -> None:
    from agentstream.releases.manual import decide

    if model is None:
        fail("name the model: --model M")
    event = asyncio.run(decide(kafka_settings(topic_prefix), model, action, reason))
    console.print(f"{action} of {model} version {event.data.version} recorded (event {event.id}); "
                  "the gateway's pool sync applies it")

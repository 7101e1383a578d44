"""`agentstream canary`: the releases the log holds, and a human's promote or rollback (releases/manual.py)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import typer

from agentstream.cli.options import TopicPrefix, kafka_settings
from agentstream.cli.output import console, fail

ModelOption = Annotated[str | None, typer.Option("--model", help="the served model name")]
TenantOption = Annotated[str | None, typer.Option("--tenant", help="a tenant's adapter canary over the model (not "
                                                                   "the model's own)")]
Reason = Annotated[str, typer.Option(help="why (recorded in the event)")]


def canary_status(model: ModelOption = None, tenant: TenantOption = None, topic_prefix: TopicPrefix = "") -> None:
    """Each model's (and tenant's) release as the log says: running, promoted or rolled back, with the arms' numbers
    (JSON)."""
    import orjson

    from agentstream.releases.manual import release_states
    from agentstream.schemas.releases import ordered, summary

    states = asyncio.run(release_states(kafka_settings(topic_prefix)))
    chosen = [state for state in ordered(states) if (model is None or state.current.model == model)
              and (tenant is None or state.current.tenant == tenant)]
    if (model is not None or tenant is not None) and not chosen:
        known = ", ".join(f"{name}" + (f" (tenant {whose})" if whose else "") for name, whose in sorted(
            states, key=lambda key: (key[0], key[1] or ""))) or "none"
        fail(f"no release of {model or 'any model'}{f' for tenant {tenant}' if tenant else ''} in the log "
             f"(known: {known})")
    print(orjson.dumps([summary(state) for state in chosen], option=orjson.OPT_INDENT_2).decode())


def canary_promote(model: ModelOption = None, tenant: TenantOption = None, reason: Reason = "",
                   topic_prefix: TopicPrefix = "") -> None:
    """Promote the running canary of a model (or of a tenant's adapter) to every session now."""
    _decide(model, tenant, "promote", reason, topic_prefix)


def canary_rollback(model: ModelOption = None, tenant: TenantOption = None, reason: Reason = "",
                    topic_prefix: TopicPrefix = "") -> None:
    """Roll back the running canary of a model (or of a tenant's adapter): its sessions return to the stable
    version."""
    _decide(model, tenant, "rollback", reason, topic_prefix)


def _decide(model: str | None, tenant: str | None, action: Literal["promote", "rollback"], reason: str,
            topic_prefix: str) -> None:
    from agentstream.releases.manual import decide

    if model is None:
        fail("name the model: --model M")
    event = asyncio.run(decide(kafka_settings(topic_prefix), model, action, reason, tenant=tenant))
    whose = f"{model} (tenant {tenant})" if tenant else model
    console.print(f"{action} of {whose} version {event.data.version} recorded (event {event.id}); "
                  "the gateway's pool sync applies it")

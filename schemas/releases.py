"""Canary releases: which sessions a canary serves, and a model's release state as the log says it.

A session's bucket is `HMAC-SHA256(arm key, sticky key) mod 10,000`; the canary serves the sessions whose
bucket is below its share (basis points). The sticky key is the one the pool routes by (a session's rollout
id, `schemas.sessions.session_rollout_id`, or a rollout's), so a session's arm needs no state: every gateway
replica computes the same, before and after a restart. The arm key is a server secret
(`GatewaySettings.arm_key`): a client that chooses its session ids cannot choose, or predict, its arm (with
no secret at all the bucket is a plain SHA-256, which it can). The release state of each model, and of each
tenant's adapter over it, is the fold of its `release` events (topic `releases`, one partition, keyed by model;
a state per `(model, tenant)`, so a tenant's canary is decided apart from the base's and every other tenant's):
every replica, the decision service, the CLI and the dashboard read the same events and agree.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from agentstream.schemas.events import Release, ReleaseEvent
from agentstream.schemas.ids import derived_id

BUCKETS = 10_000

ReleaseKey = tuple[str, str | None]
"""(model, tenant): the base model's releases under tenant None, each tenant's adapter's under its name"""


def key_of(release: Release) -> ReleaseKey:
    return release.model, release.tenant


def decision_id(release: Release) -> str:
    """The id of a decision about a canary (promote or rollback): whoever publishes it (the rule, the applier
    promoting a replaced canary), one event."""
    tenant = () if release.tenant is None else (release.tenant,)
    return derived_id("release", release.action, release.model, str(release.version), str(release.started_at),
                      *tenant)


def adapter_name(tenant: str, version: int) -> str:
    """The model name a tenant's adapter is served and recorded as (its call events' `model`)."""
    return f"{tenant}@{version}"


def bucket(sticky_key: str, arm_key: bytes = b"") -> int:
    """The session's bucket in [0, 10,000): the same on every replica and after restarts; keyed by `arm_key`."""
    data = sticky_key.encode()
    digest = hmac.digest(arm_key, data, "sha256") if arm_key else hashlib.sha256(data).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


def in_canary(sticky_key: str | None, share_bp: int, arm_key: bytes = b"") -> bool:
    """Whether the session keyed `sticky_key` is on the canary (a call without one stays on the stable version)."""
    return sticky_key is not None and bucket(sticky_key, arm_key) < share_bp


def canary_servers(urls: Iterable[str], count: int) -> list[str]:
    """The servers of a model that take a canary: the last `count` by URL, at least one server left stable."""
    ordered = sorted(urls)
    count = min(count, len(ordered) - 1)
    return ordered[len(ordered) - count:] if count > 0 else []


@dataclass
class ReleaseState:
    """A model's release as the log says: the last step that changed routing, and the last numbers."""

    current: Release
    measured: Release | None = None
    decided_at: int | None = None

    @property
    def active(self) -> bool:
        """A canary is running: sessions are split between two versions."""
        return self.current.action == "canary"

    @property
    def phase(self) -> str:
        return {"canary": "running", "promote": "promoted", "rollback": "rolled back"}[self.current.action]


def fold(states: dict[ReleaseKey, ReleaseState], event: ReleaseEvent) -> ReleaseState | None:
    """Apply one release event to the models' (and tenants') states; the state it changed (None for a stale event).

    A measure or a decision applies to the canary it names (`version`, `started_at`): one about a canary
    that was replaced or already decided changes nothing, so a late or repeated event is harmless."""
    release = event.data
    state = states.get(key_of(release))
    if release.action == "canary":
        if state is not None and _same_canary(state.current, release):
            return None  # read again (the applier folds its own event before its replica's follower does)
        states[key_of(release)] = state = ReleaseState(release)
        return state
    if state is None or not _same_canary(state.current, release):
        return None
    if release.action == "measure":
        if state.active:
            state.measured = release
        return state
    if not state.active:
        return None  # decided already: the first decision stands
    state.current, state.decided_at = release, event.time
    return state


def _same_canary(a: Release, b: Release) -> bool:
    return a.version == b.version and a.started_at == b.started_at


def summary(state: ReleaseState) -> dict[str, object]:
    """One model's release as the CLI and the dashboard show it: the decision's numbers, else the last measured."""
    current = state.current
    numbers = (state.measured or current) if state.active else current
    return {"model": current.model, "tenant": current.tenant, "phase": state.phase, "version": current.version,
            "stable_version": current.stable_version, "share": current.share_bp / BUCKETS, "servers": current.servers,
            "started_at": current.started_at, "decided_at": state.decided_at,
            "decided_by": None if state.active else current.decided_by, "reason": numbers.reason,
            "p_value": numbers.p_value, "numbers": numbers.numbers, "arms": [arm.model_dump() for arm in numbers.arms]}


def successor(state: ReleaseState) -> Release | None:
    """What happens to the stable arm when a new version replaces the running canary: the replaced canary is
    promoted (`decided_by: replaced`) when its last measurement had it leading, with each arm measured; else
    the stable version stays and the replaced canary is dropped undecided.

    A looser bar than the rule's promotion, on purpose: without it a trainer faster than the canary's traffic
    keeps most sessions on an old version, whose samples go stale. The next canary is measured against the
    replaced one, and rolled back if it is worse."""
    measured = state.measured
    if not state.active or measured is None or len(measured.arms) != 2:
        return None
    stable, canary = measured.arms
    needed = measured.numbers.get("min_sessions", 1)
    if (stable.mean_reward is None or canary.mean_reward is None or min(stable.sessions, canary.sessions) < needed
            or canary.mean_reward <= stable.mean_reward):
        return None
    return measured.model_copy(update=dict(
        action="promote", decided_by="replaced",
        reason=f"replaced by a newer version while leading: mean reward {canary.mean_reward:.3g} against "
               f"{stable.mean_reward:.3g} ({canary.sessions} and {stable.sessions} sessions)"))


def stable_of(state: ReleaseState | None) -> tuple[int, str] | None:
    """The version (and its checkpoint) that serves everyone outside a canary, per the log."""
    if state is None:
        return None
    release = state.current
    if release.action == "promote":
        return release.version, release.uri
    return release.stable_version, release.stable_uri


def ordered(states: dict[ReleaseKey, ReleaseState]) -> list[ReleaseState]:
    """The states by model, each model's own release before its tenants' (by tenant)."""
    return [states[key] for key in sorted(states, key=lambda key: (key[0], key[1] is not None, key[1] or ""))]

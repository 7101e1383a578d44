"""Routing under a canary: which of a model's servers a session tries first.

The release state comes from the `releases` topic (`gateway/pool_sync.py` folds it, `schemas.releases`);
this module only orders servers by it. During a canary a session whose bucket (keyed by a server secret: no
client can pick it) is below the share goes to the canary's servers, every other one to the rest; after a rollback, servers still on the canary's
version come last until they serve the stable one again. The other arm's servers stay in the list, after
the arm's: a call fails over to them rather than fail (its call event names the version that served it,
so the canary's numbers stay honest).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from agentstream.schemas.releases import ReleaseState, in_canary


class Server(Protocol):
    url: str
    weight_version: int | None


S = TypeVar("S", bound=Server)


def arm_first(state: ReleaseState | None, sticky_key: str | None, servers: list[S], arm_key: bytes = b"") -> list[S]:
    """`servers` (in their order) with the session's arm first (its bucket keyed by the server secret `arm_key`)."""
    if state is None:
        return servers
    release = state.current
    if release.action == "canary":
        canary = set(release.servers)
        wanted = in_canary(sticky_key, release.share_bp, arm_key)
        arm = [server for server in servers if (server.url in canary) == wanted]
    elif release.action == "rollback":
        arm = [server for server in servers if server.weight_version != release.version]
    else:
        return servers
    return arm + [server for server in servers if server not in arm]

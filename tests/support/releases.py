"""A release event as the releases service writes it, for the releases' and the dashboard's tests."""

from __future__ import annotations

from agentstream.schemas.events import Release, ReleaseEvent


def release(action: str, version: int = 2, started_at: int = 1000, **changes) -> ReleaseEvent:
    data = Release(model="tiny", action=action, version=version, uri=f"/ckpt/{version}", stable_version=1,
                   stable_uri="/ckpt/1", share_bp=2500, servers=["http://b"], started_at=started_at, **changes)
    return ReleaseEvent(source="test", data=data)

"""The private parts of Ray that trainer/ranks.py sets (`join_with_token`), pinned: a Ray driver reads these only
from the process environment, so the trainer writes the variables and refreshes Ray's two configs by private
names; an upgrade that renames one would leave the setting silently unapplied."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.upstream


def test_ray_constants_and_the_raylet_config_are_where_the_trainer_refreshes_them():
    from ray._private import ray_constants
    from ray._raylet import Config  # type: ignore[attr-defined]

    assert hasattr(ray_constants, "RAY_ENABLE_UV_RUN_RUNTIME_ENV"), "ranks.join_with_token sets it"
    assert callable(Config.initialize), "ranks.join_with_token re-reads Ray's C++ config with it"

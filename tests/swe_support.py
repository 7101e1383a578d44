"""A small toolz task set, built once per test session (real sandbox), shared by the SWE tests.

The sdist and the test venv live in the real AGENTSTREAM_HOME (cached like the Kafka jars); the
repositories the build writes go to a fresh folder of this session.
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path

from recipes.swe.build import Built, build

LIMIT = 2


@cache
def built() -> tuple[Built, Path]:
    repos_dir = Path(tempfile.mkdtemp(prefix="swe-repos-"))
    return build(limit=LIMIT, seed=0, repos_dir=repos_dir, workers=2), repos_dir

"""Settings of the `agentstream` command itself (each service has its own settings model)."""

from __future__ import annotations

import os
from pathlib import Path


def agentstream_home() -> Path:
    """Where the local stack keeps its caches and data: AGENTSTREAM_HOME, else ~/.cache/agentstream."""
    return Path(os.environ.get("AGENTSTREAM_HOME") or "~/.cache/agentstream").expanduser()

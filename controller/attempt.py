"""One attempt at a rollout: what the agent is given, and how its run ended.

Both launchers give the agent the same environment; only how the task file reaches it differs
(a file in the attempt's folder locally, a downward-API volume in a Kubernetes pod).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from agentstream.controller.history import AttemptRecord
from agentstream.controller.tasks import PlannedRollout
from agentstream.schemas.errors import ServiceError
from agentstream.schemas.tokens import mint_rollout_token

TOKEN_MARGIN_S = 3600.0
"""how long a rollout token outlives the attempt's timeout (rewards may be posted late)"""


@dataclass(frozen=True)
class Attempt:
    rollout: PlannedRollout
    attempt_id: str
    attempt_number: int
    weight_version: int | None
    dir: Path
    """the attempt's folder: task.json, stdout, stderr"""

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id


@dataclass(frozen=True)
class Gateway:
    url: str
    token_secret: str
    model: str | None = None
    tenant: str | None = None


def agent_env(gateway: Gateway, attempt: Attempt, task_path: str, timeout_s: float) -> dict[str, str]:
    """The variables an agent reads: all it knows of agentstream."""
    base = gateway.url.rstrip("/")
    rollout, attempt_id = attempt.rollout_id, attempt.attempt_id
    env = {
        "OPENAI_BASE_URL": f"{base}/rollouts/{rollout}/attempts/{attempt_id}/v1",
        "OPENAI_API_KEY": mint_rollout_token(gateway.token_secret, rollout, attempt_id, ttl_s=timeout_s + TOKEN_MARGIN_S,
                                             graded=attempt.rollout.task.graded, tenant=gateway.tenant),
        "AGENTSTREAM_ROLLOUT_ID": rollout,
        "AGENTSTREAM_ATTEMPT_ID": attempt_id,
        "AGENTSTREAM_TASK": task_path,
        "AGENTSTREAM_REWARD_URL": f"{base}/rollouts/{rollout}/reward",
    }
    if gateway.model:
        env["AGENTSTREAM_MODEL"] = gateway.model
    return env


@dataclass(frozen=True)
class Exit:
    """How an agent's run ended, as the launcher saw it."""

    exit_code: int | None
    """negative: killed by that signal (local); None: unknown (e.g. no pod was ever scheduled)"""
    error: str | None = None
    """None when the agent succeeded"""
    stdout_tail: str = ""
    stderr_tail: str = ""
    timed_out: bool = False
    """the backend itself enforced the deadline (Kubernetes activeDeadlineSeconds)"""


class LaunchError(ServiceError):
    """The attempt could not be started; recorded as a failed attempt."""


class Running(Protocol):
    worker: str
    """what runs it: 'pid N on HOST', or the Job's name"""

    async def wait(self) -> Exit:
        """Until the agent ends by itself."""

    async def stop(self) -> None:
        """End it now (timeout or shutdown): SIGTERM, a grace period, SIGKILL; or delete the Job."""

    async def close(self) -> tuple[str, str]:
        """After it ended, release what is left (stray processes, the Job); return the output tails."""


class Launcher(Protocol):
    @property
    def name(self) -> Literal["local", "kubernetes"]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def launch(self, attempt: Attempt, gateway: Gateway) -> Running: ...

    async def reap(self, run_id: str, interrupted: list[AttemptRecord]) -> None:
        """Stop whatever still runs of attempts a previous controller left behind."""


def tail_text(path: Path, chars: int) -> str:
    """The last `chars` characters of a file that may not be valid UTF-8 (agents print anything)."""
    if chars <= 0:
        return ""
    try:
        with path.open("rb") as out:
            out.seek(0, 2)
            size = out.tell()
            out.seek(max(0, size - 4 * chars))
            return out.read().decode("utf-8", "replace")[-chars:]
    except FileNotFoundError:
        return ""

"""mini-swe-agent's Environment, backed by our sandbox: every command the agent issues runs there.

mini-swe-agent takes an environment class by import path (`environment.environment_class:
agentstream.recipes.swe.environment.SandboxEnvironment`), so the harness itself is unchanged. Each command is
one `Sandbox.run` in tools-only mode: the workspace is the only writable tree, there is no network
and no variable of the harness (its rollout token above all) leaks in. The result is what
mini-swe-agent's own environments return (`output`, `returncode`, `exception_info`), including its
convention for ending a task (`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` as the first line of output).

A command that breaks a per-command limit is reported to the agent as mini-swe-agent's own
environments report a timeout; once the attempt's wall-clock budget in the sandbox is spent, the
attempt ends (`SandboxExhausted`) and the harness records the reason.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from agentstream.sandbox.contract import WORKSPACE_MOUNT, CommandResult, Limits, Network, Sandbox, SandboxSpec
from agentstream.schemas.errors import ServiceError

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@sandbox.invalid",
                "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@sandbox.invalid"}
"""so `git commit` works in a sandbox that has no user config"""


class SandboxExhausted(ServiceError):
    """The attempt's wall-clock budget in the sandbox is spent: the attempt ends (outcome sandbox_timeout)."""


class SandboxEnvironmentConfig(BaseModel):
    workspace: str
    """host folder of the checked-out repository (mounted at /workspace)"""
    cwd: str = str(WORKSPACE_MOUNT)
    timeout: int = 60
    """wall clock per command, in seconds"""
    attempt_timeout: int = 1800
    """wall clock of all commands of the attempt, in seconds"""
    env: dict[str, str] = {}
    """the commands' whole environment (PATH and HOME are filled in by the sandbox)"""
    binds: list[tuple[str, str]] = []
    """(host, sandbox) read-only mounts, e.g. the task's Python environment"""


def open_sandbox(spec: SandboxSpec) -> Sandbox:
    """bubblewrap on a host; in a sandbox pod (the controller's Kubernetes Job), the pod itself
    (`sandbox.inpod`). Imported here so the environment depends on the contract only."""
    from agentstream.sandbox.inpod import InPodSandbox, in_sandbox_pod

    if in_sandbox_pod():
        return InPodSandbox(spec)
    from agentstream.sandbox.local import LocalSandbox

    return LocalSandbox(spec)


class SandboxEnvironment:
    def __init__(self, *, config_class: type[SandboxEnvironmentConfig] = SandboxEnvironmentConfig, **kwargs: Any):
        self.config = config_class(**kwargs)
        limits = Limits(command_timeout_s=float(self.config.timeout), attempt_timeout_s=float(self.config.attempt_timeout))
        self.spec = SandboxSpec(workspace=Path(self.config.workspace), limits=limits, network=Network.NONE,
                                binds=[(Path(host), Path(inside)) for host, inside in self.config.binds],
                                env={**GIT_IDENTITY, **self.config.env})
        self.sandbox = open_sandbox(self.spec)
        self.commands = 0
        self.command_s = 0.0
        self.limits_hit: dict[str, int] = {}

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        result = self.sandbox.run(command, timeout_s=timeout or self.config.timeout, cwd=self._relative(cwd))
        self.commands += 1
        self.command_s += result.duration_s
        if result.limit:
            self.limits_hit[result.limit] = self.limits_hit.get(result.limit, 0) + 1
        if result.limit == "attempt_timeout":
            raise SandboxExhausted(f"the attempt's {self.config.attempt_timeout} s in the sandbox are spent")
        output = _observation(result)
        self._check_finished(output)
        return output

    def _relative(self, cwd: str) -> str | None:
        """The contract takes cwd relative to the workspace; mini-swe-agent passes absolute paths."""
        cwd = cwd or self.config.cwd
        path = Path(cwd)
        if path.is_absolute():
            try:
                path = path.relative_to(WORKSPACE_MOUNT)
            except ValueError:
                return None  # outside the workspace: run at its root
        return None if str(path) in ("", ".") else str(path)

    def _check_finished(self, output: dict[str, Any]) -> None:
        from minisweagent.exceptions import Submitted

        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}

    def close(self) -> None:
        self.sandbox.close()


def _observation(result: CommandResult) -> dict[str, Any]:
    """mini-swe-agent's shape of a command's result; a broken limit is an exception_info, as its own environments say it."""
    info = ""
    if result.limit:
        info = f"The command was ended: it broke the sandbox's {result.limit.replace('_', ' ')} limit."
    return {"output": result.output, "returncode": result.exit_code, "exception_info": info}

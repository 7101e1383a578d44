"""The coding agent the controller launches: mini-swe-agent, unchanged, on one task (`python -m agentstream.recipes.swe.harness`).

What it is given (by the controller, as any agent is): the task file (`AGENTSTREAM_TASK`: instance id,
repository, base commit, problem statement; never the patch or the hidden tests), the rollout-scoped
`OPENAI_BASE_URL` and `OPENAI_API_KEY` of the gateway, and `AGENTSTREAM_MODEL`.

What it does:
1. checks the task's repository out at its base commit into a fresh workspace;
2. builds mini-swe-agent's model, environment and agent from a mini-swe-agent config file through
   mini-swe-agent's own factories: litellm pointed at the gateway (`api_base`, `api_key` in
   `model_kwargs`), our `SandboxEnvironment` by import path, its `DefaultAgent`;
3. runs the agent on the problem statement;
4. takes the workspace's `git diff` against the base commit (run inside the sandbox: the workspace's
   `.git` is the agent's to tamper with, so no host git ever reads it) and posts it to the gateway's
   diff endpoint with how the agent ended (`outcome`). That event is what the grader scores.

How an attempt ends is always said: `submitted`, `step_limit`, `time_limit`, `format_errors`,
`context_overflow` (a prompt past the model's context), `sandbox_timeout` (the attempt's time in the
sandbox spent), `model_error` (the gateway or model refused), `stopped` (a SIGTERM: the controller's
attempt timeout or its shutdown; the diff so far is posted within the controller's grace period, then
the sandbox is closed). Those exit 0: the attempt is data. A crash of the harness itself exits
non-zero with the traceback on stderr, so the controller records a failed attempt with the reason,
and no diff (so no made-up score) is posted. A SIGTERM before the agent runs exits 143, no diff.
The workspace is removed with `sandbox.hostfs.remove_tree` (no recursion: an agent's tree of any depth
goes).

Settings (environment, `recipes.swe.settings`): AGENTSTREAM_SWE_CONFIG (a mini-swe-agent YAML; default
recipes/swe/mini.yaml), AGENTSTREAM_SWE_STEP_LIMIT, AGENTSTREAM_SWE_MAX_TOKENS, AGENTSTREAM_SWE_TEMPERATURE,
AGENTSTREAM_SWE_COMMAND_TIMEOUT_S, AGENTSTREAM_SWE_ATTEMPT_TIMEOUT_S, AGENTSTREAM_SWE_SCRIPT (a JSON list of
commands: run them instead of asking a model, for baselines), AGENTSTREAM_SWE_DEMONSTRATIONS (a demonstrations
file: the model is made to give the task's expert answers, `recipes.swe.demonstrate`),
AGENTSTREAM_SWE_MODEL_KWARGS (JSON added to litellm's arguments, e.g. stop words), AGENTSTREAM_SWE_REPOS (where
task repositories are), AGENTSTREAM_SWE_ENVS (their test environments), AGENTSTREAM_SWE_INDEX (the public index,
for a task input without its repository), AGENTSTREAM_SWE_WORKSPACE (parent of workspaces; default a temp folder).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from agentstream.recipes.swe.environment import SandboxEnvironment, SandboxExhausted
from agentstream.recipes.swe.settings import AgentEnvironment, AttemptSettings, SweSettings, from_environment
from agentstream.recipes.swe.workspace import TaskInput, checkout, final_diff, test_env_binds
from agentstream.sandbox import hostfs
from agentstream.sandbox.contract import WORKSPACE_MOUNT
from agentstream.sandbox.inpod import in_sandbox_pod
from agentstream.schemas.errors import ConfigurationError

ENVIRONMENT_CLASS = "agentstream.recipes.swe.environment.SandboxEnvironment"

log = logging.getLogger("recipes.swe.harness")

OUTCOMES = {"Submitted": "submitted", "LimitsExceeded": "step_limit", "TimeExceeded": "time_limit",
            "RepeatedFormatError": "format_errors"}
STOPPED_EXIT = 128 + signal.SIGTERM


class Stopped(BaseException):
    """A SIGTERM (`stop_on_sigterm`): the controller ends the attempt. A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on its way (mini-swe-agent's, litellm's) takes it for an error."""


def stop_on_sigterm() -> None:
    """From here on the first SIGTERM raises `Stopped` in the main thread (a sandbox command running then is
    killed); later ones are ignored, so the diff is taken and posted within the controller's grace period
    (its SIGKILL follows it anyway)."""
    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stop)


def finish_on_sigterm() -> None:
    """The agent has ended: a SIGTERM from here on does not interrupt posting its diff."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass(frozen=True)
class HarnessSettings:
    """One attempt's settings: the controller's variables for the agent and the recipe's own."""

    base_url: str
    api_key: str
    model: str
    task: Path
    swe: SweSettings
    attempt: AttemptSettings

    @classmethod
    def from_env(cls) -> HarnessSettings:
        try:
            agent, swe = from_environment(AgentEnvironment), from_environment(SweSettings)
            attempt = from_environment(AttemptSettings)
        except ConfigurationError as exc:
            raise SystemExit(f"harness: {exc}") from exc
        named = {"OPENAI_BASE_URL": agent.openai_base_url, "OPENAI_API_KEY": agent.openai_api_key,
                 "AGENTSTREAM_TASK": agent.agentstream_task}
        if missing := [name for name, value in named.items() if not value]:
            raise SystemExit(f"harness: {', '.join(missing)} not set; the controller sets them (run it as an agent of "
                             "`python -m agentstream.controller --agent 'python -m agentstream.recipes.swe.harness'`)")
        return cls(base_url=agent.openai_base_url, api_key=agent.openai_api_key, model=agent.agentstream_model,
                   task=Path(agent.agentstream_task or ""), swe=swe, attempt=attempt)

    def task_input(self) -> TaskInput:
        """The task's input, with its repository and base commit (from the public index if it lacks them)."""
        return TaskInput.model_validate(orjson.loads(self.task.read_bytes())).located(self.swe.index)


def mini_config(settings: HarnessSettings, task: TaskInput, workspace: Path) -> dict[str, Any]:
    """mini-swe-agent's config: the file's, with the gateway as the model's endpoint and our sandbox."""
    from minisweagent.utils.serialize import recursive_merge

    base = yaml.safe_load(settings.attempt.config.read_text()) or {}
    binds, bin_dir = test_env_binds(task, settings.swe.envs)
    command_env = dict(base.get("environment", {}).get("env") or {})
    if bin_dir:  # the task's Python, with pytest, first on PATH: what the grader runs the tests with
        command_env["PATH"] = f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"
    return recursive_merge(base, {
        "agent": {"agent_class": "default", "step_limit": settings.attempt.step_limit, "cost_limit": 0,
                  "output_path": None},
        "model": {
            # litellm's OpenAI-compatible provider, at the rollout's own base URL with its rollout token
            "model_name": f"openai/{settings.model}",
            "cost_tracking": "ignore_errors",
            "model_kwargs": {"api_base": settings.base_url, "api_key": settings.api_key,
                             "max_tokens": settings.attempt.max_tokens, "temperature": settings.attempt.temperature,
                             "num_retries": 0, **settings.attempt.model_kwargs},
        },
        "environment": {"environment_class": ENVIRONMENT_CLASS, "workspace": str(workspace), "binds": binds,
                        "env": command_env, "timeout": settings.attempt.command_timeout_s,
                        "attempt_timeout": settings.attempt.attempt_timeout_s},
    })


def run_agent(settings: HarnessSettings, task: TaskInput,
              workspace: Path) -> tuple[str, dict[str, Any], SandboxEnvironment]:
    """Run mini-swe-agent to its end; (outcome, details, environment)."""
    import litellm
    from minisweagent.agents import get_agent
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models import get_model

    config = mini_config(settings, task, workspace)
    if settings.attempt.script is not None:
        config["model"] = scripted_model(settings.attempt.script)
    if settings.attempt.demonstrations is not None:
        config["model"] = demonstrating_model(config["model"], settings.attempt.demonstrations, task.instance_id)
    model = get_model(config=config["model"])
    env = get_environment(config["environment"])
    agent = get_agent(model, env, config["agent"])
    # mini_config names both classes; the factories are typed by mini-swe-agent's protocols only
    if not isinstance(env, SandboxEnvironment) or not isinstance(agent, DefaultAgent):
        raise TypeError(f"mini-swe-agent made a {type(agent).__name__} in a {type(env).__name__}: the harness "
                        f"needs its DefaultAgent in {ENVIRONMENT_CLASS}")
    details: dict[str, Any] = {}
    try:
        result = agent.run(task.problem_statement)
        outcome = OUTCOMES.get(result.get("exit_status", ""), str(result.get("exit_status") or "ended").lower())
    except SandboxExhausted as exc:
        outcome, details["error"] = "sandbox_timeout", str(exc)
    except Stopped as exc:
        outcome, details["error"] = "stopped", str(exc)
    except litellm.exceptions.ContextWindowExceededError as exc:
        outcome, details["error"] = "context_overflow", _short(exc)
    except (litellm.exceptions.APIError, litellm.exceptions.OpenAIError) as exc:
        # vLLM refuses an over-long prompt with a 400 that litellm does not always classify
        outcome = "context_overflow" if _is_context_overflow(exc) else "model_error"
        details["error"] = _short(exc)
    details.update(steps=agent.n_calls, commands=env.commands, command_s=round(env.command_s, 3),
                   limits_hit=env.limits_hit)
    return outcome, details, env


def scripted_model(commands: list[str]) -> dict[str, Any]:
    """mini-swe-agent's own deterministic model running `commands` in order: the scripted agent of the
    benchmark's baseline (same harness, sandbox, diff and grading; no model calls)."""
    from minisweagent.models.test_models import make_output

    return {"model_class": "deterministic", "model_name": "scripted",
            "outputs": [make_output(f"THOUGHT: step {n}", [{"command": c}], cost=0.0) for n, c in enumerate(commands)]}


def demonstrating_model(model: dict[str, Any], demonstrations: Path, instance_id: str) -> dict[str, Any]:
    """The configured model, made to answer the task's expert answers (`recipes.swe.expert`)."""
    from agentstream.recipes.swe.expert import load_answers

    return {**model, "model_class": "agentstream.recipes.swe.demonstrating_model.DemonstratingModel",
            "answers": load_answers(demonstrations, instance_id)}


def _is_context_overflow(exc: Exception) -> bool:
    text = str(exc).lower()
    return any(phrase in text for phrase in ("maximum context length", "context length", "too long",
                                             "max_model_len", "maximum model length"))


def _short(exc: Exception, chars: int = 500) -> str:
    return f"{type(exc).__name__}: {exc}"[:chars]


POSTED_DIFF_BYTES = 600 * 1024
"""a longer diff is cut to this before posting: past the gateway's 512 KiB, so it records the diff as truncated
(scored 0), and under its 4 MiB body limit even with JSON's escapes; an agent that wrote a huge file leaves an
attempt in the log, not a harness crash"""


def postable(diff: str, details: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The diff as posted, and the details saying what it was when cut (`diff_bytes`: its whole size)."""
    encoded = diff.encode()
    if len(encoded) <= POSTED_DIFF_BYTES:
        return diff, details
    return encoded[:POSTED_DIFF_BYTES].decode("utf-8", "ignore"), {**details, "diff_bytes": len(encoded),
                                                                   "cut_by_harness": True}


def post_diff(settings: HarnessSettings, task: TaskInput, diff: str, outcome: str, details: dict[str, Any]) -> None:
    """The diff event, through the gateway's diff endpoint (authenticated by the rollout token)."""
    root = settings.base_url.rstrip("/").removesuffix("/v1")  # …/rollouts/{rollout}/attempts/{attempt}
    diff, details = postable(diff, details)
    body = {"instance_id": task.instance_id, "base_commit": task.base_commit, "diff": diff, "outcome": outcome,
            "details": details}
    for attempt in range(5):
        try:
            response = httpx.post(f"{root}/diff", content=orjson.dumps(body), timeout=30,
                                  headers={"Authorization": f"Bearer {settings.api_key}",
                                           "Content-Type": "application/json"})
        except httpx.TransportError as exc:
            log.warning("posting the diff failed (%s); retrying", exc)
            time.sleep(1 + attempt)
            continue
        response.raise_for_status()
        return
    raise RuntimeError(f"could not post the diff to {root}/diff")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    settings = HarnessSettings.from_env()
    task = settings.task_input()
    stop_on_sigterm()
    workspace = attempt_workspace(settings.swe.workspace)
    # mini-swe-agent reads a user config (.env) from its config folder: give it an empty one of its own
    config_dir = Path(tempfile.mkdtemp(prefix="mswea-")) if in_sandbox_pod() else \
        workspace.with_name(workspace.name + ".mswea")
    set_library_environment(config_dir)
    started = time.monotonic()
    env = None
    try:
        baseline = checkout(task, workspace, settings.swe.repos)
        outcome, details, env = run_agent(settings, task, workspace)
        finish_on_sigterm()
        diff, diff_details = final_diff(env.sandbox, baseline)
        details.update(diff_details, duration_s=round(time.monotonic() - started, 2))
        log.info("agent ended: %s after %s steps; diff of %d characters", outcome, details.get("steps"), len(diff))
        post_diff(settings, task, diff, outcome, details)
    except Stopped as exc:
        log.warning("%s before the agent ran: no diff", exc)
        return STOPPED_EXIT
    finally:
        finish_on_sigterm()
        if env is not None:
            env.close()
        if not in_sandbox_pod():  # a pod's workspace is an emptyDir: it goes with the pod
            remove_folder(workspace)
        remove_folder(config_dir)
    return 0


def remove_folder(folder: Path) -> None:
    """A folder the agent may have written (however deep), removed without following a link; what could not
    go is logged, never raised (the diff is posted by now)."""
    if problems := hostfs.remove_tree(folder):
        log.warning("could not remove all of %s: %s", folder, "; ".join(problems[:5]))


def set_library_environment(config_dir: Path) -> None:
    """The one place the harness writes its environment: mini-swe-agent and litellm read these settings
    only from the process environment, when first imported (by `run_agent`, after this): no banner,
    litellm's bundled cost map rather than a fetch from the internet, and mini-swe-agent's config folder."""
    settings = {"MSWEA_SILENT_STARTUP": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "MSWEA_GLOBAL_CONFIG_DIR": str(config_dir)}
    for name, value in settings.items():
        os.environ.setdefault(name, value)


def attempt_workspace(parent: Path | None) -> Path:
    """A fresh folder for the task's checkout, in `parent` (default: the temp folder). In a sandbox pod
    (`AGENTSTREAM_SANDBOX=pod`, set by the controller's Kubernetes Job) the pod's own empty /workspace
    volume, where the commands' paths point."""
    if in_sandbox_pod():
        if not WORKSPACE_MOUNT.is_dir() or any(WORKSPACE_MOUNT.iterdir()):
            raise SystemExit(f"harness: in a sandbox pod {WORKSPACE_MOUNT} must be an empty volume (the Job's "
                             "workspace emptyDir); is the Job made from sandbox.kubernetes.pod_spec?")
        return WORKSPACE_MOUNT
    parent = parent or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"swe-{secrets.token_hex(4)}-", dir=parent))


if __name__ == "__main__":
    sys.exit(main())

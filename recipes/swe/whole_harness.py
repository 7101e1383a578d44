"""Whole-harness mode: an unchanged CLI coding agent (Codex CLI, Claude Code, opencode) inside the sandbox on one task.

`python -m agentstream.recipes.swe.whole_harness codex|claude|opencode`, launched by the controller as any agent is (it reads
AGENTSTREAM_TASK, OPENAI_BASE_URL, OPENAI_API_KEY, AGENTSTREAM_MODEL). Unlike `recipes.swe.harness`
(mini-swe-agent outside, each command in a tools-only sandbox), the harness itself runs inside one
sandbox (`Network.GATEWAY`) as one long command:

1. the task's repository is checked out at its base commit into a fresh workspace (mounted at /workspace);
2. the harness runs there, non-interactively, its own sandboxing and approvals off (ours wraps it):
   `codex exec` speaks the Responses API, streamed, to the attempt's gateway URL; `claude -p` speaks
   Anthropic Messages to the same attempt's URL; `opencode run` speaks Chat Completions, streamed, to it through
   its bundled OpenAI-compatible provider (its config inline in OPENCODE_CONFIG_CONTENT: no file, no model
   list, update, plugin, LSP or share fetched). Its install (and Node.js, from /usr) is visible
   read-only; HOME is the sandbox's private /tmp; its only network is the gateway (`sandbox.relay`); the
   one credential inside is the attempt's rollout token;
3. the workspace's diff against the base commit is taken inside the sandbox (`workspace.final_diff`) and
   posted to the gateway's diff endpoint, as `recipes.swe.harness` does; the grader scores it.

How the attempt ended is said as `outcome`: `completed` (the harness exited 0), `harness_error` (it exited
non-zero: its output's tail is in the details), `sandbox_timeout` (the attempt's time in the sandbox was
spent), `stopped` (a SIGTERM, the controller's timeout or shutdown: the harness is killed, the diff so far
posted, the sandbox closed). Those exit 0: the attempt is data. A crash of this runner exits non-zero,
and no diff is posted.

Settings (environment, `recipes.swe.settings`): AGENTSTREAM_CODEX (the `codex` command: bin/codex.js of the pinned npm package,
printed by `scripts/npm-tool.sh codex`), AGENTSTREAM_CLAUDE_CODE (the `claude` binary, printed by `scripts/npm-tool.sh
claude-code`), AGENTSTREAM_OPENCODE (the `opencode` binary, printed by `scripts/npm-tool.sh opencode`), AGENTSTREAM_OPENCODE_CONFIG (a JSON
object merged over the opencode config made here: e.g. `{"tools": {"webfetch": false}}`),
AGENTSTREAM_WHOLE_ARGS (a JSON list of extra arguments for the harness: its own config, e.g. Codex's
`-c`/`--disable` or Claude Code's `--tools`), AGENTSTREAM_SWE_ATTEMPT_TIMEOUT_S, AGENTSTREAM_SWE_REPOS,
AGENTSTREAM_SWE_INDEX, AGENTSTREAM_SWE_WORKSPACE.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentstream.recipes.swe.harness import (
    STOPPED_EXIT,
    HarnessSettings,
    Stopped,
    attempt_workspace,
    finish_on_sigterm,
    post_diff,
    remove_folder,
    stop_on_sigterm,
)
from agentstream.recipes.swe.settings import WholeHarnessSettings, from_environment
from agentstream.recipes.swe.workspace import TaskInput, checkout, final_diff
from agentstream.sandbox.contract import WORKSPACE_MOUNT, Limits, Network, SandboxSpec
from agentstream.sandbox.local import LocalSandbox, inside_gateway_url
from agentstream.schemas.errors import ConfigurationError

log = logging.getLogger("recipes.swe.whole_harness")

OUTPUT_TAIL = 4000
"""characters of the harness's output kept in the diff event's details"""
CODEX_HOME = "/tmp/.codex"
"""Codex's state (sessions, logs) inside the sandbox: the private /tmp, gone with the command"""
QUIET_CLAUDE = {  # nothing but the model calls: no update check, telemetry, error reports or other traffic
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1",
}
OPENCODE_HOME = "/tmp"
OPENCODE_GLOBAL_CONFIG = f"{OPENCODE_HOME}/.config/opencode"
"""opencode installs its plugin SDK (`@opencode-ai/plugin`) from the npm registry into every config folder it
may write, at each start, in the background (seen outside the sandbox: the registry asked, the package fetched);
this one, its global one, is made read-only (holding the .gitignore it would write) before it runs, so that its
only traffic is the model calls, not requests the sandbox refuses and npm retries"""
BUN_ADDRESS_SPACE = 256 << 30
"""opencode is a Bun binary: it reserves ~135 GB of address space at start (JavaScriptCore's heap cages) and
uses ~0.6 GB; under the sandbox's default RLIMIT_AS (4 GiB) it aborts at a later allocation"""
QUIET_OPENCODE = {  # nothing but the model calls: no model list from models.dev, update, plugin, LSP download or share
    "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
    "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
}
OPENCODE_PROVIDER = "agentstream"
INSTALLS = {"codex": "scripts/npm-tool.sh codex", "claude": "scripts/npm-tool.sh claude-code",
            "opencode": "scripts/npm-tool.sh opencode"}


@dataclass(frozen=True)
class Run:
    """One harness invocation inside the sandbox: its command line, environment and read-only binds."""

    command: str
    env: dict[str, str]
    binds: list[tuple[Path, Path]]
    address_space_bytes: int | None = None
    """its processes' RLIMIT_AS where the sandbox's default (its memory limit) is too small for the runtime's
    reservations (the memory cgroup bounds what it uses either way)"""


@dataclass(frozen=True)
class Harness:
    name: str
    install_env: str
    """the variable that names its installed command"""
    install: Callable[[WholeHarnessSettings], str | None]
    """its installed command, as the settings name it"""
    run: Callable[[Path, HarnessSettings, str, list[str]], Run]
    """(installed command, settings, problem statement, extra arguments) → the run"""

    def installed(self, settings: WholeHarnessSettings) -> Path:
        value = self.install(settings)
        if not value or not Path(value).is_file():
            script = INSTALLS.get(self.name, "its install script")
            raise SystemExit(f"whole_harness: {self.install_env} must name the installed {self.name} command: "
                             f"export {self.install_env}=$({script})")
        return Path(value).resolve()


def codex_run(command: Path, settings: HarnessSettings, prompt: str, extra: list[str]) -> Run:
    """`codex exec`, its model provider the gateway (Responses API, streamed), the rollout token its key."""
    package = package_root(command, "node_modules")
    provider = (f'{{name="agentstream", base_url="{inside_gateway_url(settings.base_url)}", '
                f'env_key="OPENAI_API_KEY", wire_api="responses"}}')
    argv = ["node", str(command), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
            "--ephemeral", "--color", "never", "-C", str(WORKSPACE_MOUNT), "-m", settings.model,
            "-c", "model_provider=agentstream", "-c", f"model_providers.agentstream={provider}", *extra, "--", prompt]
    env = {"OPENAI_API_KEY": settings.api_key, "CODEX_HOME": CODEX_HOME}
    return Run(f"mkdir -p {CODEX_HOME} && exec {shlex.join(argv)} </dev/null", env, [(package, package)])


def claude_run(command: Path, settings: HarnessSettings, prompt: str, extra: list[str]) -> Run:
    """`claude -p`, its Messages endpoint the attempt's gateway URL, the rollout token its key."""
    package = package_root(command, "node_modules")
    attempt_url = inside_gateway_url(settings.base_url).rstrip("/").removesuffix("/v1")
    argv = [str(command), "-p", "--output-format", "json", "--dangerously-skip-permissions", "--model",
            settings.model, *extra, "--", prompt]
    env = {**QUIET_CLAUDE, "ANTHROPIC_BASE_URL": attempt_url, "ANTHROPIC_API_KEY": settings.api_key,
           "ANTHROPIC_MODEL": settings.model, "ANTHROPIC_SMALL_FAST_MODEL": settings.model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": settings.model}
    return Run(f"exec {shlex.join(argv)} </dev/null", env, [(package, package)])


def opencode_config(settings: HarnessSettings, overrides: dict[str, object]) -> dict[str, object]:
    """opencode's config: one provider, the gateway (`@ai-sdk/openai-compatible`, bundled in the binary), the
    rollout token its key (read from the environment, so it is in no file), every tool allowed (ours is the
    sandbox) but fetching the web; `overrides` (AGENTSTREAM_OPENCODE_CONFIG) merged over it, key by key."""
    model = settings.model
    config: dict[str, object] = {
        "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
        "model": f"{OPENCODE_PROVIDER}/{model}", "small_model": f"{OPENCODE_PROVIDER}/{model}",
        "enabled_providers": [OPENCODE_PROVIDER],
        "provider": {OPENCODE_PROVIDER: {
            "npm": "@ai-sdk/openai-compatible", "name": OPENCODE_PROVIDER,
            "options": {"baseURL": inside_gateway_url(settings.base_url), "apiKey": "{env:OPENAI_API_KEY}"},
            "models": {model: {"name": model, "limit": {"context": 32768, "output": settings.attempt.max_tokens}}},
        }},
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
    }
    return _merged(config, overrides)


def _merged(base: dict[str, object], over: dict[str, object]) -> dict[str, object]:
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = _merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def opencode_run(command: Path, settings: HarnessSettings, prompt: str, extra: list[str]) -> Run:
    """`opencode run`, its one provider the attempt's gateway URL (Chat Completions), the rollout token its key; a
    title given, so it asks the model for nothing but the task."""
    package = package_root(command, "node_modules")
    overrides = from_environment(WholeHarnessSettings).opencode_config
    argv = [str(command), "run", "--pure", "--auto", "--dir", str(WORKSPACE_MOUNT), "--title", "agentstream attempt",
            "--model", f"{OPENCODE_PROVIDER}/{settings.model}", *extra]
    env = {**QUIET_OPENCODE, "OPENAI_API_KEY": settings.api_key, "HOME": OPENCODE_HOME,
           "OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(settings, overrides))}
    no_install = f"mkdir -p {OPENCODE_GLOBAL_CONFIG} && touch {OPENCODE_GLOBAL_CONFIG}/.gitignore && " \
                 f"chmod a-w {OPENCODE_GLOBAL_CONFIG}"
    return Run(f"{no_install} && exec {shlex.join(argv)} <<< {shlex.quote(prompt)}", env, [(package, package)],
               address_space_bytes=BUN_ADDRESS_SPACE)


HARNESSES = {harness.name: harness for harness in (
    Harness("codex", "AGENTSTREAM_CODEX", lambda settings: settings.codex, codex_run),
    Harness("claude", "AGENTSTREAM_CLAUDE_CODE", lambda settings: settings.claude_code, claude_run),
    Harness("opencode", "AGENTSTREAM_OPENCODE", lambda settings: settings.opencode, opencode_run),
)}


def package_root(command: Path, marker: str) -> Path:
    """The install folder that holds `command` (the prefix npm installed into: the folder above `marker`),
    bound read-only at its own path so the command's own paths resolve inside."""
    for parent in command.parents:
        if parent.name == marker:
            return parent.parent
    return command.parent


def run_harness(harness: Harness, settings: HarnessSettings, task: TaskInput, workspace: Path,
                whole: WholeHarnessSettings) -> tuple[str, dict[str, object], LocalSandbox]:
    """The harness, to its end, in a whole-harness sandbox; (outcome, details, the sandbox)."""
    run = harness.run(harness.installed(whole), settings, task.problem_statement, whole.whole_args)
    timeout_s = settings.attempt.attempt_timeout_s
    limits = Limits(command_timeout_s=timeout_s, attempt_timeout_s=timeout_s + 120, cpu_seconds=timeout_s,
                    address_space_bytes=run.address_space_bytes)
    spec = SandboxSpec(workspace=workspace, limits=limits, network=Network.GATEWAY, binds=run.binds, env=run.env,
                       gateway_url=settings.base_url)
    box = LocalSandbox(spec)
    began = time.monotonic()
    try:
        result = box.run(run.command)
    except Stopped as exc:  # the run killed the harness on its way out
        finish_on_sigterm()
        return "stopped", {"harness": harness.name, "error": str(exc),
                           "harness_s": round(time.monotonic() - began, 3)}, box
    finish_on_sigterm()
    details: dict[str, object] = {"harness": harness.name, "exit_code": result.exit_code,
                                  "harness_s": round(result.duration_s, 3),
                                  "output_tail": result.output[-OUTPUT_TAIL:]}
    if result.limit:
        details["limit"] = result.limit
    outcome = ("sandbox_timeout" if result.limit in ("command_timeout", "attempt_timeout")
               else "completed" if result.ok else "harness_error")
    return outcome, details, box


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if len(sys.argv) != 2 or sys.argv[1] not in HARNESSES:
        raise SystemExit(f"usage: python -m agentstream.recipes.swe.whole_harness {{{','.join(HARNESSES)}}}")
    harness = HARNESSES[sys.argv[1]]
    settings = HarnessSettings.from_env()
    try:
        whole = from_environment(WholeHarnessSettings)
    except ConfigurationError as exc:
        raise SystemExit(f"whole_harness: {exc}") from exc
    task = settings.task_input()
    stop_on_sigterm()
    workspace = attempt_workspace(settings.swe.workspace)
    started = time.monotonic()
    box = None
    try:
        baseline = checkout(task, workspace, settings.swe.repos)
        outcome, details, box = run_harness(harness, settings, task, workspace, whole)
        diff, diff_details = final_diff(box, baseline)
        details.update(diff_details, duration_s=round(time.monotonic() - started, 2))
        log.info("%s ended: %s (exit %s); diff of %d characters", harness.name, outcome, details.get("exit_code"),
                 len(diff))
        post_diff(settings, task, diff, outcome, details)
    except Stopped as exc:
        log.warning("%s before the harness ran: no diff", exc)
        return STOPPED_EXIT
    finally:
        finish_on_sigterm()
        if box is not None:
            box.close()
        remove_folder(workspace)
    return 0


if __name__ == "__main__":
    sys.exit(main())

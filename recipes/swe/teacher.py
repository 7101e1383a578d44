"""`agentstream tasks swe demonstrate --teacher MODEL=URL`: a stronger model's solved attempts, as the SFT set.

Rejection-sampling SFT, as SWE-smith, SkyRL and rLLM warm-start: a teacher tries the train tasks, the attempts
the grader passes are kept, the student imitates them. Here in two phases on one stack (`recipes.swe.demonstrate`'s:
gateway, mini-swe-agent in sandboxes, grader, streams worker):

1. the teacher's attempts. The gateway routes the teacher's model name to its server (`MODEL=URL`: any server that
   speaks OpenAI's chat completions: a bigger model on a second vLLM, OpenAI, Anthropic's OpenAI-compatible
   endpoint) as a provider (`GatewaySettings.providers`): its calls are forwarded as they are, with no token ids or
   logprobs asked (the student replays the answers' text in its own tokens, so none are needed), and its key, from the
   environment variable `--teacher-key-env` names, is handed to the gateway in its environment as the provider key,
   sent to the teacher's server and to no other (never on a command line or in an event). Each attempt is recorded,
   graded and assembled like any rollout: trajectories of the teacher's model in the run's topic (without training
   turns: its calls carry no token ids), its calls in the calls topic;
2. the filter (`Keep`): reward at least `keep_min_reward`, no grader flag (an attempt that touched the tests or git
   history is not imitated, whatever its reward), at most `keep_max_tokens` generated tokens (as the server counted
   them). Each kept attempt's answers (the text of its answered model calls, from the call events its trajectory's
   lineage names) become a task's demonstration;
3. the student answers them (`recipes.swe.demonstrate`: the served model made to answer each text in its own
   tokens) through the same loop, graded again: the SFT set is those trajectories with reward 1, in the run's topic,
   trained on by the command `demonstrate` prints. The student's tokenizer need not be the teacher's.

`--teacher expert` (the default) is the scripted expert that reads the gold patch (`recipes.swe.expert`).
Whole harnesses (Claude Code, Codex) answer in their own tool-call formats, which mini-swe-agent's student cannot
replay: they are not teachers yet.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from agentstream.demo.loop import Stack
from agentstream.demo.progress import Progress
from agentstream.demo.run import run_to_summary
from agentstream.eval import EvalSettings, Evaluator
from agentstream.recipes.swe.build import kind_of
from agentstream.recipes.swe.demonstrate import Demonstrate, DemonstrateConfig, run_demonstrate
from agentstream.recipes.swe.keep import EXPERT, Attempt, parse_teacher
from agentstream.recipes.swe.recipe import HARNESS, Harness, Recipe, RecipeLoop
from agentstream.recipes.swe.task_files import write_task_files
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import CallEvent, Event, RewardEvent, Trajectory, TrajectoryEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import scan
from agentstream.stack import StackError
from agentstream.stack.service import Service

PROVIDER_KEY_ENV = "AGENTSTREAM_PROVIDER_API_KEY"
"""the gateway's provider key, as its environment holds it: sent to the teacher's server only"""
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def attempt_of(trajectory: Trajectory, flagged: bool, calls: dict[str, CallEvent]) -> Attempt:
    """What the filter reads of an attempt: its answered calls (those its lineage names), in the order made."""
    answered = sorted((calls[event_id] for event_id in trajectory.lineage
                       if event_id in calls and calls[event_id].data.status == 200),
                      key=lambda call: (call.data.started_at, call.id))
    return Attempt(reward=trajectory.reward, flagged=flagged, answers=[_text(call) for call in answered],
                   generated_tokens=sum(map(_generated, answered)))


def _text(call: CallEvent) -> str:
    """The answer of a chat completions call (its message's content)."""
    choices = (call.data.response or {}).get("choices") or [{}]
    content = (choices[0].get("message") or {}).get("content")
    if not isinstance(content, str):
        raise StackError(f"the call {call.id} answered no text (a {call.data.api} call): only chat "
                         "completions' text answers can be demonstrated")
    return content


def _generated(call: CallEvent) -> int:
    if call.data.completion_token_ids:
        return len(call.data.completion_token_ids)
    if call.data.usage is not None:
        return call.data.usage.completion_tokens
    usage = (call.data.response or {}).get("usage") or {}
    return int(usage.get("completion_tokens") or 0)


class TeacherLoop(RecipeLoop):
    """The demonstrations' loop, its gateway given the teacher's key from the environment (never a flag), as the
    provider key: the student's server is never sent it."""

    upstream_key_env: str | None = None

    def services(self) -> list[Service]:
        gateway, *rest = super().services()
        if self.upstream_key_env is None:
            return [gateway, *rest]
        key = os.environ.get(self.upstream_key_env)
        if not key:
            raise StackError(f"--teacher-key-env names {self.upstream_key_env}, which is not set")
        return [dataclasses.replace(gateway, env={**gateway.env, PROVIDER_KEY_ENV: key}), *rest]


class TeacherDemonstrate(Demonstrate):
    starting = "Starting the local stack for the teacher's attempts…"

    def __init__(self, config: DemonstrateConfig, console: Console):
        super().__init__(config, console)
        upstream = parse_teacher(config.teacher)
        if upstream is None:
            raise ValueError("the scripted expert runs as `Demonstrate`, not as a teacher's attempts")
        if config.teacher_key_env is not None and not _ENV_NAME.match(config.teacher_key_env):
            raise ValueError(f"--teacher-key-env takes the name of an environment variable, not {config.teacher_key_env!r}")
        self.upstream = upstream
        self.decisions: list[dict[str, Any]] = []

    def task_files(self) -> tuple[Path, Path, Path]:
        """Every train task: the teacher tries them all."""
        from agentstream.recipes.swe.task_files import read_instances

        if self.config.instances_file is None:
            raise StackError("give the task file to demonstrate (--tasks, e.g. from `tasks swe build`)")
        self.instances = [i for i in read_instances(self.config.instances_file) if i.split == "train"]
        if not self.instances:
            raise StackError(f"{self.config.instances_file} holds no train task")
        self.kinds = {i.instance_id: kind_of(i.instance_id) for i in self.instances}
        self.out.mkdir(parents=True, exist_ok=True)
        return write_task_files(self.instances, self.out / "tasks")

    def loop(self, stack: Stack) -> RecipeLoop:
        loop = super().loop(stack)
        providers = [*loop.gateway.providers, f"{self.upstream.model}={self.upstream.url}"]
        gateway = loop.gateway.model_copy(update={"providers": providers})
        return TeacherLoop(**{**dict(loop), "gateway": gateway}, upstream_key_env=self.config.teacher_key_env)

    def harness(self, stack: Stack) -> Harness:
        """Before the teacher's attempts are kept, nobody's answers are forced."""
        demonstrations = getattr(self, "demonstrations", None)
        return Recipe.harness(self, stack).model_copy(update={"demonstrations": demonstrations})

    async def follow(self, kafka: KafkaSettings) -> None:
        """The teacher's attempts, the filter, then the student's answers of the kept ones (`Probe.follow`)."""
        trajectories = await self.teacher_attempts(kafka)
        flagged = await flagged_rollouts(kafka, set(trajectories))
        calls = await calls_by_id(kafka, {event_id for t in trajectories.values() for event_id in t.data.lineage})
        kept: dict[str, list[str]] = {}
        for rollout, event in sorted(trajectories.items()):
            attempt = attempt_of(event.data, flagged.get(rollout, False), calls)
            why = self.config.keep().verdict(attempt)
            task = event.data.task_id or ""
            self.decisions.append({"rollout_id": rollout, "task_id": task, "reward": attempt.reward,
                                   "flagged": attempt.flagged, "calls": len(attempt.answers),
                                   "generated_tokens": attempt.generated_tokens, "kept": why is None, "why_not": why})
            if why is None and task not in kept:
                kept[task] = attempt.answers
        (self.out / "teacher.json").write_text(json.dumps(self.decisions, indent=2) + "\n")
        if not kept:
            reasons = sorted({d["why_not"] for d in self.decisions})
            raise StackError(f"none of the teacher's {len(self.decisions)} attempts passed the filter "
                             f"({'; '.join(reasons[:3])}): no demonstration to record")
        self.demonstrations = self.out / "demonstrations.jsonl"
        self.demonstrations.write_bytes(b"".join(orjson.dumps({"instance_id": task, "answers": answers}) + b"\n"
                                                 for task, answers in kept.items()))
        self.instances = [i for i in self.instances if i.instance_id in kept]
        self.tasks = write_task_files(self.instances, self.out / "tasks-kept")
        self.say(f"{len(kept)} train tasks kept from the teacher's {len(self.decisions)} attempts; the student "
                 f"answers them now ({self.demonstrations})")
        await super().follow(kafka)

    async def teacher_attempts(self, kafka: KafkaSettings) -> dict[str, TrajectoryEvent]:
        """Each train task tried `teacher_attempts` times by the teacher's model: rollout id → its trajectory."""
        config, stack = self.config, self.stack
        env = self.harness(stack).model_copy(update={"demonstrations": config.teacher_script}).env()
        evaluation = EvalSettings(tasks=self.tasks[0], agent=HARNESS, gateway_url=stack.gateway_url,
                                  token_secret=stack.token_secret, model=self.upstream.model,
                                  samples=config.teacher_attempts, concurrency=config.concurrency,
                                  timeout_s=config.attempt_timeout_s, out=self.out / "teacher", agent_env=env,
                                  split="train", settle_timeout_s=config.attempt_timeout_s + 300)
        evaluator = Evaluator(kafka, evaluation, say=self.say)
        try:
            await self.supervised(evaluator.evaluate(0))
        finally:
            evaluator.stop()
        return dict(evaluator.last_trajectories)

    def summary(self, console: Console, elapsed_s: float) -> dict[str, Any]:
        result = super().summary(console, elapsed_s)
        kept = sum(d["kept"] for d in self.decisions)
        result.update(teacher=self.config.teacher, teacher_attempts=len(self.decisions), teacher_kept=kept,
                      teacher_decisions=str(self.out / "teacher.json"))
        (self.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"The teacher {self.upstream.model}: {kept} of {len(self.decisions)} attempts kept "
                      f"(decisions in {self.out / 'teacher.json'})")
        return result


async def flagged_rollouts(kafka: KafkaSettings, rollouts: set[str]) -> dict[str, bool]:
    """rollout id → whether the grader flagged its diff, from the run's rewards topic."""
    flagged: dict[str, bool] = {}
    async for records in scan(kafka, kafka.topics.rewards):
        for record in records:
            event = _decoded(record.value)
            if isinstance(event, RewardEvent) and event.rollout_id in rollouts:
                flagged[event.rollout_id] = flagged.get(event.rollout_id, False) or bool(
                    event.data.details.get("flagged"))
    return flagged


async def calls_by_id(kafka: KafkaSettings, ids: set[str]) -> dict[str, CallEvent]:
    calls: dict[str, CallEvent] = {}
    async for records in scan(kafka, kafka.topics.calls):
        for record in records:
            event = _decoded(record.value)
            if isinstance(event, CallEvent) and event.id in ids:
                calls[event.id] = event
    return calls


def run_demonstrations(config: DemonstrateConfig, console: Console | None = None) -> dict[str, Any]:
    """The SFT set of `config.teacher`, recorded through the loop: the expert's answers, or a stronger model's kept
    attempts answered by the student; the run's summary (the one call a recipe's warm-start stage makes)."""
    if config.teacher == EXPERT:
        return run_demonstrate(config, console)
    demonstrate = TeacherDemonstrate(config, console or Console())

    def summarize(_progress: Progress, _config: DemonstrateConfig, console: Console, elapsed_s: float) -> dict[str, Any]:
        return demonstrate.summary(console, elapsed_s)

    return run_to_summary(demonstrate, summarize)


def _decoded(value: bytes | None) -> Event | None:
    """The record's event; None for one that is not (the deadletter's business, not this run's)."""
    try:
        return decode(value or b"")
    except DecodeError:
        return None

"""`agentstream eval`: pass rates of a weight version on the validation tasks, recorded as `eval` events.

For each version to measure (one given, or each new one on the weights topic as it appears, and the
one serving when it starts), eval runs the validation tasks through the controller like any run (same
agent, same gateway, same sandbox), k samples each, as a run of its own (`eval-…-v{N}`) whose rollouts
are all `split = "validation"`: the trainer drops them, so nothing measured is ever trained on. Then it
waits for each rollout's last attempt to become a trajectory, reads the rewards the grader gave, and
publishes an `eval` event on the metrics topic with pass@1 and pass@k for that version.

Reward shaping belongs to training only: eval reads the grader's reward as is, and a sample without
one (harness crash, timeout, no diff) counts as not passed, with its reason in `unscored`.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from agentstream.controller.settings import ControllerSettings
from agentstream.controller.tasks import TaskFileError, load_tasks
from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import (
    VALIDATION_RUN,
    Eval,
    EvalEvent,
    Event,
    PoolUpdateEvent,
    RolloutQueuedEvent,
    TrajectoryEvent,
    WeightsEvent,
)
from agentstream.schemas.flags import parse, refuse
from agentstream.schemas.ids import derived_id
from agentstream.schemas.kafka import KafkaSettings, Publisher, make_consumer, make_producer, partitions_of
from agentstream.schemas.scan import scan
from agentstream.stack.process import spawn
from agentstream.stack.service import Service


class EvalSettings(KafkaSettings):
    """`python -m agentstream.eval` (also `agentstream eval`): measure weight versions on validation tasks."""

    model_config = SettingsConfigDict(cli_prog_name="python -m agentstream.eval")

    tasks: Path = Field(description="validation tasks (every row is treated as validation)")
    agent: str = Field(description="the agent command, as for the controller")
    model: str = Field(description="the served model name")
    gateway_url: str = Field("http://127.0.0.1:8000", description="the gateway, as agents reach it")
    token_secret: str = Field("", description="the gateway's token secret (env AGENTSTREAM_TOKEN_SECRET)")
    samples: int = Field(1, ge=1, description="k: samples per task (pass@k)")
    concurrency: int = Field(2, ge=1, description="agents running at once")
    timeout_s: float = Field(600.0, gt=0, description="seconds an attempt may run")
    max_attempts: int = Field(1, ge=1, description="attempts per rollout")
    threshold: float = Field(1.0, description="a sample passes when its reward reaches this")
    out: Path = Field(Path("runs/eval"), description="folder for the eval runs' task files and agent logs")
    settle_timeout_s: float = Field(600.0, gt=0, description="how long to wait for the last trajectories after "
                                    "the controller ends")
    agent_env: dict[str, str] = Field(default_factory=dict, description="environment each agent gets besides "
                                      "the controller's own (a harness's settings)")
    split: Literal["validation", "train"] = Field(
        "validation", description="the rollouts' split: validation (never trained on); train for a probe of train "
        "tasks (`agentstream tasks swe probe`), whose successful attempts an offline trainer may learn from")
    version: int | None = Field(None, description="the version being measured (default: the latest published)")
    follow: bool = Field(False, description="evaluate the version serving now, then each new one as the pool "
                         "loads it")
    max_versions: int | None = Field(None, ge=1, description="with --follow: stop after this many versions")
    from_version: int = Field(0, ge=0, description="with --follow: measure no version before this one (a resumed "
                              "run's: those before it were measured, or are served no more)")

    @model_validator(mode="after")
    def _one_version_or_follow(self) -> EvalSettings:
        if self.follow and self.version is not None:
            raise ValueError("--version measures one version; --follow measures each as it appears: give one of them")
        return self


EvalConfig = EvalSettings
"""the name `agentstream eval` builds it by"""


GAVE_UP_SOME = 1
"""the controller's exit code when every rollout ended and some were given up (controller.Controller.run)"""

Z95 = 1.959963984540054
"""the standard normal's 97.5 % quantile: two-sided 95 % intervals"""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c passed (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: float, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (successes may be fractional: see `pass_at_1_interval`).

    The set of p for which |p̂ - p| <= z·sqrt(p(1-p)/n): unlike p̂ ± z·sqrt(p̂(1-p̂)/n) it keeps its
    coverage with few trials and is never the empty-looking [0, 0] when nothing passed.
    """
    if trials <= 0:
        return 0.0, 1.0
    p = min(max(successes / trials, 0.0), 1.0)
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z / (1 + z2 / trials) * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    # at p̂ = 0 (1) the bound is 0 (1) exactly; the arithmetic leaves a rounding error there
    return (0.0 if p == 0 else max(0.0, centre - half)), (1.0 if p == 1 else min(1.0, centre + half))


def pass_at_1_interval(per_task: dict[str, list[float | None]], threshold: float = 1.0, z: float = Z95
                       ) -> tuple[float, float]:
    """A 95 % interval (z = 1.96) for pass@1: the mean over tasks of each task's share of passing samples.

    The tasks are the independent units (a task's samples share its difficulty, so they are not n
    independent trials), so this is the Wilson interval of the mean of the per-task rates with n = the
    number of tasks. With one sample per task that is exactly Wilson's interval for a proportion. With
    more, each task's rate is a number in [0, 1] with mean μ, whose variance is at most μ(1-μ) — the
    Bernoulli variance Wilson assumes — so the interval is conservative: exact when a task's samples
    agree, wider than needed when they differ. Why not a bootstrap over tasks: with the handful of
    validation tasks a CPU run has (2-15), resampling them gives [0, 0] whenever nothing passed and
    too narrow an interval otherwise; Wilson's has its coverage there. A sample without a reward
    counts as not passed, as in pass@1.
    """
    rates = [sum(1 for r in rewards if r is not None and r >= threshold) / len(rewards)
             for rewards in per_task.values() if rewards]
    return wilson_interval(sum(rates), len(rates), z)


def score(trajectories: dict[str, TrajectoryEvent], task_of: dict[str, str], k: int, threshold: float
          ) -> dict[str, Any]:
    """Eval fields from each rollout's final trajectory (rollout id → trajectory)."""
    per_task: dict[str, list[float | None]] = defaultdict(list)
    unscored: Counter[str] = Counter()
    served: set[int] = set()
    for rollout_id, event in sorted(trajectories.items()):
        data = event.data
        per_task[task_of[rollout_id]].append(data.reward)
        if data.reward is None:
            unscored[data.status if data.status != "finished" else "no_reward"] += 1
        served |= {turn.weight_version for turn in data.turns if turn.weight_version is not None}
    rates, solved = [], 0
    for rewards in per_task.values():
        passed = sum(1 for reward in rewards if reward is not None and reward >= threshold)
        rates.append((len(rewards), passed))
        solved += passed > 0
    return dict(
        tasks=len(per_task), k=k, samples=sum(n for n, _ in rates),
        pass_at_1=sum(c / n for n, c in rates) / len(rates) if rates else 0.0,
        pass_at_k=sum(pass_at_k(n, c, min(k, n)) for n, c in rates) / len(rates) if rates else 0.0,
        solved_tasks=solved, threshold=threshold, unscored=dict(unscored), per_task=dict(per_task),
        served_versions=sorted(served), lineage=sorted(event.id for event in trajectories.values()),
    )


class Evaluator:
    def __init__(self, kafka: KafkaSettings, config: EvalSettings, say: Callable[[str], None] = print):
        self.kafka = kafka
        self.config = config
        self.say = say
        self.out = config.out.resolve()
        self.process: subprocess.Popen[bytes] | None = None
        self.last_trajectories: dict[str, TrajectoryEvent] = {}
        """the final trajectory of each rollout of the last evaluation (rollout id → it)"""

    def validation_file(self) -> Path:
        """The tasks, all of them of the config's split (validation unless probing), as the controller reads them."""
        self.out.mkdir(parents=True, exist_ok=True)
        split = self.config.split
        path = self.out / f"{split}.jsonl"
        rows = [{**item.task.model_dump(exclude_none=True), "split": split}
                for item in load_tasks(self.config.tasks, split=split)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    async def evaluate(self, version: int) -> EvalEvent:
        """Run the validation tasks at `version` (the one serving now) and publish its eval event."""
        config = self.config
        prefix = VALIDATION_RUN if config.split == "validation" else "probe-"
        run_id = f"{prefix}{config.model}-v{version}-{int(time.time())}"
        started_ms = int(time.time() * 1000)
        tasks = self.validation_file()
        self.say(f"eval: version {version}, {config.samples} sample(s) of each task in {config.tasks} (run {run_id})")
        code = await asyncio.to_thread(self._run_controller, tasks, run_id)
        if code not in (0, GAVE_UP_SOME):  # a rollout given up is a sample without a reward: unscored, not the end
            raise RuntimeError(f"the eval controller exited with {code}; its log: {self.out / run_id}.log")
        trajectories, task_of = await self._collect(run_id, started_ms)
        self.last_trajectories = trajectories
        event = EvalEvent(source="eval", data=Eval(model=config.model, weight_version=version, run_id=run_id,
                                                   **score(trajectories, task_of, config.samples, config.threshold)))
        producer = make_producer(self.kafka)
        await producer.start()
        try:
            await Publisher(producer, self.kafka.topics).publish(event)
        finally:
            await producer.stop()
        data = event.data
        low, high = pass_at_1_interval(data.per_task, data.threshold)
        self.say(f"eval: version {version}: pass@1 {data.pass_at_1:.3f} (95 % [{low:.3f}, {high:.3f}]), "
                 f"pass@{data.k} {data.pass_at_k:.3f} "
                 f"over {data.tasks} tasks ({data.samples} samples; unscored {data.unscored or 'none'})")
        return event

    def controller(self, tasks: Path, run_id: str) -> Service:
        """The controller process that runs one evaluation: k samples of each task, as a run of its own."""
        config, validation = self.config, self.config.split == "validation"
        settings = ControllerSettings(
            bootstrap_servers=self.kafka.bootstrap_servers, topic_prefix=self.kafka.topic_prefix, tasks=tasks,
            agent=config.agent, samples=1 if validation else config.samples,
            validation_samples=config.samples if validation else 1, epochs=1, run_id=run_id,
            concurrency=config.concurrency, timeout_s=config.timeout_s, max_attempts=config.max_attempts,
            gateway_url=config.gateway_url, token_secret=config.token_secret, model=config.model, progress=False,
            logs_dir=self.out / "attempts",
            # stopped only when the eval is abandoned (its run is then discarded): its agents go at once,
            # not after a grace that could outlast whoever stops the eval and leave them running
            shutdown_grace_s=0)
        return Service("controller", "agentstream.controller", settings, env=config.agent_env)

    def _run_controller(self, tasks: Path, run_id: str) -> int:
        controller = self.controller(tasks, run_id)
        log = self.out / f"{run_id}.log"
        log.unlink(missing_ok=True)
        # in the eval's process group: whoever stops the eval's group (SIGTERM) stops its controller too
        self.process = spawn(controller.argv(), log, env=controller.env, own_session=False)
        try:
            return self.process.wait()
        finally:
            self.process = None

    async def _collect(self, run_id: str, since_ms: int) -> tuple[dict[str, TrajectoryEvent], dict[str, str]]:
        """Each rollout's last attempt as a trajectory (rollout id → it), and each rollout's task."""
        topics = self.kafka.topics
        consumer = make_consumer(self.kafka, group_id=None)
        await consumer.start()
        try:
            queued = await partitions_of(self.kafka, topics.rollouts)
            partitions = [*queued, *await partitions_of(self.kafka, topics.trajectories)]
            await _seek_to_time(consumer, partitions, since_ms)
            # the controller has ended: every rollout of the run is queued below these offsets. Until they are read,
            # the rollouts seen are not all: a fetch may bring one rollout and its trajectory before another's queuing
            queued_ends = await consumer.end_offsets(queued)
            task_of: dict[str, str] = {}
            last_attempt: dict[str, tuple[int, str | None]] = {}
            trajectories: dict[tuple[str | None, str | None], TrajectoryEvent] = {}
            deadline = time.monotonic() + self.config.settle_timeout_s
            async for events in _followed(consumer):
                for event in events:
                    if isinstance(event, RolloutQueuedEvent) and event.data.group_id and \
                            event.rollout_id and _of_run(event, run_id):
                        task_of[event.rollout_id] = event.data.task.id
                        number = event.data.attempt_number
                        if number >= last_attempt.get(event.rollout_id, (0, ""))[0]:
                            last_attempt[event.rollout_id] = (number, event.attempt_id)
                    elif isinstance(event, TrajectoryEvent):
                        trajectories[event.rollout_id, event.attempt_id] = event
                final = {rollout: trajectories.get((rollout, attempt)) for rollout, (_, attempt) in last_attempt.items()}
                found = {rollout: event for rollout, event in final.items() if event is not None}
                if final and len(found) == len(final) and await _read_to(consumer, queued_ends):
                    return found, task_of
                if time.monotonic() > deadline:
                    missing = sorted(rollout for rollout, found in final.items() if found is None)
                    raise TimeoutError(f"eval {run_id}: no trajectory for {len(missing)} rollout(s) after "
                                       f"{self.config.settle_timeout_s:.0f} s (e.g. {missing[:3]}); is a streams worker "
                                       "running on this topic prefix, and the grader?")
        finally:
            await consumer.stop()
        raise AssertionError("the followed topics never end")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()


def _of_run(event: RolloutQueuedEvent, run_id: str) -> bool:
    """Whether a queued rollout belongs to this run: the controller names its groups from the run id."""
    queued = event.data
    return queued.group_id == derived_id(run_id, "group", queued.split, queued.task.id, str(queued.epoch))


async def _seek_to_time(consumer: AIOKafkaConsumer, partitions: list[TopicPartition], since_ms: int) -> None:
    consumer.assign(partitions)
    found = await consumer.offsets_for_times({tp: since_ms for tp in partitions})
    ends = await consumer.end_offsets(partitions)
    for tp in partitions:
        consumer.seek(tp, found[tp].offset if found[tp] else ends[tp])


async def current_version(kafka: KafkaSettings, model: str) -> int:
    """The latest weight version published for `model` (0 when none yet)."""
    latest = 0
    async for batch in scan(kafka, kafka.topics.weights):
        for event in _events(batch):
            if isinstance(event, WeightsEvent) and event.data.model == model:
                latest = max(latest, event.data.version)
    return latest


def _events(records: Iterable[Any]) -> Iterator[Event]:
    """The records' events; one that does not decode is not the eval's to judge (the streams deadletter it)."""
    for record in records:
        try:
            yield decode(record.value)
        except DecodeError:
            continue


async def _read_to(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """Whether the consumer has read every partition of `ends` up to its offset there."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return False
    return True


async def _followed(consumer: AIOKafkaConsumer) -> AsyncIterator[list[Event]]:
    """The events of each fetch of a started consumer: a list (maybe empty) at least every half second."""
    while True:
        batches = await consumer.getmany(timeout_ms=500)
        yield [event for records in batches.values() for event in _events(records)]


async def follow_versions(kafka: KafkaSettings, model: str, wait_for_pool: bool = True,
                          since: int = 0) -> AsyncIterator[int]:
    """Each weight version of `model` once the pool serves it: the current one first (unless older than `since`),
    then each new one."""
    topics = kafka.topics
    consumer = make_consumer(kafka, topics.weights, topics.pool, group_id=None)
    await consumer.start()
    try:
        published: set[int] = {0}
        served: set[int] = {0}
        done: set[int] = set()
        caught_up = False
        caught_up_at = time.monotonic() + 2.0  # read the history first: evaluate only the latest served version
        async for events in _followed(consumer):
            for event in events:
                if isinstance(event, WeightsEvent) and event.data.model == model:
                    published.add(event.data.version)
                elif isinstance(event, PoolUpdateEvent) and event.data.model == model and event.data.status == "ok":
                    served.add(event.data.version)
            if time.monotonic() < caught_up_at:
                continue
            ready = served if wait_for_pool else published
            if not caught_up:
                caught_up = True
                done |= {v for v in ready if v < max(ready) or v < since}
            for version in sorted(ready - done):
                done.add(version)
                yield version
    finally:
        await consumer.stop()


async def run_eval(kafka: KafkaSettings, config: EvalSettings, version: int | None, follow: bool,
                   max_versions: int | None = None, say: Callable[[str], None] = print) -> list[EvalEvent]:
    evaluator = Evaluator(kafka, config, say)
    results: list[EvalEvent] = []
    try:
        if not follow:
            if version is None:
                version = await current_version(kafka, config.model)
            return [await evaluator.evaluate(version)]
        async for served in follow_versions(kafka, config.model, since=config.from_version):
            results.append(await evaluator.evaluate(served))
            if max_versions is not None and len(results) >= max_versions:
                break
        return results
    finally:
        evaluator.stop()


def main(argv: list[str] | None = None) -> int:
    settings = parse(EvalSettings, argv)
    if not settings.token_secret:
        refuse("--token-secret (AGENTSTREAM_TOKEN_SECRET): missing: give the gateway's")
    try:
        asyncio.run(run_eval(settings, settings, settings.version, settings.follow, settings.max_versions))
    except (TaskFileError, RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

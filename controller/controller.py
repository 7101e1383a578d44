"""The rollout controller: a task set in, one recorded rollout per (task, epoch, sample) out.

Start-up reads the run's history from the `rollouts` topic and the current weight version from
`weights`, closes attempts a previous controller left open, and then `concurrency` workers take
the rollouts still to do, in plan order. Each attempt is:

    queued (acked) → launch → started (acked) → heartbeat … → finished | failed | timed_out

Every event is acknowledged by the broker before the controller acts on it, so the log never
lags behind what happened: an agent runs only after its `queued` event is durable, and a retry
is queued only after the failure that caused it is. Failures and timeouts are retried as new
attempts (new attempt id, same rollout id, attempt number + 1) up to `max_attempts`.

SIGTERM (or `shutdown()`): no new attempts; running ones get `shutdown_grace_s` to finish, then
are stopped and recorded as interrupted, so the next controller reruns them.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentstream.controller.attempt import Attempt, Exit, Gateway, Launcher, LaunchError, Running, tail_text
from agentstream.controller.history import INTERRUPTED, RolloutRecord, RunHistory
from agentstream.controller.log import TopicReader
from agentstream.controller.pacing import Pacer, WeightsFollower
from agentstream.controller.settings import ControllerSettings
from agentstream.controller.tasks import PlannedRollout, derive_run_id, load_task_set, plan_rollouts
from agentstream.schemas.errors import LogUnavailable, ServiceError
from agentstream.schemas.events import (
    Event,
    RolloutFailed,
    RolloutFailedEvent,
    RolloutFinished,
    RolloutFinishedEvent,
    RolloutHeartbeat,
    RolloutHeartbeatEvent,
    RolloutQueued,
    RolloutQueuedEvent,
    RolloutStarted,
    RolloutStartedEvent,
    RolloutTimedOut,
    RolloutTimedOutEvent,
)
from agentstream.schemas.ids import new_id
from agentstream.schemas.kafka import Publisher, ensure_topics, make_producer

log = logging.getLogger(__name__)
SOURCE = "controller"


@dataclass
class Counts:
    total: int = 0
    done: int = 0
    failed: int = 0
    """rollouts given up after max_attempts failures"""
    running: int = 0
    retries: int = 0
    """attempts that failed or timed out and were retried"""
    done_this_session: int = 0

    @property
    def queued(self) -> int:
        return self.total - self.done - self.failed - self.running


@dataclass(frozen=True)
class Summary:
    run_id: str
    total: int
    done: int
    failed: int
    stopped_early: bool

    @property
    def exit_code(self) -> int:
        """0: every rollout finished; 1: some were given up; 2: stopped early (run again to resume)."""
        return 2 if self.stopped_early else (1 if self.failed else 0)


def make_launcher(settings: ControllerSettings, run_id: str) -> Launcher:
    if settings.backend == "kubernetes":
        from agentstream.controller.kubernetes import KubernetesLauncher

        return KubernetesLauncher.from_settings(settings, run_id)
    from agentstream.controller.local import LocalLauncher

    return LocalLauncher(settings.agent, settings.timeout_s, settings.kill_grace_s, settings.tail_chars)


class Controller:
    def __init__(self, settings: ControllerSettings, launcher: Launcher | None = None):
        self.settings = settings
        tasks = load_task_set(settings.tasks, settings.validation_tasks)
        planning: dict[str, Any] = dict(samples=settings.samples, validation_samples=settings.validation_samples,
                        epochs=settings.epochs, shuffle=settings.shuffle, seed=settings.seed)
        self.run_id = settings.run_id or derive_run_id([settings.tasks, settings.validation_tasks], **planning)
        self.plan = plan_rollouts(self.run_id, tasks, **planning)
        self.history = RunHistory({r.rollout_id for r in self.plan})
        self.gateway = Gateway(settings.gateway_url, settings.token_secret, settings.model, settings.tenant)
        self.launcher = launcher or make_launcher(settings, self.run_id)
        self.counts = Counts(total=len(self.plan))
        self.started_at = time.monotonic()
        self.stopping = asyncio.Event()
        """set: launch nothing new"""
        self.stop_now = asyncio.Event()
        """set: stop running attempts and hand them back"""
        self.publisher: Publisher | None = None
        self.weights: WeightsFollower | None = None
        self.pacer: Pacer | None = None

    # --- the run ------------------------------------------------------------------------------

    async def run(self) -> Summary:
        with _run_lock(self.settings.logs_dir / self.run_id):
            return await self._run()

    async def _run(self) -> Summary:
        report = await ensure_topics(self.settings)
        for problem in report.mismatches:
            log.warning("topic %s", problem)
        producer = make_producer(self.settings)
        await producer.start()
        self.publisher = Publisher(producer, self.settings.topics)
        topics = self.settings.topics
        self.weights = WeightsFollower(TopicReader(self.settings, topics.weights, self.publisher, SOURCE),
                                       self.settings.model, self.settings.tenant)
        try:
            await self._recover(TopicReader(self.settings, topics.rollouts, self.publisher, SOURCE))
            await self.weights.start()
            await self.launcher.start()
            await self._close_interrupted()
            self.pacer = self._make_pacer()
            left = [r for r in self.plan if self._to_do(r)]
            if not left:
                log.info("run %s is already complete; to run the same tasks again, give a new --run-id", self.run_id)
            todo = iter(left)
            async with asyncio.TaskGroup() as workers:
                for n in range(self.settings.concurrency):
                    workers.create_task(self._worker(todo), name=f"worker-{n}")
        finally:
            await self.launcher.close()
            await self.weights.stop()
            try:  # flushing to a broker that is gone would wait forever
                await asyncio.wait_for(producer.stop(), self.settings.publish_timeout_s)
            except TimeoutError:
                log.warning("Kafka producer did not close within %g s", self.settings.publish_timeout_s)
        summary = Summary(self.run_id, self.counts.total, self.counts.done, self.counts.failed,
                          stopped_early=self.counts.done + self.counts.failed < self.counts.total)
        log.info("run %s: %d of %d rollouts finished, %d given up%s", self.run_id, summary.done, summary.total,
                 summary.failed, " (stopped early; run again to resume)" if summary.stopped_early else "")
        return summary

    def shutdown(self) -> None:
        """First call: finish running attempts (up to the grace period); second call: stop them now."""
        if self.stopping.is_set():
            self.stop_now.set()
            return
        log.info("shutting down: no new attempts; running ones have %g s to finish", self.settings.shutdown_grace_s)
        self.stopping.set()
        asyncio.get_running_loop().call_later(self.settings.shutdown_grace_s, self.stop_now.set)

    async def _recover(self, reader: TopicReader) -> None:
        try:
            seen = await reader.catch_up(self.history.apply)
        finally:
            await reader.stop()
        for rollout in self.plan:
            record = self.history.record(rollout.rollout_id)
            if record.finished:
                self.counts.done += 1
            elif self._given_up(record):
                self.counts.failed += 1
        log.info("run %s: %d rollouts planned; read %d events of the rollouts topic: %d finished, %d given up",
                 self.run_id, len(self.plan), seen, self.counts.done, self.counts.failed)

    async def _close_interrupted(self) -> None:
        """Attempts left open by a controller that died: stop what remains of them, record them ended."""
        left = [(rollout_id, attempt) for rollout_id, record in self.history.records.items()
                for attempt in record.open_attempts]
        if not left:
            return
        await self.launcher.reap(self.run_id, [attempt for _, attempt in left])
        for rollout_id, attempt in left:
            folder = self._attempt_dir(rollout_id, attempt.attempt_id)
            await self._publish(RolloutFailedEvent(
                source=SOURCE, rollout_id=rollout_id, attempt_id=attempt.attempt_id,
                data=RolloutFailed(error=f"{INTERRUPTED}: its controller stopped before the attempt ended; "
                                   "rerun as a new attempt", will_retry=True,
                                   stdout_tail=tail_text(folder / "stdout", self.settings.tail_chars),
                                   stderr_tail=tail_text(folder / "stderr", self.settings.tail_chars))))
        log.info("closed %d interrupted attempts; they run again as new attempts", len(left))

    def _make_pacer(self) -> Pacer:
        assert self.weights is not None  # (followed from the start of the run)
        admitted = [self.history.record(r.rollout_id) for r in self.plan if r.split == "train"]
        admitted = [rec for rec in admitted if rec.attempts and not self._given_up(rec)]
        versions = [rec.launch_version or 0 for rec in admitted]
        return Pacer(self.weights, self.settings.max_staleness, self.settings.train_batch_size,
                     admitted=len(admitted), base_version=min(versions) if versions else None)

    def _given_up(self, record: RolloutRecord) -> bool:
        return not record.finished and record.failures >= self.settings.max_attempts

    def _to_do(self, rollout: PlannedRollout) -> bool:
        record = self.history.record(rollout.rollout_id)
        return not record.finished and not self._given_up(record)

    # --- one rollout --------------------------------------------------------------------------

    async def _worker(self, todo: Iterator[PlannedRollout]) -> None:
        for rollout in todo:
            if self.stopping.is_set():
                return
            await self._drive(rollout)

    async def _drive(self, rollout: PlannedRollout) -> None:
        """Attempt a rollout until it finishes, is given up, or the controller stops."""
        assert self.pacer is not None  # (made before the workers start)
        first = rollout.split == "train" and not self.history.record(rollout.rollout_id).attempts
        if first and not await self._until_stopping(self.pacer.admit()):  # admitted once, at its first attempt
            return
        while not self.stopping.is_set():
            record = self.history.record(rollout.rollout_id)
            await self._attempt(rollout, record.last_attempt_number + 1, record.failures)
            record = self.history.record(rollout.rollout_id)
            if record.finished:
                self.counts.done += 1
                self.counts.done_this_session += 1
                return
            if record.failures >= self.settings.max_attempts:
                self.counts.failed += 1
                if rollout.split == "train":
                    await self.pacer.release()
                return
            if self.stop_now.is_set():
                return
            self.counts.retries += 1

    async def _until_stopping(self, awaitable: Awaitable[object]) -> bool:
        """Await `awaitable` unless the controller starts stopping first; True if it completed."""
        work = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if work.done():
            return True
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return False

    async def _attempt(self, rollout: PlannedRollout, number: int, failures: int) -> None:
        assert self.weights is not None  # (followed from the start of the run)
        attempt_id = new_id()
        attempt = Attempt(rollout, attempt_id, number, self.weights.version,
                          self._attempt_dir(rollout.rollout_id, attempt_id))
        ids: dict[str, Any] = dict(source=SOURCE, rollout_id=rollout.rollout_id, attempt_id=attempt_id)
        await self._publish(RolloutQueuedEvent(**ids, data=RolloutQueued(
            task=rollout.task, group_id=rollout.group_id, sample_index=rollout.sample_index, epoch=rollout.epoch,
            split=rollout.split, attempt_number=number, weight_version=attempt.weight_version,
            model=self.settings.model, managed=True)))
        retry = failures + 1 < self.settings.max_attempts
        began = time.monotonic()
        try:
            running = await self.launcher.launch(attempt, self.gateway)
        except LaunchError as exc:
            await self._publish(RolloutFailedEvent(**ids, data=RolloutFailed(
                error=str(exc), duration_ms=_ms_since(began), will_retry=retry and not self.stopping.is_set())))
            return
        self.counts.running += 1
        try:
            await self._publish(RolloutStartedEvent(**ids, data=RolloutStarted(
                attempt_number=number, launcher=self.launcher.name, worker=running.worker,
                weight_version=attempt.weight_version)))
            ending, exit = await self._watch(running, began, ids)
            stdout_tail, stderr_tail = await running.close()
        except BaseException:
            # cannot record the end (Kafka gone, or cancelled): stop the agent; the next controller reruns it
            await asyncio.shield(_stop_quietly(running))
            raise
        finally:
            self.counts.running -= 1
        await self._publish(self._ending(ending, exit, ids, _ms_since(began), stdout_tail, stderr_tail,
                                         retry and not self.stopping.is_set()))

    async def _watch(self, running: Running, began: float, ids: dict[str, Any]) -> tuple[str, Exit | None]:
        """Wait for the agent, heartbeating; stop it at its timeout or on shutdown."""
        waiting = asyncio.ensure_future(running.wait())
        stop_now = asyncio.ensure_future(self.stop_now.wait())
        deadline = began + self.settings.timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                await asyncio.wait({waiting, stop_now}, timeout=max(0.0, min(self.settings.heartbeat_s, left)),
                                   return_when=asyncio.FIRST_COMPLETED)
                if waiting.done():
                    exit = waiting.result()
                    return ("timed_out" if exit.timed_out else "exited"), exit
                if stop_now.done() or time.monotonic() >= deadline:
                    await running.stop()
                    waiting.cancel()
                    return ("interrupted" if stop_now.done() else "timed_out"), None
                await self._publish(RolloutHeartbeatEvent(**ids, data=RolloutHeartbeat(elapsed_ms=_ms_since(began))))
        finally:
            stop_now.cancel()
            if not waiting.done():
                waiting.cancel()

    def _ending(self, ending: str, exit: Exit | None, ids: dict[str, Any], duration_ms: int, stdout_tail: str,
                stderr_tail: str, will_retry: bool) -> Event:
        tails = dict(stdout_tail=stdout_tail, stderr_tail=stderr_tail)
        if ending == "exited" and exit is not None and exit.error is None:
            return RolloutFinishedEvent(**ids, data=RolloutFinished(
                by="controller", exit_code=exit.exit_code, duration_ms=duration_ms, **tails))
        if ending == "exited" and exit is not None:
            return RolloutFailedEvent(**ids, data=RolloutFailed(
                exit_code=exit.exit_code, duration_ms=duration_ms, error=exit.error, will_retry=will_retry, **tails))
        if ending == "timed_out":
            return RolloutTimedOutEvent(**ids, data=RolloutTimedOut(
                timeout_s=self.settings.timeout_s, duration_ms=duration_ms, will_retry=will_retry, **tails))
        return RolloutFailedEvent(**ids, data=RolloutFailed(
            duration_ms=duration_ms, will_retry=True, **tails,
            error=f"{INTERRUPTED}: the controller shut down before the attempt ended; the next one reruns it"))

    # --- helpers ------------------------------------------------------------------------------

    async def _publish(self, event: Event) -> None:
        """Publish and await the broker's acknowledgement; a broker that never answers stops the run."""
        assert self.publisher is not None  # (made at the start of the run, before anything is published)
        try:
            await asyncio.wait_for(self.publisher.publish(event), self.settings.publish_timeout_s)
        except TimeoutError:
            raise KafkaUnavailable(f"Kafka did not acknowledge a {event.type} event within "
                                   f"{self.settings.publish_timeout_s:g} s; stopping the run (running agents "
                                   "too); run the same command again to resume") from None
        self.history.apply(event)

    def _attempt_dir(self, rollout_id: str, attempt_id: str) -> Path:
        return self.settings.logs_dir / self.run_id / rollout_id / attempt_id

    @property
    def rate_per_min(self) -> float:
        minutes = (time.monotonic() - self.started_at) / 60
        return self.counts.done_this_session / minutes if minutes > 0 else 0.0


class KafkaUnavailable(LogUnavailable, RuntimeError):
    """The broker stopped acknowledging events: nothing more can be recorded."""


class RunLocked(ServiceError):
    """Another controller on this machine is running the same run."""


@contextmanager
def _run_lock(folder: Path) -> Iterator[None]:
    """Hold the run's lock file while running; the kernel releases it when the process dies (even by SIGKILL).

    Two controllers on one run would close each other's attempts as interrupted; this stops that
    on one machine. (Across machines, give each controller its own --run-id.)"""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            raise RunLocked(f"run {folder.name} is already being run by another controller "
                            f"(pid {lock.read().strip() or '?'}); wait for it, or stop it first") from None
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        yield


async def _stop_quietly(running: Running) -> None:
    try:
        await running.stop()
        await running.close()
    except Exception:  # already gone; nothing more to do
        log.debug("stopping %s after an error", running.worker, exc_info=True)


def _ms_since(began: float) -> int:
    return int((time.monotonic() - began) * 1000)

"""The trainer process: consume trajectories, train, checkpoint, announce, commit.

    source ─▶ decode · dedupe · filter ─▶ batcher ─▶ Policy.update ─▶ checkpoint ─▶ weights event ─▶ commit

One update makes one weight version. Its order is what makes a crash harmless:
1. train on the batch and settle its records in the ledger;
2. write the checkpoint (weights, optimizer, ledger, the weights event) atomically;
3. publish the weights event and wait for the broker's ack;
4. commit the consumer offsets to the ledger's watermarks.
Died after 2: the restart finds a checkpoint whose event is not on the weights topic and publishes
it (the same event, same id), so the version is announced, never lost or trained again. Died after
3: the restart finds the event published. Either way it resumes from the checkpoint's ledger, not
from the group's (lagging) offsets, so no sample is trained twice or skipped.

SIGTERM (or Ctrl-C) lets the update in progress finish all four steps, then stops; samples still
buffered are not committed and are read again by the next trainer.

With `--ranks N` the update of step 1 runs on N Ray actors (`trainer.ranks`); this process stays
the one consumer and ledger owner. A rank that dies mid-step voids the step before anything of it is
settled: the ranks are restarted from the newest checkpoint and the same batch is trained again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import torch
from aiokafka.errors import CommitFailedError

from agentstream.schemas.codec import DecodeError, decode
from agentstream.schemas.events import Trajectory, TrajectoryEvent, Weights, WeightsEvent
from agentstream.schemas.ids import derived_id
from agentstream.schemas.kafka import Publisher, deadletter_event, ensure_topics, make_producer
from agentstream.schemas.scan import Bounds, resolve, scan
from agentstream.trainer.batcher import Batch, Batcher, Sample, group_of, oldest_version, source_of, weigh
from agentstream.trainer.checkpoint import Checkpoint, CheckpointStore, TrainingState
from agentstream.trainer.distill import Teacher
from agentstream.trainer.errors import RanksFailed, TrainerError
from agentstream.trainer.eval_hold import EvalHold
from agentstream.trainer.grpo import Policy, compute_dtype, misplaced_turn
from agentstream.trainer.ledger import Ledger
from agentstream.trainer.memory import fit_to_memory
from agentstream.trainer.settings import TrainerSettings
from agentstream.trainer.sft import SFTPolicy, eligible
from agentstream.trainer.sources import SourceRecord, TrajectorySource, make_source

if TYPE_CHECKING:
    from agentstream.trainer.ranks import RankedPolicy

log = logging.getLogger("trainer")
SOURCE = "trainer"
POLL_S = 0.5
WAITING_LOG_S = 30.0


class Trainer:
    def __init__(self, settings: TrainerSettings, source: TrajectorySource | None = None):
        self.settings = settings
        self.source = source or make_source(settings)
        self.store = CheckpointStore(settings.checkpoint_dir)
        self.stopping = asyncio.Event()
        self.published: list[WeightsEvent] = []
        self.dropped: Counter[str] = Counter()  # since the last version, by reason
        self.waiting: dict[str, Sample] = {}
        """a session's conversation → its sample in the batcher (see `_revise_waiting`)"""
        self._last_waiting_log = 0.0
        self.teacher: Teacher | None = None
        """with --distill-weight: the server that scores each batch's tokens before the update"""
        self.hold: EvalHold | None = None
        """with --hold-for-eval: the versions the eval measured"""

    def stop(self) -> None:
        if not self.stopping.is_set():
            log.info("stopping after the update in progress (if any)")
        self.stopping.set()

    async def run(self) -> list[WeightsEvent]:
        """Train until stopped, `max_versions` is reached, or an offline source ends; return the events published."""
        s = self.settings
        async with contextlib.AsyncExitStack() as cleanup:
            self.store.lock()
            cleanup.callback(self.store.unlock)
            latest = self._resume_point()
            self._load(latest)
            cleanup.callback(self._close_policy)
            if s.distill_weight:
                self.teacher = Teacher(s)
                cleanup.push_async_callback(self.teacher.close)
            self.ledger = Ledger(self.source.name, latest.state.ledger if latest else None, s.dedupe_window)
            self.batcher = self._make_batcher()
            if not s.offline_file:
                for problem in (await ensure_topics(s)).mismatches:
                    log.warning("topic %s", problem)
            producer = make_producer(s)
            await producer.start()
            cleanup.push_async_callback(producer.stop)
            self.publisher = Publisher(producer, s.topics)
            if latest is not None:
                await self._announce_if_missing(latest)
            if s.hold_for_eval:
                self.hold = EvalHold(s, s.model)
                await self.hold.start()
                cleanup.push_async_callback(self.hold.stop)
            cleanup.push_async_callback(self.source.stop)
            await self.source.start(self.ledger.watermarks, self._revoked)
            log.info("reading %s", self.source.name)
            await self._loop()
        return self.published

    # --- start-up -----------------------------------------------------------------------------

    def _resume_point(self) -> Checkpoint | None:
        """The checkpoint whose ledger this trainer resumes from."""
        return self.store.latest()

    def _make_batcher(self) -> Batcher:
        return Batcher(self.settings)

    def _load(self, latest: Checkpoint | None) -> None:
        s = self.settings
        torch.manual_seed(s.seed)
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        if latest is None:
            if s.base_model is None or not (s.base_model / "config.json").is_file():
                raise TrainerError(f"no checkpoint in {self.store.root} and no model to start from: pass "
                                 "--base-model DIR (a Hugging Face model folder, e.g. `agentstream model tiny DIR`)")
            self.model_dir, self.version, self.step = s.base_model.resolve(), s.initial_version, 0
            s = self._fit_memory(self.model_dir)
            self.policy = self._make_policy(self.model_dir, None, s)
            log.info("starting from %s at version %d", self.model_dir, self.version)
            return
        if latest.state.model != s.model:
            raise TrainerError(f"{self.store.root} holds checkpoints of model {latest.state.model!r}, not {s.model!r}: "
                             "pass --model or another --checkpoint-dir")
        optimizer_file = latest.optimizer_file if s.save_optimizer and latest.optimizer_file.is_file() else None
        self.model_dir, self.version, self.step = latest.path, latest.version, latest.state.step
        s = self._fit_memory(latest.path)
        self.policy = self._make_policy(latest.path, optimizer_file, s)
        log.info("resuming from %s (version %d, step %d%s)", latest.path, self.version, self.step,
                 ", optimizer state restored" if optimizer_file else "")

    def _fit_memory(self, folder: Path) -> TrainerSettings:
        """The settings, with a smaller micro-batch or gradient checkpointing if the estimated peak needs them
        (and the user left them free); DoesNotFit when nothing fits. The estimate is logged: a kill by the
        kernel is reported with it (stack/exits.py reads this line from the log)."""
        fitted = fit_to_memory(self.settings, folder, bfloat16=compute_dtype(self.settings) == torch.bfloat16)
        if fitted is not None:
            (log.warning if fitted.chosen else log.info)("%s", fitted.describe())
            self.settings = fitted.settings
        return self.settings

    @staticmethod
    def _make_policy(folder: Path, optimizer_file: Path | None, settings: TrainerSettings) -> Policy | RankedPolicy:
        """The model being trained: in this process, or sharded over `--ranks` Ray actors."""
        if settings.ranks > 1:
            from agentstream.trainer.ranks import RankedPolicy  # imports Ray: only when asked for

            return RankedPolicy.load(folder, settings, optimizer_file)
        optimizer_state = torch.load(optimizer_file, weights_only=True, map_location=settings.device) \
            if optimizer_file else None
        algorithm = SFTPolicy if settings.loss == "sft" else Policy
        return algorithm.load(folder, settings, optimizer_state)

    def _restart_policy(self) -> None:
        """Fresh ranks from the newest checkpoint (or the base model): the state before the failed step."""
        from agentstream.trainer.ranks import RankedPolicy

        assert isinstance(self.policy, RankedPolicy), "only ranks fail a step (RanksFailed)"
        s = self.settings
        optimizer_file = self.model_dir / "training_state" / "optimizer.pt"
        self.policy = self.policy.restart(self.model_dir, optimizer_file if optimizer_file.is_file() else None, s)

    def _close_policy(self) -> None:
        if hasattr(self.policy, "close"):
            self.policy.close()

    async def _announce_if_missing(self, latest: Checkpoint) -> None:
        """A checkpoint written just before a crash may lack its weights event: publish it now."""
        if await self._is_on_weights_topic(latest.event):
            return
        log.info("version %d was checkpointed but not announced: publishing its weights event", latest.version)
        await self.publisher.publish(latest.event)

    async def _is_on_weights_topic(self, event: WeightsEvent, tail: int = 100) -> bool:
        """Look for the event among the last `tail` records (a miss only costs a duplicate consumers drop by id)."""
        s = self.settings
        log_range = await resolve(s, s.topics.weights)
        last = {p: (max(start, end - tail), end) for p, (start, end) in log_range.items()}
        async with contextlib.aclosing(scan(s, s.topics.weights, Bounds.exactly(last, last))) as batches:
            async for records in batches:
                if any(r.key == event.key and _event_id(r.value) == event.id for r in records):
                    return True
        return False

    def _revoked(self, partitions: set[int]) -> None:
        forgotten = self.batcher.forget(partitions)
        self._settled_samples([sample for sample in self.waiting.values() if sample.partition in partitions])
        self.ledger.release(partitions)
        log.info("partitions %s revoked: %d buffered samples left to their next reader", sorted(partitions), forgotten)

    # --- the loop -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        s = self.settings
        while not self.stopping.is_set():
            for record in await self.source.poll(POLL_S):
                await self._admit(record)
            while True:
                if self.hold is not None and await self.hold.holds(self.version):
                    break  # (samples are still read: the consumer stays in its group)
                batch = self.batcher.take(time.monotonic(), self.version, flush=self.source.exhausted)
                self._settle_dropped(batch)
                if not batch.samples:
                    break
                await self._update(batch)
                if s.max_versions and len(self.published) >= s.max_versions:
                    return
            if self.source.exhausted and not len(self.batcher):
                log.info("offline source done: %d versions published, now at version %d",
                         len(self.published), self.version)
                return
            self._log_waiting()

    async def _admit(self, record: SourceRecord) -> None:
        """Decode a record and buffer its sample, or settle it at once with the reason it is not trained on."""
        if self.ledger.settled_before(record.partition, record.offset):
            return
        try:
            event = decode(record.value, expect=TrajectoryEvent)
        except DecodeError as exc:
            await self._deadletter(record, f"not a trajectory event: {exc}")
            return self._drop(record.partition, record.offset, None, "undecodable")
        if self.ledger.is_duplicate(event.id):
            # settled without its id: the id stands for the first delivery, which may still be held
            return self._drop(record.partition, record.offset, None, "duplicate")
        if event.data.revision_of is not None and self.ledger.was_trained(event.data.revision_of):
            # one conversation, one sample: its later feedback does not count it twice
            return self._drop(record.partition, record.offset, event.id, "conversation_trained")
        if problem := malformed(event.data, self.settings.turn_rewards):
            await self._deadletter(record, problem)
            return self._drop(record.partition, record.offset, event.id, "malformed")
        if reason := self._unusable(event.data):
            return self._drop(record.partition, record.offset, event.id, reason)
        if event.data.group_id is not None and self.batcher.taken(event.data.group_id):
            # a straggler of a group trained without it (--batch-timeout-s): alone it has no peers to compare with
            return self._drop(record.partition, record.offset, event.id, "group_trained")
        source = source_of(event.data)
        source_weight = self.settings.source_weights.get(source, 1.0)
        if source_weight == 0:
            return self._drop(record.partition, record.offset, event.id, "source_excluded")
        sample = Sample(event.id, record.partition, record.offset, event.data, group_of(event.id, event.data),
                        arrived=time.monotonic(),
                        shaping=self.settings.reward_penalties.get(event.data.end_reason or "", 0.0),
                        source=source, source_weight=source_weight)
        if self.settings.loss == "sft" and not eligible(sample, self.settings.sft_min_reward):
            return self._drop(record.partition, record.offset, event.id, "below_sft_threshold")
        if not weigh(sample, self.version, self.settings):
            return self._drop_stale(sample)
        self.ledger.hold(record.partition, record.offset, event.id)
        if sample.source == "session" and self._revise_waiting(sample):
            return
        if (superseded := self.batcher.add(sample)) is not None:
            self._drop(superseded.partition, superseded.offset, superseded.id, "superseded")

    def _revise_waiting(self, sample: Sample) -> bool:
        """A session's conversation waits in the batcher at most once: a revision of it (later feedback, a later
        record of the same partition) takes the earlier one's place, which is settled as `revised`."""
        earlier = self.waiting.get(sample.conversation)
        self.waiting[sample.conversation] = sample
        if earlier is None or self.ledger.held[earlier.partition].get(earlier.offset) != earlier.id:
            return False
        self.batcher.replace(earlier, sample)
        self._drop(earlier.partition, earlier.offset, earlier.id, "revised")
        return True

    def _settled_samples(self, samples: list[Sample]) -> None:
        for sample in samples:
            if self.waiting.get(sample.conversation) is sample:
                del self.waiting[sample.conversation]

    def _unusable(self, trajectory: Trajectory) -> str | None:
        if trajectory.split != "train":
            return "validation"
        if trajectory.model is not None and trajectory.model != self.settings.model:
            return "other_model"
        if trajectory.reward is None:
            return "no_reward"
        if (self.settings.loss != "sft" and not self.settings.train_without_logprobs
                and any(turn.logprobs_missing for turn in trajectory.turns)):
            return "logprobs_missing"  # (placeholders of 0.0 would weigh its tokens as if sampled with probability 1)
        if not any(any(seq.mask[1:self.settings.max_seq_len]) for seq in trajectory.sequences):
            return "no_tokens"  # (within --max-seq-len)
        return None

    def _drop(self, partition: int, offset: int, event_id: str | None, reason: str) -> None:
        log.debug("not training on %d:%d (%s): %s", partition, offset, event_id, reason)
        self.ledger.settle(partition, offset, event_id)
        self.dropped[reason] += 1

    def _drop_stale(self, sample: Sample) -> None:
        """Drop a sample too stale to train, counted by the version that generated it: in a canary, its arm."""
        self._drop(sample.partition, sample.offset, sample.id, "stale")
        version = oldest_version(sample.trajectory, self.settings.initial_version)
        if version is not None:
            self.dropped[f"stale_v{version}"] += 1

    def _settle_dropped(self, batch: Batch) -> None:
        for reason, samples in batch.dropped.items():
            self._settled_samples(samples)
            for sample in samples:
                if reason == "stale":
                    self._drop_stale(sample)
                else:
                    self._drop(sample.partition, sample.offset, sample.id, reason)

    async def _deadletter(self, record: SourceRecord, reason: str) -> None:
        event = deadletter_event(record, reason, SOURCE)
        # derived from the record's position, so a restarted trainer that meets it again writes the same id
        event.id = derived_id("trainer.deadletter", record.topic, str(record.partition), str(record.offset))
        await self.publisher.publish(event)

    # --- one update ---------------------------------------------------------------------------

    async def _update(self, batch: Batch) -> None:
        s = self.settings
        metrics = await self._train(batch)
        for sample in batch.samples:
            self.ledger.settle(sample.partition, sample.offset, sample.id)
            if sample.source == "session":
                self.ledger.trained_on(sample.conversation)
        self._settled_samples(batch.samples)
        version, base = self.version + 1, self.version
        self.step += int(metrics["optimizer_steps"])
        metrics.update(self._accounting(batch.samples))
        lineage = [sample.id for sample in batch.samples]
        uri = str(self.store.path_of(version))
        state = TrainingState(model=s.model, version=version, base_version=base, step=self.step, lineage=lineage,
                              ledger=self.ledger.snapshot())
        event = WeightsEvent(
            id=derived_id("weights", s.model, str(version), uri), source=SOURCE,
            data=Weights(model=s.model, version=version, uri=uri, step=self.step, base_version=base,
                         metrics={k: float(v) for k, v in metrics.items() if math.isfinite(v)}, lineage=lineage),
        )
        started = time.perf_counter()
        checkpoint = await asyncio.to_thread(
            self.store.write, state, event, self.policy.save, self.model_dir,
            self._save_optimizer if s.save_optimizer else None)
        checkpoint_s = time.perf_counter() - started
        await self.publisher.publish(event)
        await self._commit(state)
        self.version, self.model_dir = version, checkpoint.path
        self.published.append(event)
        self.dropped.clear()
        self.store.prune(s.keep_checkpoints)
        self._log_version(event, checkpoint_s)

    async def _commit(self, state: TrainingState) -> None:
        """Commit the consumer offsets to the checkpointed ledger's watermarks."""
        try:
            await self.source.commit(state.ledger.sources[self.source.name].watermarks)
        except CommitFailedError as exc:  # a rebalance; the checkpoint holds the position, the next commit catches up
            log.warning("offsets of version %d not committed (%s); the next version's commit covers them",
                        state.version, exc)

    async def _train(self, batch: Batch) -> dict[str, float]:
        """Policy.update, retried on fresh ranks when a rank dies (nothing of the failed step is kept:
        the ledger is settled, the checkpoint written and the offsets committed only after a success)."""
        s = self.settings
        teacher_s = await self.teacher.score_samples(batch.samples, s.max_seq_len) if self.teacher else None
        for attempt in range(s.rank_restarts + 1):
            try:
                metrics = await asyncio.to_thread(self.policy.update, batch.samples)
                return metrics if teacher_s is None else {**metrics, "teacher_s": teacher_s}
            except RanksFailed as exc:
                if attempt == s.rank_restarts:
                    raise TrainerError(f"{exc}; gave up after {attempt} restarts of the ranks (--rank-restarts). "
                                       "Nothing of this batch was kept: a restarted trainer trains it again") from exc
                log.warning("%s: the step is void; restarting the ranks from version %d and training the same "
                            "%d samples again", exc, self.version, len(batch.samples))
                await asyncio.to_thread(self._restart_policy)
        raise AssertionError("unreachable")

    def _accounting(self, samples: list[Sample]) -> dict[str, float]:
        staleness = [sample.staleness for sample in samples]
        counts = {f"{reason}_dropped": float(n) for reason, n in self.dropped.items()}
        return {
            **counts,
            "stale_dropped": float(self.dropped["stale"]),
            "stale_downweighted": float(sum(sample.weight < 1 for sample in samples)),
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": float(max(staleness)),
            "buffered": float(len(self.batcher)),
        }

    def _save_optimizer(self, path: Path) -> None:
        self.policy.save_optimizer(path)

    # --- progress -----------------------------------------------------------------------------

    def _log_version(self, event: WeightsEvent, checkpoint_s: float) -> None:
        m = event.data.metrics
        log.info("version %d ← %d | %d samples, %d groups | reward %.3f | loss %.4f kl %.4f clipfrac %.3f "
                 "| stale dropped %d | train %.2f s, checkpoint %.2f s%s",
                 event.data.version, event.data.base_version, m["samples"], m["groups"], m["reward_mean"],
                 m["loss"], m.get("kl", 0.0), m.get("clipfrac", 0.0), m["stale_dropped"], m["train_s"], checkpoint_s,
                 (f" | IS weight mean {m['is_weight_mean']:.3f} max {m['is_weight_max']:.3g} truncated "
                  f"{m['is_truncated_share']:.1%} ESS {m['is_ess']:.3f}" if "is_weight_mean" in m else "")
                 + (f" | teacher KL {m['distill_kl']:.4f} scored in {m['teacher_s']:.2f} s" if "distill_kl" in m else ""))

    def _log_waiting(self) -> None:
        now = time.monotonic()
        if now - self._last_waiting_log < WAITING_LOG_S:
            return
        self._last_waiting_log = now
        groups = self.batcher.groups.values()
        complete = sum(len(g.samples) >= self.settings.group_size for g in groups)
        log.info("waiting for samples: %d buffered in %d groups (%d complete, %d needed per batch)",
                 len(self.batcher), len(groups), complete, self.settings.groups_per_batch)


def _event_id(raw: bytes | None) -> str | None:
    try:
        event = orjson.loads(raw or b"")
    except orjson.JSONDecodeError:
        return None
    found = event.get("id") if isinstance(event, dict) else None
    return found if isinstance(found, str) else None


def malformed(trajectory: Trajectory, turn_rewards: bool = False) -> str | None:
    """A trajectory that validates but cannot be trained on as it is (a bug upstream): deadletter it. With
    per-turn credit, a rewarded turn must be where its sequence has it."""
    for i, seq in enumerate(trajectory.sequences):
        lengths = {len(seq.token_ids), len(seq.mask), len(seq.logprobs), len(seq.weight_versions)}
        if len(lengths) != 1:
            return (f"sequence {i}: token_ids, mask, logprobs and weight_versions differ in length "
                    f"({len(seq.token_ids)}, {len(seq.mask)}, {len(seq.logprobs)}, {len(seq.weight_versions)})")
        if any(m not in (0, 1) for m in seq.mask):
            return f"sequence {i}: mask values must be 0 or 1"
        if not all(math.isfinite(lp) for lp in seq.logprobs):
            return f"sequence {i}: logprobs must be finite"
    if trajectory.reward is not None and not math.isfinite(trajectory.reward):
        return f"reward must be finite, got {trajectory.reward}"
    if turn_rewards and any(turn.reward is not None for turn in trajectory.turns):
        if bad := [turn.reward for turn in trajectory.turns if turn.reward is not None and not math.isfinite(turn.reward)]:
            return f"turn rewards must be finite, got {bad}"
        return misplaced_turn(trajectory)
    return None

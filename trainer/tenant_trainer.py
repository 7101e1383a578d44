"""The trainer with `--tenant-adapters`: each tenant's trajectories train that tenant's LoRA adapter over one frozen
base (`trainer.adapters`), one process for every tenant (why: trainer/README.md, "Tenants").

Each tenant has its own batcher, versions, checkpoints (`<checkpoint_dir>/tenants/<tenant>/v…`, a PEFT adapter
folder with its optimizer state) and weights events (`tenant` set, `uri` the adapter folder). The consumer and the
ledger are the process's one: a record is settled when its tenant's update is checkpointed (or when it is dropped),
so the offsets committed never pass a record some tenant still holds, and the newest checkpoint of any tenant
holds the ledger every tenant resumes from (a tenant's samples are settled only by its own checkpoints, so that
ledger never counts a sample an adapter on disk has not learnt). A trajectory of no tenant is not trained here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from agentstream.schemas.events import Trajectory, Weights, WeightsEvent
from agentstream.schemas.ids import derived_id
from agentstream.schemas.keys import TENANT_NAME
from agentstream.trainer.adapters import TenantAdapters
from agentstream.trainer.batcher import Batch, Batcher, Sample
from agentstream.trainer.checkpoint import Checkpoint, CheckpointStore, TrainingState
from agentstream.trainer.errors import TrainerError
from agentstream.trainer.service import SOURCE, Trainer
from agentstream.trainer.settings import TrainerSettings

log = logging.getLogger("trainer")
TENANTS_DIR = "tenants"


class TenantBatchers:
    """A batcher per tenant, behind the one batcher's interface; `take` judges staleness against the sample's
    tenant's adapter version, and takes the tenants' batches in turn."""

    def __init__(self, settings: TrainerSettings, versions: dict[str, int]):
        self.settings = settings
        self.versions = versions  # (the trainer's: updated as each tenant's adapter advances)
        self.batchers: dict[str, Batcher] = {}
        self._turn = 0

    def of(self, tenant: str) -> Batcher:
        return self.batchers.setdefault(tenant, Batcher(self.settings))

    def __len__(self) -> int:
        return sum(len(batcher) for batcher in self.batchers.values())

    @property
    def groups(self) -> dict[str, object]:
        return {f"{tenant}/{key}": group for tenant, batcher in self.batchers.items()
                for key, group in batcher.groups.items()}

    def add(self, sample: Sample) -> Sample | None:
        return self.of(tenant_of(sample)).add(sample)

    def replace(self, old: Sample, new: Sample) -> None:
        self.of(tenant_of(old)).replace(old, new)

    def forget(self, partitions: set[int]) -> int:
        return sum(batcher.forget(partitions) for batcher in self.batchers.values())

    def taken(self, group: str) -> bool:
        # (a planned group's id names its run and task: it is one tenant's)
        return any(batcher.taken(group) for batcher in self.batchers.values())

    def take(self, now: float, version: int, flush: bool = False) -> Batch:
        """The next tenant's batch (in turn), with what went stale or expired in any tenant meanwhile."""
        tenants = sorted(self.batchers)
        taken = Batch()
        for i in range(len(tenants)):
            tenant = tenants[(self._turn + i) % len(tenants)]
            batch = self.batchers[tenant].take(now, self.versions.get(tenant, self.settings.initial_version), flush)
            for reason, samples in batch.dropped.items():
                taken.drop(reason, samples)
            if batch.samples:
                taken.samples = batch.samples
                self._turn = (self._turn + i + 1) % len(tenants)
                break
        return taken


def tenant_of(sample: Sample) -> str:
    assert sample.trajectory.tenant is not None, "a trajectory of no tenant is dropped before it is buffered"
    return sample.trajectory.tenant


class TenantTrainer(Trainer):
    """`Trainer` with one adapter per tenant: the same consumer, ledger and order of an update's four steps."""

    def _load(self, latest: Checkpoint | None) -> None:
        s = self.settings
        torch.manual_seed(s.seed)
        if s.torch_threads:
            torch.set_num_threads(s.torch_threads)
        if s.base_model is None or not (s.base_model / "config.json").is_file():
            raise TrainerError("--tenant-adapters trains adapters over a base model: pass --base-model DIR")
        self.model_dir, self.version, self.step = s.base_model.resolve(), s.initial_version, 0
        self.adapters = TenantAdapters(self.model_dir, s)
        self.versions: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        for tenant, checkpoint in self._latest_of_each().items():
            optimizer = checkpoint.optimizer_file
            state = torch.load(optimizer, weights_only=True, map_location=s.device) if optimizer.is_file() else None
            self.adapters.add(tenant, checkpoint.path, state)
            self.versions[tenant], self.steps[tenant] = checkpoint.version, checkpoint.state.step
            log.info("tenant %s: resuming its adapter at version %d", tenant, checkpoint.version)

    def _latest_of_each(self) -> dict[str, Checkpoint]:
        root = self.store.root / TENANTS_DIR
        stores = {folder.name: CheckpointStore(folder) for folder in sorted(root.iterdir())} if root.is_dir() else {}
        for store in stores.values():  # (the root's lock covers them: their partial writes are ours to clear)
            for partial in store.root.glob(".tmp-*"):
                shutil.rmtree(partial)
        return {tenant: latest for tenant, store in stores.items() if (latest := store.latest()) is not None}

    def _newest(self) -> Checkpoint | None:
        """The newest checkpoint of any tenant: it holds the ledger to resume from (its writing was the last
        settling of any sample)."""
        latest = self._latest_of_each().values()
        return max(latest, key=lambda c: c.event.time) if latest else None

    def _resume_point(self) -> Checkpoint | None:
        return self._newest()

    def _make_batcher(self) -> TenantBatchers:  # type: ignore[override]  # (the one batcher's interface)
        return TenantBatchers(self.settings, self.versions)

    def _close_policy(self) -> None:
        pass  # (the adapters hold no process or rank to close)

    async def _announce_if_missing(self, latest: Checkpoint) -> None:
        """Each tenant's newest version, if a crash came between its checkpoint and its event."""
        for checkpoint in self._latest_of_each().values():
            await super()._announce_if_missing(checkpoint)

    def _unusable(self, trajectory: Trajectory) -> str | None:
        if trajectory.tenant is None:
            return "no_tenant"  # (the shared policy is another trainer's: one without --tenant-adapters)
        if not TENANT_NAME.fullmatch(trajectory.tenant):
            return "invalid_tenant"  # (it names a folder: `../x` written to the topic by hand lands nowhere)
        return super()._unusable(trajectory)

    async def _update(self, batch: Batch) -> None:
        s = self.settings
        tenant = tenant_of(batch.samples[0])
        if tenant not in self.adapters:
            self.adapters.add(tenant)
        metrics = await asyncio.to_thread(self.adapters.update, tenant, batch.samples)
        for sample in batch.samples:
            self.ledger.settle(sample.partition, sample.offset, sample.id)
            if sample.source == "session":
                self.ledger.trained_on(sample.conversation)
        self._settled_samples(batch.samples)
        base = self.versions.get(tenant, s.initial_version)
        version = base + 1
        self.steps[tenant] = self.steps.get(tenant, 0) + int(metrics["optimizer_steps"])
        metrics.update(self._accounting(batch.samples))
        lineage = [sample.id for sample in batch.samples]
        store = CheckpointStore(self.store.root / TENANTS_DIR / tenant)
        uri = str(store.path_of(version))
        state = TrainingState(model=s.model, version=version, base_version=base, step=self.steps[tenant],
                              lineage=lineage, ledger=self.ledger.snapshot())
        event = WeightsEvent(
            id=derived_id("weights", s.model, tenant, str(version), uri), source=SOURCE,
            data=Weights(model=s.model, version=version, uri=uri, step=self.steps[tenant], base_version=base,
                         tenant=tenant, lineage=lineage,
                         metrics={k: float(v) for k, v in metrics.items() if math.isfinite(v)}))
        started = time.perf_counter()
        await asyncio.to_thread(store.write, state, event, lambda folder: self.adapters.save(tenant, folder),
                                _empty(store), self._optimizer_of(tenant) if s.save_optimizer else None)
        checkpoint_s = time.perf_counter() - started
        await self.publisher.publish(event)
        await self._commit(state)
        self.versions[tenant] = version  # (the batchers' too: they judge staleness against it)
        self.published.append(event)
        self.dropped.clear()
        store.prune(s.keep_checkpoints)
        self._log_version(event, checkpoint_s)
        log.info("(that version is tenant %s's adapter)", tenant)

    def _optimizer_of(self, tenant: str) -> Callable[[Path], None]:
        return lambda path: self.adapters.save_optimizer(tenant, path)


def _empty(store: CheckpointStore) -> Path:
    """A folder with no files to carry into an adapter's checkpoint (an adapter needs none of the base's)."""
    folder = store.root / ".carry"
    folder.mkdir(parents=True, exist_ok=True)
    return folder

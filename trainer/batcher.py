"""Samples wait here until they make a batch: grouped by task, judged for staleness.

When a batch is ready:
- a group is complete when it holds `group_size` samples;
- `groups_per_batch` complete groups, oldest first, make a batch;
- a group that has waited `batch_timeout_s` and holds at least `min_group_size` samples is taken as
  it is, in a batch together with whatever complete groups wait (at most `groups_per_batch` groups);
- a group still below `min_group_size` after `group_timeout_s` is dropped (`incomplete`);
- at the end of an offline source (`flush`) every group of at least `min_group_size` is trained
  and the rest is dropped.

Staleness is judged again when a group is taken, against the version being trained: a sample is
as stale as its oldest model token. Samples beyond `max_staleness` are dropped (`stale`), or kept
with a loss weight of `stale_decay ** (staleness - max_staleness)`. A group that falls below
`min_group_size` that way is dropped whole (`incomplete`): group-relative advantages need peers.

A retried attempt (same group and sample index, higher attempt number) replaces the earlier one
(`superseded`). A sample of a planned group (`group_id`) already taken into a batch, a straggler after
`batch_timeout_s`, is not buffered: alone it has no peers (`taken`; the trainer drops it as `group_trained`).

Samples without a task group (sessions: one sample per prompt; rollouts launched without a task) need
no peers: they fill ungrouped batches-in-waiting of `group_size` samples, in arrival order, which
count as groups for the rules above except that any number of samples is enough (a group-free
baseline gives their advantages, `grpo.compute_advantages`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from agentstream.schemas.events import Trajectory
from agentstream.trainer.settings import TrainerSettings


@dataclass(eq=False)
class Sample:
    """A trajectory waiting to be trained on, and where it came from."""

    id: str
    partition: int
    offset: int
    trajectory: Trajectory
    group: str
    arrived: float = 0.0
    """monotonic seconds"""
    staleness: int = 0
    weight: float = 1.0
    shaping: float = 0.0
    """added to the reward for training only (--reward-penalties): the log and eval keep the grader's"""
    source: str = "rollout"
    """where the trajectory came from (rollout or session), as `source_of` tells"""
    source_weight: float = 1.0
    """the loss weight of its source (--source-weights)"""
    token_weights: list[list[float]] | None = None
    """per sequence, each token's staleness weight, when its tokens came from versions weighed differently (a
    completion that went on across a weight update, `--partial-rollouts`); None: `weight` for every token"""
    teacher_logprobs: list[list[float]] | None = None
    """per sequence, the distillation teacher's logprob of each token given those before it (0.0 at position 0),
    aligned with the sequence's `token_ids`, as far as --max-seq-len (`trainer.distill`)"""

    @property
    def grouped(self) -> bool:
        """whether it has peers to compare with (a task group)"""
        return not self.group.startswith(ALONE)

    @property
    def conversation(self) -> str:
        """what it is one sample of: a session's conversation (its first trajectory's id, whichever revision
        this is), else the trajectory itself"""
        return self.trajectory.revision_of or self.id

    @property
    def reward(self) -> float:
        """what the trainer learns from: the trajectory's reward, shaped"""
        assert self.trajectory.reward is not None, "only rewarded trajectories become samples"
        return self.trajectory.reward + self.shaping


ALONE = "alone:"
TAKEN_REMEMBERED = 10_000
"""task groups the batcher remembers having taken (a straggler comes minutes after its group, not days)"""


def group_of(event_id: str, trajectory: Trajectory) -> str:
    return trajectory.group_id or (f"task:{trajectory.task_id}" if trajectory.task_id else f"{ALONE}{event_id}")


def source_of(trajectory: Trajectory) -> str:
    """session (production traffic: `session_id` set) or rollout (launched by the controller or an agent)"""
    return "session" if trajectory.session_id is not None else "rollout"


def staleness(trajectory: Trajectory, version: int, initial_version: int) -> int:
    """Versions between the trainer's and the oldest weights that generated one of the sample's tokens."""
    oldest = oldest_version(trajectory, initial_version)
    return max(0, version - oldest) if oldest is not None else 0


def oldest_version(trajectory: Trajectory, initial_version: int) -> int | None:
    """The oldest weights that generated one of the sample's tokens (in a canary: the arm that served it)."""
    versions = [initial_version if v is None else v
                for seq in trajectory.sequences for v, m in zip(seq.weight_versions, seq.mask) if m]
    return min(versions) if versions else None


def weigh(sample: Sample, version: int, settings: TrainerSettings) -> bool:
    """Set the sample's staleness and loss weight; False when it is to be dropped. Staleness is the oldest
    token's; a down-weighted sample whose tokens came from several versions weighs each token by its own."""
    sample.staleness = staleness(sample.trajectory, version, settings.initial_version)
    sample.token_weights = None
    over = sample.staleness - settings.max_staleness
    if over <= 0:
        sample.weight = 1.0
        return True
    if settings.stale_policy == "drop":
        return False
    sample.weight = settings.stale_decay ** over
    sample.token_weights = token_weights(sample.trajectory, version, settings)
    return True


def token_weights(trajectory: Trajectory, version: int, settings: TrainerSettings) -> list[list[float]] | None:
    """Each token's down-weight by the version that sampled it (decay ** versions past --max-staleness), per
    sequence; None when every generated token weighs the same."""
    def weight(sampled_by: int | None) -> float:
        behind = version - (settings.initial_version if sampled_by is None else sampled_by)
        return float(settings.stale_decay ** max(0, behind - settings.max_staleness))

    weights = [[weight(v) if m else 0.0 for v, m in zip(seq.weight_versions, seq.mask)]
               for seq in trajectory.sequences]
    distinct = {w for seq, row in zip(trajectory.sequences, weights) for w, m in zip(row, seq.mask) if m}
    return weights if len(distinct) > 1 else None


@dataclass
class Batch:
    samples: list[Sample] = field(default_factory=list)
    dropped: dict[str, list[Sample]] = field(default_factory=dict)
    """reason → samples settled without training"""

    def drop(self, reason: str, samples: list[Sample]) -> None:
        if samples:
            self.dropped.setdefault(reason, []).extend(samples)


@dataclass
class Group:
    key: str
    since: float
    samples: list[Sample] = field(default_factory=list)
    ungrouped: bool = False
    """samples without a task group, gathered in arrival order"""

    def age(self, now: float) -> float:
        return now - self.since


class Batcher:
    def __init__(self, settings: TrainerSettings):
        self.settings = settings
        self.groups: dict[str, Group] = {}  # in order of first arrival
        self._ungrouped = 0  # the number of the ungrouped group being filled
        self._taken: OrderedDict[str, None] = OrderedDict()
        """task groups taken into a batch, oldest first"""

    def taken(self, group: str) -> bool:
        """Whether the planned group (`group_id`) was taken into a batch already (since this batcher began)."""
        return group in self._taken

    def __len__(self) -> int:
        return sum(len(group.samples) for group in self.groups.values())

    def add(self, sample: Sample) -> Sample | None:
        """Buffer the sample; return the sample it supersedes (or itself, if a later attempt is already here)."""
        if not sample.grouped:
            self._gather(sample)
            return None
        group = self.groups.setdefault(sample.group, Group(sample.group, sample.arrived))
        new = sample.trajectory
        for i, old in enumerate(group.samples):
            if old.trajectory.sample_index == new.sample_index and old.trajectory.attempt_number != new.attempt_number:
                if new.attempt_number > old.trajectory.attempt_number:
                    group.samples[i] = sample
                    return old
                return sample
        group.samples.append(sample)
        return None

    def replace(self, old: Sample, new: Sample) -> None:
        """Put `new` where `old` waits (a revision of the conversation: its reward changed before training)."""
        for group in self.groups.values():
            for i, sample in enumerate(group.samples):
                if sample is old:
                    group.samples[i] = new
                    return
        raise KeyError(f"sample {old.id} is not buffered")

    def _gather(self, sample: Sample) -> None:
        key = f"ungrouped:{self._ungrouped}"
        group = self.groups.get(key)
        if group is not None and len(group.samples) >= self.settings.group_size:
            self._ungrouped += 1
            key = f"ungrouped:{self._ungrouped}"
            group = None
        if group is None:
            group = self.groups[key] = Group(key, sample.arrived, ungrouped=True)
        group.samples.append(sample)

    def _least(self, group: Group) -> int:
        """the fewest samples the group is trained with"""
        return 1 if group.ungrouped else self.settings.min_group_size

    def take(self, now: float, version: int, flush: bool = False) -> Batch:
        """The next batch, possibly empty; `dropped` holds what expired or went stale meanwhile."""
        s = self.settings
        batch = Batch()
        for group in list(self.groups.values()):
            if len(group.samples) < self._least(group) and (flush or group.age(now) >= s.group_timeout_s):
                batch.drop("incomplete", self.groups.pop(group.key).samples)
        complete = [g for g in self.groups.values() if len(g.samples) >= s.group_size]
        due = [g for g in self.groups.values() if self._least(g) <= len(g.samples) < s.group_size
               and (flush or g.age(now) >= s.batch_timeout_s)]
        if len(complete) >= s.groups_per_batch:
            chosen = complete[: s.groups_per_batch]
        elif due or (flush and complete):  # (at the end of a source, complete groups need no company)
            chosen = (due + complete)[: s.groups_per_batch]
        else:
            return batch
        for group in chosen:
            del self.groups[group.key]
            self._remember(group)
            fresh: list[Sample] = []
            stale: list[Sample] = []
            for sample in group.samples:
                (fresh if weigh(sample, version, s) else stale).append(sample)
            batch.drop("stale", stale)
            if len(fresh) < self._least(group):
                batch.drop("incomplete", fresh)
            else:
                batch.samples += fresh
        return batch

    def _remember(self, group: Group) -> None:
        # only a planned group (the controller's `group_id`: one task, one epoch) is over once taken; a task
        # without one may be attempted again later, in a group that is new
        if group.ungrouped or group.samples[0].trajectory.group_id is None:
            return
        self._taken[group.key] = None
        while len(self._taken) > TAKEN_REMEMBERED:
            self._taken.popitem(last=False)

    def forget(self, partitions: set[int]) -> int:
        """Drop buffered samples of partitions this trainer no longer owns (their new owner reads them)."""
        forgotten = 0
        for key, group in list(self.groups.items()):
            kept = [sample for sample in group.samples if sample.partition not in partitions]
            forgotten += len(group.samples) - len(kept)
            if kept:
                group.samples = kept
            else:
                del self.groups[key]
        return forgotten

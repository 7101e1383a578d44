"""Every event agentstream writes, as pydantic models.

One envelope for all (`Event`): id, type, schema_version, time, source, rollout_id, attempt_id,
data. Each event type is a subclass that fixes `type` to a literal and `data` to its payload, so
a decoder picks the class from `type` alone (see `codec.py`).

Payloads forbid unknown fields: within one schema version the shape is exact, and a producer
that needs a new field bumps `SCHEMA_VERSION`, which older consumers refuse explicitly. That holds
for an optional field with a default too: `encode` writes every field, so an older consumer would
meet the field anyway, and it had better deadletter the event as "upgrade the consumer" than as a
malformed one. A newer consumer reads every older version (a missing field takes its default).

Versions: 1, the first; 2, `Call.retry_count` (the agent's SDK retried the request) and
`Trajectory.superseded` (calls whose answer was lost and asked again); 3, sessions (production
traffic, `schemas.sessions`): the `session.ended` and `feedback` events, `Trajectory.session_id`,
`Turn.completion_start` (a turn's token span, for per-turn rewards) and `Reward.trajectory_id` (a reward
computed after its trajectory was published); 4, `Trajectory.revision_of` (a session's trajectory published
again with the reward of feedback that came after it) and `Turn.logprobs_missing` (its call recorded none); 5,
`Call.weight_segments` and `Turn.weight_segments` (a completion that went on across a weight update: which
version sampled which of its tokens, `--partial-rollouts`); 6, the `pool.held` event (a gateway replica holds a
model's new requests for an update, and its own in flight drained: the applier pauses the servers after every live
replica said so).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from agentstream.schemas.ids import new_id, now_ms

SCHEMA_VERSION = 6


class Payload(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Event(BaseModel):
    """The envelope. Subclasses narrow `type` and `data`."""

    model_config = ConfigDict(extra="forbid")

    topic: ClassVar[str]
    """Base name of the topic this event type is written to (see `schemas.topics`)."""

    id: str = Field(default_factory=new_id, description="UUIDv7 (or derived UUIDv5); consumers drop repeats by id")
    type: str
    schema_version: int = SCHEMA_VERSION
    time: int = Field(default_factory=now_ms, description="UTC milliseconds since the epoch")
    source: str = Field(description="the service or component that wrote the event")
    rollout_id: str | None = None
    attempt_id: str | None = None
    data: Payload

    @property
    def key(self) -> bytes | None:
        """The Kafka record key: the rollout id for rollout-scoped events."""
        return self.rollout_id.encode() if self.rollout_id else None


# --- rollout lifecycle (topic: rollouts) -----------------------------------------------------


class Task(Payload):
    id: str
    input: Any = Field(description="what the agent is asked to do; any JSON value")
    reward_fn: str | None = Field(None, description="`module:function` that scores the trajectory")
    metadata: dict[str, Any] = Field(default_factory=dict, description="e.g. the expected answer")

    @property
    def graded(self) -> bool:
        """Its reward comes from its reward function or a grader (`metadata["reward_source"] == "grader"`), never
        from the agent: its agents' tokens say so and the gateway refuses their rewards."""
        return self.reward_fn is not None or self.metadata.get("reward_source") == "grader"


class RolloutQueued(Payload):
    task: Task
    group_id: str = Field(description="samples of one task in one epoch share a group (group-relative advantages)")
    sample_index: int = 0
    epoch: int = 0
    split: Literal["train", "validation"] = "train"
    attempt_number: int = Field(1, description="1 for the first attempt; retries count up")
    weight_version: int | None = Field(None, description="the weight version current at launch")
    model: str | None = None
    managed: bool = Field(True, description="a controller owns this attempt and reports how it ended")


class RolloutStarted(Payload):
    attempt_number: int = 1
    launcher: Literal["local", "kubernetes"]
    worker: str = Field(description="process id or Kubernetes Job name")
    weight_version: int | None = None


class RolloutHeartbeat(Payload):
    elapsed_ms: int


class RolloutFinished(Payload):
    by: Literal["controller", "agent"] = Field(description="the controller (process exited) or the agent (POST /finish)")
    exit_code: int | None = None
    duration_ms: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    details: dict[str, Any] = Field(default_factory=dict)


class RolloutFailed(Payload):
    exit_code: int | None = None
    duration_ms: int | None = None
    error: str
    stdout_tail: str = ""
    stderr_tail: str = ""
    will_retry: bool = False


class RolloutTimedOut(Payload):
    timeout_s: float
    duration_ms: int
    stdout_tail: str = ""
    stderr_tail: str = ""
    will_retry: bool = False


class RolloutDiff(Payload):
    """What a coding agent changed in its workspace, for a grader to apply in a fresh sandbox.

    Posted by the harness through the gateway (authenticated with the rollout token) when the agent
    ends, before it exits. Grading reads only this (and its task's hidden tests), so history can be
    re-graded with other tests without running an agent again.
    """

    instance_id: str = Field(description="the task (SWE-bench instance) the diff answers")
    base_commit: str = Field(description="the commit the agent's workspace was checked out from")
    diff: str = Field(description="`git diff` of the workspace against base_commit, new files included, binary files left out")
    size: int = Field(description="bytes of the whole diff, before any truncation")
    truncated: bool = Field(False, description="the diff was cut to fit an event; a grader scores it 0")
    outcome: str | None = Field(None, description="how the agent ended: submitted, step_limit, time_limit, "
                                "format_errors, context_overflow, sandbox_timeout, model_error, "
                                "stopped (a SIGTERM: the diff so far)")
    details: dict[str, Any] = Field(default_factory=dict, description="e.g. steps taken, command time, binary files left out")


class RolloutQueuedEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["rollout.queued"] = "rollout.queued"
    data: RolloutQueued


class RolloutStartedEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["rollout.started"] = "rollout.started"
    data: RolloutStarted


class RolloutHeartbeatEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["rollout.heartbeat"] = "rollout.heartbeat"
    data: RolloutHeartbeat


class RolloutFinishedEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["rollout.finished"] = "rollout.finished"
    data: RolloutFinished


class RolloutFailedEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["rollout.failed"] = "rollout.failed"
    data: RolloutFailed


class RolloutTimedOutEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["rollout.timed_out"] = "rollout.timed_out"
    data: RolloutTimedOut


class RolloutDiffEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["rollout.diff"] = "rollout.diff"
    data: RolloutDiff


# --- sessions: production traffic (topics: rollouts, rewards; see schemas.sessions) ----------


class SessionEnded(Payload):
    """A client said its session is over (`POST /sessions/{id}/end`): the calls made so far are one
    conversation. Its envelope's `rollout_id` is the session's (`schemas.sessions.session_rollout_id`)."""

    session_id: str
    sender: str = Field(description="who ended it: the gateway key's identity (`key:<hash>`) or `anonymous`")
    details: dict[str, Any] = Field(default_factory=dict)


class SessionEndedEvent(Event):
    topic: ClassVar[str] = "rollouts"
    type: Literal["session.ended"] = "session.ended"
    data: SessionEnded


class Feedback(Payload):
    """What someone said about a session, or about one call (turn) of it, at any time after it.

    Raw input, never a reward by itself: the streams worker's reward policy (`--reward-policy`) turns a
    session's feedback into `reward` events, so history can be rewarded again under another policy.
    At least one of `score`, `label`, `thumbs` is set (the gateway checks it). Its envelope's
    `rollout_id` is the session's; its `id` derives from (`session_id`, `client_id`) when the sender
    gave an id, so sending the same feedback twice is one feedback (consumers drop repeats by id).
    """

    session_id: str
    call_id: str | None = Field(None, description="the call (turn) it is about; None: the whole session")
    score: float | None = Field(None, description="a number on the sender's scale")
    label: str | None = Field(None, description="a word or a class, e.g. resolved, wrong_tool")
    thumbs: Literal["up", "down"] | None = None
    comment: str | None = None
    sender: str = Field(description="who sent it: the gateway key's identity (`key:<hash>`) or `anonymous`")
    user: str | None = Field(None, description="the end user the sender says it comes from")
    client_id: str | None = Field(None, description="the sender's own id of this feedback (idempotency)")
    details: dict[str, Any] = Field(default_factory=dict)


class FeedbackEvent(Event):
    topic: ClassVar[str] = "rewards"
    type: Literal["feedback"] = "feedback"
    data: Feedback


# --- model calls (topic: calls) --------------------------------------------------------------


class Usage(Payload):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChoiceTokens(Payload):
    """Tokens of a choice beyond the first, for requests with n > 1."""

    index: int
    completion_token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None


class WeightSegment(Payload):
    """Completion tokens from `start` on (to the next segment's start) were sampled by weights `version`."""

    version: int | None
    # no ge=0: an event's native form checks types only (schemas/shapes.py); token_versions reads a bad start as
    # an empty segment
    start: int = Field(description="index of the segment's first completion token")


def token_versions(version: int | None, segments: list[WeightSegment], length: int) -> list[int | None]:
    """The version that sampled each of `length` completion tokens: `version` for all, unless `segments` say."""
    if not segments:
        return [version] * length
    versions: list[int | None] = []
    for segment, following in zip(segments, [*segments[1:], None]):
        end = length if following is None else min(following.start, length)
        versions += [segment.version] * max(0, end - len(versions))
    return versions + [segments[-1].version] * (length - len(versions))


class Call(Payload):
    api: Literal["chat.completions", "completions", "responses", "messages"]
    model: str
    upstream: str | None = Field(None, description="base URL of the server that answered")
    weight_version: int | None = Field(None, description="the weights that produced the completion (with "
                                       "`weight_segments`: its first tokens; the oldest of them)")
    weight_segments: list[WeightSegment] = Field(default_factory=list, description="set when the completion went on "
                                                 "across a weight update (`--partial-rollouts`): each version and its "
                                                 "first token, in order; empty: every token is `weight_version`'s")
    streamed: bool = False
    session_id: str | None = Field(None, description="the session of a call made outside any rollout (its "
                                   "`rollout_id` is then the session's, `schemas.sessions.session_rollout_id`)")
    request: dict[str, Any] = Field(description="the request as the agent sent it, secrets removed")
    response: dict[str, Any] | None = Field(None, description="the response as the agent got it; for streams, assembled")
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = Field(None, description="one per completion token")
    finish_reason: str | None = None
    extra_choices: list[ChoiceTokens] = Field(default_factory=list)
    usage: Usage | None = None
    status: int = Field(description="HTTP status the agent received")
    error: str | None = None
    started_at: int = Field(description="UTC ms when the gateway received the request")
    latency_ms: float
    ttft_ms: float | None = Field(None, description="time to first token, for streams")
    retry_count: int | None = Field(None, description="the agent's SDK's retry number of this request, from its "
                                    "headers (x-stainless-retry-count, …): 0 the first try, 1 or more a retry")
    tenant: str | None = Field(None, description="the tenant (an agent or team, named by its key) whose adapter "
                               "answered and learns from this call; None: the shared policy")


class CallEvent(Event):
    topic: ClassVar[str] = "calls"
    type: Literal["call"] = "call"
    data: Call


# --- rewards (topic: rewards) ----------------------------------------------------------------


REWARD_MAX = 3.4028234663852886e38
"""the largest reward magnitude a trajectory may carry: a float32's largest (the trainer's reward tensors are
float32: beyond it a reward is inf there, and every advantage of its batch NaN)"""


class TurnReward(Payload):
    """A reward for one turn, named by its call id or by its position (0-based) in the attempt."""

    call_id: str | None = None
    turn: int | None = None
    value: float


class Reward(Payload):
    value: float
    turns: list[TurnReward] = Field(default_factory=list)
    details: dict[str, Any] = Field(default_factory=dict)
    reward_fn: str | None = Field(None, description="the function (or session reward policy) that computed it; "
                                  "None when the agent posted it")
    trajectory_id: str | None = Field(None, description="the trajectory it scores, when computed after that was "
                                      "published (feedback later than the session's feedback window)")


class RewardEvent(Event):
    topic: ClassVar[str] = "rewards"
    type: Literal["reward"] = "reward"
    data: Reward


# --- trajectories (topic: trajectories) ------------------------------------------------------


class Turn(Payload):
    call_id: str
    sequence: int = Field(description="index into `sequences` of the sequence this turn belongs to")
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    weight_version: int | None = None
    finish_reason: str | None = None
    latency_ms: float | None = None
    reward: float | None = Field(None, description="per-turn reward, where one was given")
    completion_start: int | None = Field(None, description="index in its sequence's `token_ids` of this turn's first "
                                         "completion token: its span is [start, start + len(completion_token_ids))")
    temperature: float | None = Field(None, description="the sampling temperature its call asked for (None: not "
                                      "given, the server's default); the local servers record the logprobs of the "
                                      "distribution it scales (processed logprobs), and the trainer scales by it too")
    logprobs_missing: bool = Field(False, description="its call recorded no logprobs (or not one per completion "
                                   "token): `logprobs` are 0.0 placeholders, not the sampling policy's")
    weight_segments: list[WeightSegment] = Field(default_factory=list, description="its call's: which version "
                                                 "sampled which completion tokens (empty: all `weight_version`'s)")


class Sequence(Payload):
    """One token sequence for training: a prompt, then model and environment tokens.

    `mask[i]` is 1 where token i was generated by the model and 0 where the prompt or the
    environment (tool results, user turns) put it; `logprobs[i]` and `weight_versions[i]` are
    meaningful where the mask is 1 (0.0 and None elsewhere).
    """

    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    weight_versions: list[int | None]
    prompt_length: int = Field(description="tokens before the first model token")
    turns: list[int] = Field(description="indices into `turns` of the turns merged here")


class RewardRecord(Payload):
    event_id: str
    value: float
    reward_fn: str | None = None
    turns: list[TurnReward] = Field(default_factory=list)


class Trajectory(Payload):
    model: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    split: Literal["train", "validation"] = "train"
    epoch: int = 0
    sample_index: int = 0
    attempt_number: int = 1
    status: Literal["finished", "failed", "timed_out", "abandoned"]
    end_reason: str | None = Field(None, description="why the attempt ended, in a word or a line: a coding "
                                   "agent's outcome (submitted, step_limit, context_overflow, …), a failure's "
                                   "error, a timeout")
    reward: float | None = Field(None, description="final reward: the last one posted or computed")
    reward_missing: bool = False
    rewards: list[RewardRecord] = Field(default_factory=list)
    turns: list[Turn]
    sequences: list[Sequence]
    merged: bool = Field(description="True when all turns merged into one sequence")
    merge_mismatches: int = Field(0, description="turns whose prompt did not extend the previous turn token for token")
    superseded: int = Field(0, description="calls that are not turns because the agent asked the same again and "
                            "went on with the later answer (its SDK retried a request whose answer was lost)")
    weight_version_launch: int | None = None
    started_at: int | None = None
    finished_at: int
    duration_ms: int | None = None
    lineage: list[str] = Field(description="ids of the events this trajectory was built from")
    session_id: str | None = Field(None, description="set for production traffic: the session (not a rollout) "
                                   "these calls were made in; its rewards come from feedback, by the reward policy")
    tenant: str | None = Field(None, description="the tenant whose adapter this trajectory trains; None: the shared "
                               "policy")
    revision_of: str | None = Field(None, description="set on a revision: the id of the conversation's trajectory "
                                    "published first, which this one replaces with the reward of later feedback "
                                    "(the same turns and sequences)")


class TrajectoryEvent(Event):
    topic: ClassVar[str] = "trajectories"
    type: Literal["trajectory"] = "trajectory"
    data: Trajectory


# --- weights and the pool (topics: weights, pool) --------------------------------------------


class Weights(Payload):
    model: str
    version: int
    uri: str = Field(description="checkpoint folder (safetensors) the servers load")
    step: int
    base_version: int | None = Field(None, description="the version this one was trained from")
    metrics: dict[str, float] = Field(default_factory=dict)
    lineage: list[str] = Field(default_factory=list, description="ids of the trajectories trained on")
    tenant: str | None = Field(None, description="set for a tenant's adapter: `uri` is then a LoRA adapter folder, "
                               "served beside the base as `<tenant>@<version>`; None: full weights of the model")


class WeightsEvent(Event):
    topic: ClassVar[str] = "weights"
    type: Literal["weights"] = "weights"
    data: Weights

    @property
    def key(self) -> bytes:
        return self.data.model.encode()


class PoolUpdate(Payload):
    model: str
    version: int
    server: str
    status: Literal["ok", "failed"]
    pause_ms: float = Field(description="time the server was paused (no tokens generated)")
    load_ms: float | None = None
    held_ms: float | None = Field(None, description="time the gateway held new requests for the model")
    error: str | None = None
    applied_by: str = Field(description="the gateway replica that applied the update")
    tenant: str | None = Field(None, description="the tenant whose adapter was loaded (no pause of the base); None: "
                               "the model's full weights")


class PoolUpdateEvent(Event):
    topic: ClassVar[str] = "pool"
    type: Literal["pool.update"] = "pool.update"
    data: PoolUpdate

    @property
    def key(self) -> bytes:
        return self.data.model.encode()


class PoolHeld(Payload):
    model: str
    version: int
    cause: str = Field(description="id of the event that made the replica hold (a `weights` or `releases` event)")
    replica: str = Field(description="the gateway replica that holds")


class PoolHeldEvent(Event):
    """A gateway replica holds `model`'s new requests for an update and its own requests of it drained (the
    streamed ones excepted, with partial rollouts): the applier pauses a server once every live replica said so."""

    topic: ClassVar[str] = "pool"
    type: Literal["pool.held"] = "pool.held"
    data: PoolHeld

    @property
    def key(self) -> bytes:
        return self.data.model.encode()


# --- releases: canaries of new weights (topic: releases; see schemas.releases) -----------------


class ArmNumbers(Payload):
    """What one arm of a canary measured since the canary started."""

    version: int
    sessions: int = Field(0, description="sessions with a reward whose calls this version served")
    mean_reward: float | None = None
    reward_std: float | None = None
    calls: int = 0
    errors: int = Field(0, description="calls answered 5xx")
    p95_latency_ms: float | None = None


class Release(Payload):
    """A step of a model's release: a canary starts, is measured, is promoted or rolled back.

    `canary`: `version` (at `uri`) serves the sessions whose bucket (`schemas.releases.bucket`) is below
    `share_bp` (basis points), on `servers`; the others stay on `stable_version`. `measure`: the
    decision service's numbers so far (no change of routing). `promote`: every server loads `version`,
    which becomes the stable one. `rollback`: the canary's servers load `stable_version` again.
    With `tenant` set, the two versions are the tenant's LoRA adapters side by side on the same servers: a
    promotion makes the canary adapter the tenant's stable one, a rollback unloads it; nothing else moves.
    """

    model: str
    action: Literal["canary", "measure", "promote", "rollback"]
    version: int = Field(description="the canary's version")
    uri: str = Field(description="checkpoint folder of `version`")
    stable_version: int
    stable_uri: str = Field(description="checkpoint folder of `stable_version` (where a rollback reloads from)")
    # no ge/le here: events carry no constraint the scans' native decoder cannot check (schemas/shapes.py);
    # the gateway's --canary-share is bounded where it is set
    share_bp: int = Field(description="sessions on the canary, in basis points of 10,000 (0 to 10,000)")
    servers: list[str] = Field(description="the servers that serve the canary")
    started_at: int = Field(description="UTC ms the canary started (its `canary` event's time)")
    decided_by: str = Field("", description="`rule` (the decision service), or who decided by CLI")
    reason: str = ""
    arms: list[ArmNumbers] = Field(default_factory=list, description="stable first, then canary")
    p_value: float | None = Field(None, description="one-sided: the canary's mean reward is not above the stable's")
    numbers: dict[str, float] = Field(default_factory=dict, description="the rule's settings and statistics")
    tenant: str | None = Field(None, description="set for a tenant's adapter: `version` and `stable_version` are "
                               "its adapters `<tenant>@<version>`, both on `servers`; None: the model's full weights")


class ReleaseEvent(Event):
    topic: ClassVar[str] = "releases"
    type: Literal["release"] = "release"
    data: Release

    @property
    def key(self) -> bytes:
        return self.data.model.encode()


# --- operations (topics: deadletter, metrics) ------------------------------------------------


class Deadletter(Payload):
    topic: str
    partition: int | None = None
    offset: int | None = None
    key: str | None = None
    value: str = Field(description="the original record value, decoded as UTF-8 with replacement")
    reason: str
    consumer: str = Field(description="who gave up on it")


class DeadletterEvent(Event):
    topic: ClassVar[str] = "deadletter"
    type: Literal["deadletter"] = "deadletter"
    data: Deadletter

    @property
    def key(self) -> bytes | None:
        return self.data.key.encode() if self.data.key else None


class Metrics(Payload):
    window_s: int
    window_start: int = Field(description="UTC ms")
    group: dict[str, str] = Field(default_factory=dict, description="e.g. {'weight_version': '3'}")
    values: dict[str, float]


class MetricsEvent(Event):
    topic: ClassVar[str] = "metrics"
    type: Literal["metrics"] = "metrics"
    data: Metrics


class Eval(Payload):
    """Pass rates of one weight version on the validation tasks (`agentstream eval`).

    A sample passes when its grader's reward reaches `threshold`. A sample with no reward (the harness
    crashed, the attempt timed out, no diff was posted) counts as not passed and is counted in
    `unscored` with its reason: never a silent zero.
    """

    model: str | None = None
    weight_version: int = Field(description="the version the evaluation was run at")
    served_versions: list[int] = Field(default_factory=list, description="versions that generated the samples' tokens")
    run_id: str = Field(description="the controller run of the evaluation's rollouts")
    tasks: int
    k: int = Field(description="samples per task")
    samples: int
    pass_at_1: float = Field(description="mean over tasks of passed / samples")
    pass_at_k: float = Field(description="mean over tasks of the unbiased pass@k estimate")
    solved_tasks: int = Field(description="tasks with at least one passing sample")
    threshold: float = 1.0
    unscored: dict[str, int] = Field(default_factory=dict, description="samples without a reward, by reason")
    per_task: dict[str, list[float | None]] = Field(default_factory=dict, description="task id → each sample's reward")
    lineage: list[str] = Field(default_factory=list, description="ids of the trajectories measured")


    @property
    def validation(self) -> bool:
        """a measurement of the version on the validation split: `agentstream eval` names those runs `eval-…`, and
        its probes of the train tasks `probe-…`"""
        return self.run_id.startswith(VALIDATION_RUN)


VALIDATION_RUN = "eval-"


class EvalEvent(Event):
    topic: ClassVar[str] = "metrics"
    type: Literal["eval"] = "eval"
    data: Eval

    @property
    def key(self) -> bytes | None:
        return (self.data.model or "").encode()


EVENT_TYPES: tuple[type[Event], ...] = (
    RolloutQueuedEvent,
    RolloutStartedEvent,
    RolloutHeartbeatEvent,
    RolloutFinishedEvent,
    RolloutFailedEvent,
    RolloutTimedOutEvent,
    RolloutDiffEvent,
    SessionEndedEvent,
    CallEvent,
    RewardEvent,
    FeedbackEvent,
    TrajectoryEvent,
    WeightsEvent,
    PoolUpdateEvent,
    PoolHeldEvent,
    ReleaseEvent,
    DeadletterEvent,
    MetricsEvent,
    EvalEvent,
)

# Union[] of a tuple unpacks it; `|` cannot be applied to a tuple of types
AnyEvent = Annotated[Union[EVENT_TYPES], Field(discriminator="type")]  # type: ignore[valid-type]  # noqa: UP007

TERMINAL_TYPES = frozenset({"rollout.finished", "rollout.failed", "rollout.timed_out"})

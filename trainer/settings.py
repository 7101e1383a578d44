"""The trainer's settings: every field is an environment variable (AGENTSTREAM_…) and a CLI flag."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from agentstream.schemas.kafka import KafkaSettings

# verl's advantage estimators that need nothing but outcome rewards and group indices; the others
# need a critic (gae), reward baselines (remax), per-token policy statistics (optimal_token_baseline)
# or reward components (gdpo), which trajectories do not carry.
OUTCOME_ESTIMATORS = (
    "grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo",
    "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg",
)
# those whose baseline needs no group: REINFORCE++ whitens returns over the whole batch; the others
# compare a sample with its group's peers and give a sample alone its raw reward.
UNGROUPED_ESTIMATORS = ("reinforce_plus_plus",)


class TrainerSettings(KafkaSettings):
    """`python -m agentstream.trainer`: learn from the `trajectories` topic and publish each new weight version."""

    # --- model and checkpoints ---------------------------------------------------------------
    model: str = Field("tiny", description="served model name: the key of the weights events, and the only "
                                           "model whose trajectories are trained on")
    base_model: Path | None = Field(None, description="Hugging Face model folder to start from when the checkpoint "
                                                      "folder holds no checkpoint yet")
    checkpoint_dir: Path = Field(Path("runs/trainer"), description="folder of the versioned checkpoints "
                                                                   "(v000001/, …); the trainer resumes from the newest")
    initial_version: int = Field(0, description="weight version of the base model; tokens stamped with no "
                                                "version (vLLM's 'default') count as this one")
    keep_checkpoints: int = Field(3, description="checkpoints to keep (older ones are deleted); 0 keeps all")
    save_optimizer: bool = Field(True, description="save the AdamW state with each checkpoint, so a restart "
                                                   "continues the same optimization")

    # --- the stream --------------------------------------------------------------------------
    consumer_group: str = Field("agentstream-trainer", description="Kafka consumer group of the live trajectories")
    offline_file: Path | None = Field(None, description="train from a JSONL file of trajectory events (one encoded "
                                                        "event per line, as replay exports them) instead of the "
                                                        "live stream; the trainer stops at its end")
    offline_topic: str | None = Field(None, description="train from this topic (full name) between --offline-from "
                                                        "and --offline-to instead of the live stream, without a "
                                                        "consumer group; the trainer stops at the range's end")
    offline_from: str = Field("", description="start offsets of --offline-topic: 'N' for every partition or "
                                              "'P:N,P:N'; default: the beginning")
    offline_to: str = Field("", description="end offsets (exclusive) of --offline-topic, same form; default: "
                                            "the end of each partition when the trainer starts")

    # --- batches -----------------------------------------------------------------------------
    group_size: int = Field(8, ge=1, description="samples per task group; a group is complete with this many")
    groups_per_batch: int = Field(4, ge=1, description="complete groups that make one batch (one weight version)")
    min_group_size: int = Field(2, ge=1, description="smallest partial group trained after --batch-timeout-s")
    batch_timeout_s: float = Field(30.0, description="a group waiting this long is trained as it is (if it has "
                                                     "--min-group-size samples) in the next batch")
    group_timeout_s: float = Field(300.0, description="a group still below --min-group-size after this long is "
                                                      "dropped (counted as incomplete_dropped)")
    max_staleness: int = Field(4, ge=0, description="samples whose oldest token is more than this many versions "
                                                    "behind the trainer are dropped or down-weighted")
    stale_policy: Literal["drop", "downweight"] = Field("drop", description="what happens to samples staler than "
                                                                            "--max-staleness")
    stale_decay: float = Field(0.5, gt=0, le=1, description="with --stale-policy downweight: the loss weight is "
                                                            "decay ** (staleness - max_staleness)")
    max_seq_len: int = Field(2048, ge=2, description="sequences are cut to this many tokens")

    # --- the algorithm (verl core_algos) -----------------------------------------------------
    loss: Literal["grpo", "sft"] = Field("grpo", description="grpo: the policy gradient below (trainer/grpo.py); "
                                                             "sft: supervised learning on the trajectories whose "
                                                             "reward reaches --sft-min-reward, the others skipped "
                                                             "(rejection-sampling fine-tuning, trainer/sft.py)")
    sft_min_reward: float = Field(1.0, description="with --loss sft: the reward a trajectory needs to be trained on")
    adv_estimator: str = Field("grpo", description=f"verl advantage estimator: {', '.join(OUTCOME_ESTIMATORS)}")
    norm_adv_by_std: bool = Field(True, description="GRPO: divide advantages by the group's std "
                                                    "(off: Dr. GRPO)")
    policy_loss: str = Field("vanilla", description="verl policy loss (vanilla = PPO clip; gspo, cispo, …)")
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = Field("token-mean", description="how per-token losses "
                                                                                       "are aggregated")
    clip_ratio_low: float = Field(0.2, description="PPO clip: lower ratio bound 1 - this")
    clip_ratio_high: float = Field(0.2, description="PPO clip: upper ratio bound 1 + this")
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip PPO bound for negative advantages")
    entropy_coeff: float = Field(0.0, description="entropy bonus coefficient")
    ungrouped_adv_estimator: str = Field(
        "reinforce_plus_plus", description="verl advantage estimator of samples that have no group (sessions: one "
        f"sample per prompt), over all of them in the batch: {', '.join(UNGROUPED_ESTIMATORS)}")
    rollout_is: Literal["off", "token", "sequence"] = Field(
        "off", description="off-policy correction (truncated importance sampling): the trainer's own logprobs "
        "before the update become the old policy, and each token's loss is weighed by min(p_trainer / p_recorded, "
        "--rollout-is-threshold), per token or per sequence (the product over its tokens); off: the recorded "
        "logprobs are the old policy, no weights")
    rollout_is_threshold: float = Field(2.0, gt=1, description="the cap C of the importance weights (TIS)")
    train_without_logprobs: bool = Field(
        False, description="train on trajectories with a turn whose call recorded no logprobs, their 0.0 "
        "placeholders standing for the old policy (the PPO ratio becomes p_θ: REINFORCE scaled by p); off: such "
        "trajectories are dropped (`logprobs_missing`). Never with --rollout-is; --loss sft needs no logprobs")
    turn_rewards: bool = Field(False, description="per-turn credit: a trajectory whose reward names turns trains "
                               "each such turn's tokens with that turn's advantage, and its other turns not at all; "
                               "off: the final reward's advantage on every generated token")
    source_weights: dict[str, float] = Field(
        default_factory=dict, description="loss weight per source of trajectories, as JSON, e.g. "
        "'{\"rollout\": 1, \"session\": 0.5}'; a source not named weighs 1; 0 trains nothing of that source")
    reward_penalties: dict[str, float] = Field(
        default_factory=dict, description="reward shaping, for training only: added to the reward of a trajectory "
        "whose end_reason is the key, as JSON, e.g. '{\"context_overflow\": -1, \"step_limit\": -0.2}'; the log, "
        "eval and pass rates keep the grader's reward")

    # --- on-policy distillation (trainer/distill.py) -----------------------------------------
    distill_weight: float = Field(0.0, ge=0, le=1, description="on-policy distillation: the share of each token's "
                                  "advantage that is the teacher's, -(log p_student - log p_teacher) on the "
                                  "student's own sampled tokens (the per-token reverse KL, negated), the rest the "
                                  "task reward's: 1 distils alone, 0 (default) asks no teacher")
    distill_teacher_url: str = Field("", description="the teacher's vLLM server (e.g. http://127.0.0.1:8001): it "
                                     "scores each sequence's tokens with prompt_logprobs; needed with "
                                     "--distill-weight > 0. The teacher shares the student's tokenizer")
    distill_teacher_model: str = Field("", description="the teacher's served model name; empty: the first model "
                                       "its /v1/models lists")
    distill_teacher_api_key: SecretStr = Field(SecretStr(""), description="bearer token sent to the teacher, if it "
                                               "asks for one (prefer the environment, "
                                               "AGENTSTREAM_DISTILL_TEACHER_API_KEY, to a flag)")
    distill_concurrency: int = Field(4, ge=1, description="sequences scored by the teacher at once")

    # --- optimization ------------------------------------------------------------------------
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate; this default suits a full fine-tune of a "
                                              "pretrained model (the presets give each model its own: the demo's "
                                              "random tiny model 3e-3, LoRA adapters ~1e-4)")
    lr_warmup_steps: int = Field(0, ge=0, description="raise the learning rate linearly from lr/N to lr over the "
                                 "first N optimizer steps (counted by AdamW's saved state: a restart continues "
                                 "them); steadies a fresh optimizer's first, largest steps; 0: no warmup")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, description="AdamW beta1")
    adam_beta2: float = Field(0.999, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon: added to the root of the second moment; larger "
                                                    "(1e-6) steadies bfloat16 updates of rarely seen tokens")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping (global L2 norm)")
    epochs: int = Field(1, ge=1, description="passes over each batch")
    mini_batch_size: int = Field(0, ge=0, description="sequences per optimizer step; 0: the whole batch")
    micro_batch_size: int = Field(0, ge=0, description="sequences per forward/backward (gradient accumulation); "
                                                       "0: the whole mini-batch")
    micro_batch_tokens: int = Field(0, ge=0, description="token budget of a forward/backward: sequences of similar "
                                                         "length are packed into micro-batches of at most this many "
                                                         "(padded) tokens, so long multi-turn trajectories fit in "
                                                         "memory; 0: --micro-batch-size decides")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="compute dtype of forward and backward (weights and optimizer stay float32); auto: "
                            "bfloat16 where the device computes it fast (CUDA with bf16, CPUs with AMX), else float32 "
                            "(on a CPU with AVX512-BF16 alone bfloat16 measured 1.6x slower, bench.trainer_dtype)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass instead of "
                                                            "keeping them: less memory, about a third more time")
    lora_rank: int = Field(0, ge=0, description="train LoRA adapters of this rank (peft) instead of every weight; "
                                                "0: full fine-tuning. Each version is published as full weights, "
                                                "the adapters merged in, so servers reload it like any other")
    lora_alpha: float = Field(0.0, ge=0, description="LoRA scaling alpha; 0: twice the rank")
    tenant_adapters: bool = Field(
        False, description="train one LoRA adapter per tenant (a trajectory's `tenant`) over the frozen base, all in "
        "this process; each version is published as that tenant's PEFT adapter folder (needs --lora-rank; "
        "trajectories of no tenant are left to a trainer without this flag)")
    lora_target_modules: str = Field("all-linear", description="modules that get adapters: 'all-linear' or "
                                                               "comma-separated names (q_proj,v_proj)")
    seed: int = Field(0, description="torch seed")
    device: str = Field("cpu", description="torch device to train on (cpu, cuda, cuda:1, …)")
    torch_threads: int = Field(0, ge=0, description="torch CPU threads; 0: torch's default")

    # --- ranks (sharded update on Ray) -------------------------------------------------------
    ranks: int = Field(1, ge=1, description="train on this many rank processes (Ray actors) that shard the model "
                                            "with FSDP2 (gloo on CPU, NCCL with one GPU each on --device cuda); 1: "
                                            "in this process")
    ray_address: str = Field("", description="with --ranks > 1: the Ray cluster to place the ranks on (e.g. "
                                             "10.0.0.5:6379); empty: start a local Ray with just the CPUs/GPUs the "
                                             "ranks need")
    rank_restarts: int = Field(2, ge=0, description="times one batch is retried on fresh ranks after a rank died "
                                                    "mid-step, before the trainer gives up")
    rank_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how Ray places the ranks on its nodes (a placement group): PACK fills a node first; "
                            "STRICT_SPREAD puts each rank on a node of its own")
    rank_placement_timeout_s: float = Field(600.0, gt=0, description="how long the ranks wait for the Ray cluster "
                                                                     "to have room for all of them (e.g. a lost "
                                                                     "node's replacement) before the step fails")
    ray_object_store_mb: int = Field(512, ge=80, description="object store of a locally started Ray (batches pass "
                                                             "through it; weights do not)")
    fsdp_cpu_offload: bool = Field(False, description="with --ranks > 1: keep the sharded parameters, gradients "
                                                      "and optimizer state in CPU memory between uses (FSDP2 "
                                                      "CPUOffloadPolicy): larger models per GPU, slower steps")
    cuda_alloc_conf: str = Field("expandable_segments:True", description="PYTORCH_CUDA_ALLOC_CONF of the GPU ranks "
                                                                         "(less fragmentation with varying lengths)")

    # --- running -----------------------------------------------------------------------------
    max_versions: int = Field(0, ge=0, description="stop after publishing this many versions; 0: run until "
                                                   "SIGTERM (live) or the end of the offline range")
    hold_for_eval: bool = Field(False, description="train no version past one `agentstream eval --follow` has not "
                                                   "measured yet (its eval event on the metrics topic): each version "
                                                   "is measured while it alone serves. Samples keep being read while "
                                                   "held; the eval must run, or the trainer waits for ever")
    dedupe_window: int = Field(100_000, ge=0, description="trajectory ids remembered (across restarts) to drop "
                                                          "late re-deliveries")
    memory_check: bool = Field(True, description="estimate the peak memory before loading the model (trainer/"
                                                 "memory.py) and fit it in what is available: a smaller "
                                                 "--micro-batch-size, then --gradient-checkpointing, where not "
                                                 "given; else refuse to start (exit 2) with the estimate and the "
                                                 "flags that fix it. On a CPU, in one process")
    memory_limit_gib: float = Field(0.0, ge=0, description="memory the trainer may use, GiB; 0: what is available "
                                                           "(the cgroup's limit, else MemAvailable)")
    log_level: Literal["debug", "info", "warning"] = Field("info", description="debug also logs every record "
                                                                              "not trained on, with the reason")

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, name: str) -> str:
        if name not in OUTCOME_ESTIMATORS:
            raise ValueError(f"unknown or unsupported advantage estimator {name!r}; "
                             f"choose one of {', '.join(OUTCOME_ESTIMATORS)}")
        return name

    @field_validator("ungrouped_adv_estimator")
    @classmethod
    def _ungrouped_estimator(cls, name: str) -> str:
        if name not in UNGROUPED_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} needs groups; for samples without a group choose one "
                             f"of {', '.join(UNGROUPED_ESTIMATORS)}")
        return name

    @field_validator("source_weights")
    @classmethod
    def _source_weights(cls, weights: dict[str, float]) -> dict[str, float]:
        bad = {source: value for source, value in weights.items() if not (math.isfinite(value) and value >= 0)}
        if bad:
            raise ValueError(f"source weights must be finite numbers ≥ 0, got {bad}")
        return weights

    @field_validator("reward_penalties")
    @classmethod
    def _finite_penalties(cls, penalties: dict[str, float]) -> dict[str, float]:
        bad = {reason: value for reason, value in penalties.items() if not math.isfinite(value)}
        if bad:
            raise ValueError(f"reward penalties must be finite numbers, got {bad}")
        return penalties

    @model_validator(mode="after")
    def _one_offline_source(self) -> TrainerSettings:
        if self.offline_file and self.offline_topic:
            raise ValueError("give --offline-file or --offline-topic, not both")
        if self.min_group_size > self.group_size:
            raise ValueError(f"--min-group-size ({self.min_group_size}) exceeds --group-size ({self.group_size})")
        if self.ranks > 1 and self.rollout_is != "off":
            raise ValueError("--rollout-is needs the trainer's logprobs before the update, which sharded ranks do "
                             "not compute yet: give --ranks 1 or --rollout-is off")
        if self.train_without_logprobs and self.rollout_is != "off":
            raise ValueError("--train-without-logprobs and --rollout-is: the importance weights need the recorded "
                             "logprobs; give one of them")
        if self.ranks > 1 and self.loss == "sft":
            raise ValueError("--loss sft trains in one process only: give --ranks 1")
        if self.tenant_adapters and (not self.lora_rank or self.ranks > 1 or self.loss == "sft"):
            raise ValueError("--tenant-adapters trains LoRA adapters with GRPO in one process: give --lora-rank "
                             "(e.g. 8), --ranks 1 and the default --loss")
        if self.tenant_adapters and self.distill_weight:
            raise ValueError("--tenant-adapters does not distill yet: give --distill-weight 0")
        if self.distill_weight and not self.distill_teacher_url:
            raise ValueError("--distill-weight needs the teacher that scores the tokens: give --distill-teacher-url")
        if self.distill_weight and (self.ranks > 1 or self.loss == "sft"):
            raise ValueError("--distill-weight trains with --loss grpo in one process: give --ranks 1")
        if self.ranks > 1 and self.lora_rank:
            raise ValueError("--lora-rank trains in one process only: give --ranks 1 (LoRA on sharded ranks is "
                             "not built yet)")
        return self

    @property
    def offline(self) -> bool:
        return bool(self.offline_file or self.offline_topic)

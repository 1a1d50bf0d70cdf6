"""Typed trainer configuration (importable without torch).

One model per concern; unknown keys are an error. Cross-field rules are checked when the
config is built and name every key involved, e.g. ``mismatch.low`` above ``mismatch.high``
or GRPO std normalisation with a group of one (:meth:`TrainerConfig.check_group_size`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from miles_engine.components import Section
from miles_engine.errors import ConfigError, format_validation_error
from miles_engine.precision.config import StageFormat
from miles_engine.trainer.lora import LoraOptions
from miles_engine.trainer.megatron.config import MegatronConfig

def getattr_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


Estimator = Literal["grpo", "gspo", "ppo", "reinforce_pp"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


class AlgorithmConfig(Section):
    advantage_estimator: Estimator = "grpo"
    grpo_std_normalization: bool = Field(True, description="divide group-centred rewards by the group std "
                                         "(unbiased) + std_eps; grpo and gspo")
    std_eps: float = Field(1e-6, gt=0)
    normalize_advantages: bool = Field(False, description="whiten advantages over every sampled token of "
                                       "the step (all ranks); reinforce_pp always does")
    reinforce_pp_baseline: bool = Field(False, description="reinforce_pp: subtract the group mean reward first")
    gamma: float = Field(1.0, ge=0, le=1, description="discount over sampled tokens (ppo, reinforce_pp)")
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute", description="recompute: the trainer's own log-probs before the update (needed by "
        "mismatch correction); rollout: trust the engine's (saves one forward pass)")
    fuse_old_logprobs: bool = Field(
        True, description="recompute with one optimizer step per batch (ppo_epochs=1, minibatches=1): take "
        "the old log-probs from the update's own forward (detached; the weights have not moved yet) instead of "
        "a separate no-grad pass. Used only when nothing before the update needs them (not with ppo, "
        "kl.placement=reward, opd.beta or opd candidates); false: always the separate pass")
    temperature: float = Field(1.0, gt=0, description="logits are divided by this (match the sampler)")
    routing_replay: bool = Field(False, description="R3: MoE routers use the experts recorded at rollout "
                                 "(trajectory.routed_experts) on the sampled tokens")


class ClipConfig(Section):
    eps_low: float = Field(0.2, ge=0, description="ratio lower bound 1 - eps_low")
    eps_high: float | None = Field(None, ge=0, description="ratio upper bound 1 + eps_high (default: eps_low)")
    dual_clip_c: float | None = Field(None, gt=1, description="dual clip: loss capped at -c*A for A < 0")

    @property
    def high(self) -> float:
        return self.eps_low if self.eps_high is None else self.eps_high


class MismatchConfig(Section):
    """Train-rollout mismatch correction per token: weight w = exp(logp_trainer_old - logp_rollout)."""

    mode: Literal["none", "tis", "clip_or_pop"] = Field(
        "none", description="tis: clamp w to [low, high]; clip_or_pop: w outside [low, high] becomes 0")
    low: float = Field(0.0, ge=0)
    high: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> MismatchConfig:
        if self.low > self.high:
            raise ValueError(f"mismatch.low ({self.low}) is above mismatch.high ({self.high}); "
                             f"the band is [low, high]")
        return self


class KLConfig(Section):
    coef: float = Field(0.0, ge=0)
    estimator: Literal["k1", "k2", "k3"] = "k3"
    reference: bool = Field(False, description="keep a frozen reference model: a copy of the policy as RL starts "
                            "(after the run's SFT warm start, if any)")
    reference_source: str | None = Field(None, description="build the reference from this model source instead")
    placement: Literal["loss", "reward"] = Field(
        "loss", description="loss: coef * KL added to the loss; reward: -coef * KL per token in the reward "
        "(reinforce_pp, ppo)")


class OPDConfig(Section):
    """On-policy distillation: the teacher's log-probs as an advantage term (``beta``) and/or a
    reverse-KL loss term (``coef``; math in :mod:`miles_engine.trainer.opd_loss`)."""

    beta: float = Field(0.0, ge=0, description="A <- A - beta * (logp_student_old - logp_teacher) per token")
    coef: float = Field(0.0, ge=0, description="weight of the per-token reverse-KL loss term")
    candidates: Literal["sampled", "student_topk", "teacher_topk", "intersection", "union"] = Field(
        "sampled", description="sampled: the sampled token only; else the reverse KL renormalised on a top-K set")
    top_k: int = Field(8, ge=1, description="K of the student / teacher top-K candidate sets")
    weighting: Literal["student", "teacher", "uniform"] = Field(
        "student", description="weights of the per-candidate terms (student: the exact reverse-KL gradient)")
    task_reward: bool = Field(True, description="false: the task reward's advantage is zero, so the OPD "
                              "terms are the only training signal")

    @model_validator(mode="after")
    def _signal(self) -> OPDConfig:
        if self.candidates == "sampled" and self.weighting != "student":
            raise ValueError(f"opd.weighting={self.weighting!r} needs a candidate set: set opd.candidates to "
                             f"student_topk, teacher_topk, intersection or union")
        if not self.task_reward and not (self.beta or self.coef):
            raise ValueError("opd.task_reward=false with opd.beta=0 and opd.coef=0 leaves no training signal")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.beta or self.coef)

    @property
    def uses_candidates(self) -> bool:
        return bool(self.coef) and self.candidates != "sampled"


class OptimizerConfig(Section):
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    eps: float = Field(1e-8, gt=0)


class ScheduleConfig(Section):
    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, ge=1, description="optimizer steps the decay spans (linear, cosine)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _steps(self) -> ScheduleConfig:
        if self.kind != "constant" and self.total_steps is None:
            raise ValueError(f"lr_schedule.kind={self.kind!r} needs lr_schedule.total_steps")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(f"lr_schedule.warmup_steps ({self.warmup_steps}) exceeds "
                             f"lr_schedule.total_steps ({self.total_steps})")
        return self


class ValueConfig(Section):
    """The critic (ppo only): a linear head on the policy trunk, or a separate small model."""

    kind: Literal["head", "separate"] = "head"
    critic_source: str | dict[str, Any] | None = Field(
        None, description="separate critic's model source (dir, config dict, tiny: spec); default: policy's config")
    coef: float = Field(0.5, ge=0)
    clip: float | None = Field(0.2, gt=0, description="value clipping around the old values (None: off)")
    gae_lambda: float = Field(0.95, ge=0, le=1)
    lr: float | None = Field(None, gt=0, description="critic learning rate (default: optimizer.lr)")


class SFTConfig(Section):
    """Supervised warm start: cross-entropy on loss_mask tokens. With ``optimizer`` or
    ``lr_schedule`` set, SFT gets its own AdamW and schedule (unset parts copy the RL ones);
    otherwise SFT steps use, and advance, the RL optimizer and schedule."""

    aggregation: Aggregation = "token_mean"
    optimizer: OptimizerConfig | None = None
    lr_schedule: ScheduleConfig | None = None
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads for SFT steps (nothing else runs during the warm "
                                "start, so every core can serve them); None: as trainer.num_threads")


class ParallelConfig(Section):
    world_size: int = Field(1, ge=1, description="1: one process; N > 1: N FSDP2 ranks behind a proxy")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu (gloo) or cuda (NCCL; rank r on GPU r)")
    start_timeout_s: float = Field(600.0, gt=0, description="how long ranks may take to build the model")
    step_timeout_s: float | None = Field(None, gt=0, description="fail a step whose ranks take longer")


class TrainerConfig(Section):
    backend: Literal["torch", "megatron"] = Field(
        "torch", description="torch: Hugging Face model, one process or FSDP2 ranks; megatron: megatron-core "
        "GPTModel ranks with tensor / pipeline / expert parallelism (trainer.megatron; extra 'megatron')")
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    clip: ClipConfig = Field(default_factory=ClipConfig)
    loss_aggregation: Aggregation = "token_mean"
    mask_truncated: bool = Field(
        False, description="overlong filtering (DAPO; TRL's mask_truncated_completions): a trajectory with a "
        "generation that stopped at max_tokens gets no loss (its reward still counts in its group's baseline), so "
        "rewarded runaway completions do not teach the policy to stop stopping")
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: float = 0.0
    opd: OPDConfig = Field(default_factory=OPDConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm (None: no clipping)")
    max_tokens_per_micro_batch: int = Field(8192, ge=1, description="padded tokens per forward/backward")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="compute dtype (autocast); "
                                                  "master weights stay float32")
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch")
    minibatches: int = Field(1, ge=1, description="optimizer steps per epoch (the batch split by group)")
    value: ValueConfig = Field(default_factory=ValueConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    lora: LoraOptions = Field(default_factory=LoraOptions, description="LoRA adapters instead of full fine-tuning")
    num_threads: int | None = Field(1, ge=1, description="torch intra-op threads; None leaves torch's default")
    gradient_checkpointing: bool = False
    shared_prefix: bool = Field(
        True, description="rows of a micro-batch that share their prompt run it once (KV cache expanded to "
        "the rows, suffixes run against it; same loss and gradients). Off for a PPO value head, routing replay, "
        "gradient checkpointing and models without a plain Hugging Face DynamicCache; one process uses it "
        "only where a prompt of >= 16 tokens is shared by >= 2 rows")
    seed: int = Field(0, description="seeds random init when the model is built from a config")
    true_on_policy: bool = Field(
        False, description="batch-invariant arithmetic (miles_engine.batch_invariant) in the policy's forward, "
        "the same as the rollout engine's with its true_on_policy (a recipe turns the engine's on from this "
        "key): before the first update the trainer's log-prob of every token generated under its current "
        "weights equals the engine's exactly (tis/numerics_max_abs_diff = 0). Float32 only; slower")

    offload: Literal["none", "host", "disk"] = Field(
        "none", description="between steps (from the weight push to the next call) the trainer's weights, "
        "gradients and optimizer state leave memory for colocated engines: host (from a GPU to host memory) or "
        "disk (a file in offload_dir, CRC-32-checked on the way back; on a CPU box this frees RAM); bit-identical "
        "training to none. The torch backend (one process or FSDP2 ranks)")
    offload_dir: str | None = Field(None, description="trainer.offload=disk: the directory of the offload file "
                                    "(local disk; default: $TMPDIR)")
    optimizer_state: Literal["memory", "disk"] = Field(
        "memory", description="where Adam's moments live: memory, or disk -- a file in optimizer_state_dir, read "
        "and written bucket by bucket during each update only (one bucket in memory at a time, CRC-32-checked); "
        "bit-identical training, the same checkpoints. Both backends (each rank streams its own shards)")
    optimizer_state_dir: str | None = Field(None, description="trainer.optimizer_state=disk: the directory of the "
                                            "state files (local disk; a run's default: RUN_DIR/optimizer_state)")
    optimizer_bucket_mb: float = Field(64.0, gt=0, description="trainer.optimizer_state=disk: the optimizer state "
                                       "one bucket of the update reads, steps and writes back at a time")

    weight_format: StageFormat = Field(
        "full", description="quantisation-aware training: every nn.Linear weight but the output head computes "
        "with its values in this format, gradients straight through to the full-precision weight (a recipe "
        "derives it from precision.train)")
    weight_exceptions: list[str] = Field(default_factory=list, description="weight names (fnmatch) kept in high "
                                         "precision (a recipe derives it from precision.exceptions)")

    @model_validator(mode="after")
    def _quantisation_aware(self) -> TrainerConfig:
        if self.weight_format == "full":
            return self
        for key, ok, why in (("lora.enabled", not self.lora.enabled, "the engine would quantise the merged W + BA, "
                              "the trainer W alone"),
                             ("true_on_policy", not self.true_on_policy, "batch-invariant kernels replace the "
                              "linear layers the fake quantisation wraps")):
            if not ok:
                raise ValueError(f"weight_format={self.weight_format!r} (precision.train) does not work with "
                                 f"trainer.{key}={getattr_path(self, key)!r}: {why}")
        return self

    @model_validator(mode="after")
    def _cross(self) -> TrainerConfig:
        a, kl = self.algorithm, self.kl
        if kl.coef > 0 and not kl.reference:
            raise ValueError(f"kl.coef={kl.coef} needs kl.reference=true (the KL is taken to a reference model)")
        if kl.placement == "reward" and a.advantage_estimator not in ("ppo", "reinforce_pp"):
            raise ValueError(f"kl.placement='reward' works with algorithm.advantage_estimator ppo or "
                             f"reinforce_pp, not {a.advantage_estimator!r}; use kl.placement='loss'")
        if self.true_on_policy and self.dtype != "float32":
            raise ValueError(f"true_on_policy=true needs dtype='float32' (got {self.dtype!r}): the engine runs "
                             f"float32 weights and autocast would round differently")
        if self.true_on_policy and self.backend != "torch":
            raise ValueError(f"true_on_policy=true needs backend='torch' (got {self.backend!r}): the engine runs "
                             f"the Hugging Face model, whose batch-invariant forward only the torch backend shares")
        if self.offload != "none" and self.backend != "torch":
            raise ValueError(f"offload={self.offload!r} needs backend='torch' (got {self.backend!r}): the Megatron "
                             f"trainer's offload is not built yet; use trainer.offload=none")
        if self.lora.enabled and self.backend == "megatron":
            raise ValueError("lora.enabled=true needs backend='torch' (got 'megatron'): the Megatron trainer trains "
                             "the full model and has no adapters (miles export --merged would merge none); use "
                             "trainer.backend=torch, or drop trainer.lora")
        if self.true_on_policy and self.lora.enabled:
            raise ValueError("true_on_policy=true does not work with lora.enabled=true: the engine runs the merged "
                             "weights W + BA, the trainer W and BA apart, and they round differently")
        if self.mismatch.mode != "none" and a.old_logprobs == "rollout":
            raise ValueError(f"mismatch.mode={self.mismatch.mode!r} compares the trainer's log-probs with the "
                             f"rollout's: it needs algorithm.old_logprobs='recompute', not 'rollout'")
        return self

    @property
    def fuses_old_logprobs(self) -> bool:
        """Whether the update's forward supplies the old log-probs (``algorithm.fuse_old_logprobs``):
        one optimizer step per batch and nothing in the preparation reads them."""
        a = self.algorithm
        return (a.fuse_old_logprobs and a.old_logprobs == "recompute" and self.ppo_epochs == 1
                and self.minibatches == 1 and a.advantage_estimator != "ppo"
                and not (self.kl.reference and self.kl.placement == "reward")
                and not self.opd.beta and not self.opd.uses_candidates)

    @property
    def needs_reference(self) -> bool:
        return self.kl.reference

    @property
    def uses_std_normalization(self) -> bool:
        return self.algorithm.advantage_estimator in ("grpo", "gspo") and self.algorithm.grpo_std_normalization

    def check_group_size(self, group_size: int, key: str = "group_size") -> None:
        """Refuse a group size that makes GRPO std normalisation undefined (n = 1)."""
        if group_size < 2 and self.uses_std_normalization:
            raise ConfigError(
                f"{key}={group_size} with trainer.algorithm.grpo_std_normalization=true: the std of a "
                f"group of one is undefined; raise {key} to >= 2 or set "
                f"trainer.algorithm.grpo_std_normalization=false")

    @classmethod
    def load(cls, data: dict[str, Any] | TrainerConfig | None, *, prefix: str = "trainer") -> TrainerConfig:
        """Validate ``data``; a :class:`ConfigError` names every bad key (``prefix.key``)."""
        if isinstance(data, TrainerConfig):
            return data
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, prefix=prefix, model=cls)) from exc

"""Metric key names shared by the driver, buffer, trainer, progress bar and ``miles report``.

Convention: ``<namespace>/<name>``; nested dicts passed to :meth:`MetricsLogger.log` are
flattened with ``/``. Names that components already emit (``AsyncBuffer.metrics``,
``trainer.corrections.finalize_stats``) are canonical here; :data:`ALIASES` lists other
spellings the report also accepts. Times are seconds; rates are fractions in [0, 1].

Row kinds (``kind=`` of ``log``): ``train`` (one RL step), ``sft`` (one warm-start step),
``eval`` (one evaluation). Each kind has its own step counter.
"""

from __future__ import annotations

# --- reward (train rows) ---------------------------------------------------------------
REWARD_MEAN = "reward/mean"              # mean reward of the step's samples
REWARD_STD = "reward/std"
REWARD_MIN = "reward/min"
REWARD_MAX = "reward/max"
REWARD_PREFIX = "reward/"                # reward/<drill kind>: mean reward per task kind
REWARD_STATS = frozenset({"mean", "std", "min", "max"})  # reward/<x> that are not task kinds

# --- rollout ------------------------------------------------------------------------------
TOOL_USE_RATE = "rollout/tool_use_rate"  # fraction of the step's episodes that called a tool
NUM_SAMPLES = "rollout/num_samples"      # trajectories trained on this step
RESPONSE_LEN = "rollout/response_len"    # mean sampled tokens per trajectory
SAMPLES_PER_S = "perf/samples_per_s"     # optional; the progress bar computes it otherwise

# --- buffer / staleness (AsyncBuffer.metrics) ---------------------------------------------
QUEUE_SIZE = "buffer/queue_size"
STALENESS_AVG = "buffer/taken/s_old_avg"  # current version - oldest token version, groups taken
STALENESS_MAX = "buffer/taken/s_old_max"
STALENESS_TOKEN_AVG = "buffer/taken/token_weighted_avg"
VERSION_COVERAGE = "buffer/version_coverage"

# --- train-rollout mismatch correction (trainer.corrections.finalize_stats) ---------------
TIS_RATIO_MEAN = "tis/ratio_mean"        # pre-clip ratio pi_train / pi_rollout
TIS_RATIO_MIN = "tis/ratio_min"
TIS_RATIO_MAX = "tis/ratio_max"
TIS_CLIPPED_FRAC = "tis/clipfrac"        # fraction of tokens clamped (tis) or zeroed (clip-or-pop)
TIS_ABS_RATIO_MINUS_1 = "tis/abs_ratio_minus_one"
TIS_LOGPROB_DIFF = "tis/logprob_abs_diff"  # mean |logp_train - logp_rollout|
TIS_KL_K3 = "tis/kl_k3"

# --- the precision contract (a quantised run; run/training.py) --------------------------------
PRECISION_GAP_MEAN = "precision/logprob_gap_mean"  # mean |logp_trainer - logp_engine|, tokens of the current weights
PRECISION_GAP_MAX = "precision/logprob_gap_max"
PRECISION_RATIO_SPREAD = "precision/ratio_spread"  # tis/ratio_max - tis/ratio_min

# --- on-policy distillation (trainer.opd; logged without the train/ prefix) -----------------
OPD_REVERSE_KL = "opd/reverse_kl"        # per-token reverse KL to the teacher (trainer.opd_loss)
OPD_SAMPLED_LOG_RATIO = "opd/sampled_log_ratio"  # mean log p_student - log p_teacher, sampled tokens
TEACHER_SFT_LOSS = "teacher_sft/loss"    # teacher rows: the start-up teacher's SFT

# --- optimisation ---------------------------------------------------------------------------
TRAIN_LOSS = "train/loss"
GRAD_NORM = "train/grad_norm"
ENTROPY = "train/entropy"
KL_REF = "train/kl_ref"
LR = "train/lr"
SFT_LOSS = "sft/loss"                    # sft rows

# --- step-time split (seconds; with overlap the parts may sum to more than time/step) -------
TIME_GENERATION = "time/generation"      # waiting for / producing the step's groups
TIME_REWARD = "time/reward"              # verifiers and reward plugins
TIME_TRAIN = "time/train"
TIME_PUSH = "time/push"                  # weight transport, engines paused included
TIME_STEP = "time/step"                  # wall time of the whole step
TIME_RECORD = "time/record_trajectories"  # writing RUN_DIR/trajectories.mtr (metrics.trajectories)
TIME_TRAIN_DRAFT = "time/train_draft"    # the co-trained speculative draft's step (speculative.train)
TIME_SPLIT = (TIME_GENERATION, TIME_REWARD, TIME_TRAIN, TIME_TRAIN_DRAFT, TIME_PUSH, TIME_RECORD)
TRAJECTORY_RECORDS = "metrics/trajectory_records"  # records written this step (trained + dropped)
TRAJECTORY_BYTES = "metrics/trajectory_bytes"

# --- weights --------------------------------------------------------------------------------
WEIGHT_VERSION = "weights/version"
PUSH_BYTES = "weights/bytes_pushed"
PUSH_PAUSE = "weights/pause_s"

# --- eval rows ------------------------------------------------------------------------------
EVAL_REWARD = "eval/reward"
EVAL_PASS_PREFIX = "eval/pass@"        # eval/pass@<k>; each eval/<x> has _se, _ci_low, _ci_high
EVAL_LAG = "eval/lag_steps"           # training steps finished between the weights and their score
EVAL_WEIGHT_VERSION = "eval/weight_version"

# Other spellings accepted by the report (canonical -> aliases).
ALIASES: dict[str, tuple[str, ...]] = {
    STALENESS_AVG: ("staleness/avg",),
    STALENESS_MAX: ("staleness/max",),
    TIS_CLIPPED_FRAC: ("tis/clipped_frac",),
    TIS_ABS_RATIO_MINUS_1: ("tis/abs_ratio_minus_1",),
    TIS_LOGPROB_DIFF: ("tis/logprob_diff",),
}

# Reserved row fields written by the JSONL sink; metrics may not use them.
RESERVED = frozenset({"step", "time", "kind"})


def spellings(key: str) -> tuple[str, ...]:
    """``key`` followed by its aliases."""
    return (key, *ALIASES.get(key, ()))


def reward_kinds(keys: set[str] | frozenset[str]) -> list[str]:
    """Task kinds that have a ``reward/<kind>`` key among ``keys`` (sorted)."""
    out = []
    for k in keys:
        if k.startswith(REWARD_PREFIX):
            rest = k[len(REWARD_PREFIX):]
            if rest and "/" not in rest and rest not in REWARD_STATS:
                out.append(rest)
    return sorted(out)

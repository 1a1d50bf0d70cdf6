"""The ``eval`` recipe section: what ``miles eval`` runs, and evaluation during ``miles train``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from miles_engine.components import Section
from miles_engine.engines.fleet.config import EngineGroupConfig


class EvalEnvironment(Section):
    """An environment of its own for evaluation (default: a split of the training environment)."""

    name: str = Field(description="registered environment name or dotted import path")
    options: dict[str, Any] = Field(default_factory=dict, description="that environment's own options")


class SplitConfig(Section):
    """How the training environment's tasks are split into train and held-out eval tasks."""

    by: Literal["auto", "none", "hash", "source"] = Field(
        "auto", description="hash: a stable hash of the task id with `salt`, a share `fraction` held out; source: "
        "the environment's own split (its task_split(id)); none: no split (eval on any task); auto: hash when "
        "eval.every is set (evaluation during training), else none")
    fraction: float = Field(0.1, gt=0, lt=1, description="share of task ids held out for evaluation (by: hash)")
    salt: str = Field("miles-eval", min_length=1, description="hash salt: another salt, another split (by: hash)")


class SamplingConfig(Section):
    """Sampling of the evaluated policy; None keeps the recipe agent's own setting."""

    temperature: float | None = Field(None, ge=0, description="sampling temperature of eval episodes")
    max_tokens: int | None = Field(None, ge=1, description="most tokens per generation")
    top_p: float | None = Field(None, gt=0, le=1)


class ExternalConfig(Section):
    """``mode: external``: a command run on each checkpoint directory."""

    command: list[str] = Field(min_length=1, description="argv; {checkpoint}, {step}, {run_dir} and {output} are "
                               "replaced. It writes its JSON result to {output} (else prints it as its last "
                               "stdout line): {\"tasks\": [{\"task_id\", \"reward\", \"passed\"?, \"error\"?}, ...]} "
                               "and/or {\"metrics\": {name: number}}")
    timeout_s: float = Field(1800.0, gt=0, description="the command is killed (with its process group) after this")


class EvalConfig(Section):
    """How ``miles eval`` runs a recipe's agent over tasks, and how ``miles train`` evaluates."""

    jobs: int = Field(4, ge=1, le=1024, description="episodes run concurrently")
    attempts: int = Field(1, ge=1, description="attempts per task")
    limit: int | None = Field(None, ge=1, description="evaluate only the first N tasks of the eval task set")
    tasks: list[str] | None = Field(None, description="evaluate only these task ids")
    every: int | None = Field(None, ge=1, description="during training: evaluate every N steps (None: never)")
    at_start: bool = Field(True, description="during training: also evaluate the starting weights (step 0)")
    mode: Literal["shared", "dedicated", "external"] = Field(
        "shared", description="shared: the training engines evaluate between steps (new training rollouts "
        "pause, the running ones finish or are retracted: in_flight); dedicated: a separate engine group "
        "(eval.engine, any kind) gets a weight snapshot of the step and evaluates while training goes on; external: `external.command` runs on each checkpoint directory")
    in_flight: Literal["auto", "finish", "retract"] = Field(
        "auto", description="shared mode: the training episodes running when an eval starts. finish: they run on "
        "beside the eval; retract: they are cancelled and their groups generated again (same ids, newer weights) "
        "once the eval is done; auto: retract under rollout.mode fully_async (its in-flight groups would hold the "
        "engines and go stale), finish under sync / one_step_off (they are the next step's batch)")
    engine: EngineGroupConfig | None = Field(
        None, description="dedicated mode (and `miles eval --checkpoint`): the engine group that evaluates, with "
        "the options of an `engines` entry (kind embedded, server, sglang, external or a plugin's; replicas, "
        "device, dtype, options). In-process kinds get snapshots by colocated transport, others by broadcast. "
        "Default: one embedded engine with the first training group's device and dtype")
    environment: EvalEnvironment | None = Field(None, description="evaluate on this environment instead of "
                                                "the training environment's eval split")
    split: SplitConfig = Field(default_factory=SplitConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    timeout_s: float | None = Field(None, gt=0, description="deadline of one eval episode (an expired one is "
                                    "an error, not a zero)")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="k values of pass@k (attempts is added); "
                              "each k <= attempts")
    success_threshold: float = Field(1.0, description="an attempt passes when its reward >= this")
    queue_size: int = Field(1, ge=1, le=64, description="dedicated/external: snapshots waiting to be evaluated")
    overflow: Literal["backpressure", "skip"] = Field(
        "backpressure", description="dedicated/external, queue full: backpressure waits (training blocks), skip "
        "drops that step's evaluation (counted in eval/skipped)")
    external: ExternalConfig | None = None
    bootstrap_resamples: int = Field(2000, ge=100, le=100_000, description="resamples of the 95% intervals")
    seed: int = Field(0, description="seed of the bootstrap resampling")

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        too_big = [k for k in self.pass_k if not 1 <= k <= self.attempts]
        if too_big:
            raise ValueError(f"pass_k values {too_big} must be within 1..attempts ({self.attempts}): pass@k needs at "
                             f"least k attempts per task")
        if self.mode == "external" and self.external is None:
            raise ValueError("mode 'external' needs external.command (the command run on each checkpoint)")
        return self

    @property
    def ks(self) -> list[int]:
        return sorted({*self.pass_k, self.attempts})

    @property
    def split_method(self) -> Literal["none", "hash", "source"]:
        if self.split.by == "auto":
            return "hash" if self.every is not None else "none"
        return self.split.by

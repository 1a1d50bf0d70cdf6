"""Typed sections of a training recipe (one model per component).

The components' own option models live with them (``TrainerConfig``, ``BufferOptions``,
``MetricsConfig``, ``TokenizerConfig``, ``TinyModelConfig``); the sections here are the ones
the driver owns: placement, engine, SFT warm start, rollout, weights and the run itself.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from miles_engine.components import Section
from miles_engine.cluster.config import RayOptions
from miles_engine.tito.service import SessionServerConfig
from miles_engine.train.sft_data import SFTDatasetConfig
from miles_engine.weights.check.options import CheckOptions, CheckTolerance
from miles_engine.weights.disk_delta.options import DiskDeltaOptions


class PlacementConfig(Section):
    """Where the trainer runs relative to the engines (how many ranks: ``trainer.parallel.world_size``)."""

    trainer: Literal["in_process", "subprocess"] = Field(
        "subprocess", description="in_process: colocated with the engine (one process; only sync / one_step_off); "
        "subprocess: its own process(es) (trainer.parallel.world_size FSDP2 ranks), so generation and training "
        "overlap")
    backend: Literal["local", "ray"] = Field(
        "local", description="local: engines and trainer ranks as processes of this machine; ray: as Ray actors "
        "on the cluster placement.ray names (docs/ray.md)")
    ray: RayOptions = Field(default_factory=RayOptions)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "trainer_ranks" in data:
            raise ValueError("placement.trainer_ranks was replaced by trainer.parallel.world_size (one key for the "
                             "number of trainer ranks)")
        return data

    @property
    def colocated(self) -> bool:
        return self.trainer == "in_process"


class SFTRunConfig(Section):
    """Supervised warm start on the environment's (noisy) demonstrations, before RL."""

    enabled: bool = True
    demos: int = Field(6000, ge=1, description="fresh demonstrations generated for the warm start")
    batch_size: int = Field(32, ge=1)
    epochs: float = Field(1.0, gt=0)
    wrong_fraction: float | None = Field(None, ge=0, le=1, description="default: the environment's own setting")
    max_minutes: float | None = Field(None, gt=0, description="stop the warm start early after this long")
    dataset: SFTDatasetConfig | None = Field(None, description="train on these chat transcripts instead of the "
                                             "environment's demonstrations (demos, wrong_fraction unused)")


class RunSessionServerConfig(SessionServerConfig):
    """The run's session server: the manager's options plus where it listens, so a harness in another
    process or sandbox can drive the run's sessions (its URL is written to RUN_DIR/session_server.url)."""

    host: str = Field("127.0.0.1", description="address the run's session server binds (loopback by default; a "
                      "harness in a container needs an address it can reach)")
    port: int = Field(0, ge=0, le=65535, description="its port (0: any free port)")


class WeightsConfig(Section):
    transport: Literal["colocated", "broadcast", "disk_delta"] = "colocated"
    disk_delta: DiskDeltaOptions = Field(default_factory=DiskDeltaOptions,
                                         description="options of transport=disk_delta (root default: RUN_DIR/weights)")
    check_update_equal: bool = Field(
        False, description="fill the engines with random data before the first push and, after every push, "
        "compare every exported tensor with the trainer's copy; the run stops naming each tensor that differs")
    check_tolerance: CheckTolerance | None = Field(
        None, description="unset: exact (bit for bit, in the engine's dtype); {atol, rtol}: for quantised "
        "engines, |engine - trainer| <= atol + rtol*|trainer| per element (miles_engine.weights.check.options)")

    @model_validator(mode="after")
    def _tolerance_needs_check(self) -> WeightsConfig:
        if self.check_tolerance is not None and not self.check_update_equal:
            raise ValueError("weights.check_tolerance is set but weights.check_update_equal is false; "
                             "set weights.check_update_equal: true (or drop the tolerance)")
        return self

    @property
    def check(self) -> CheckOptions | None:
        """The check's options, or None when ``check_update_equal`` is off."""
        return CheckOptions(tolerance=self.check_tolerance) if self.check_update_equal else None


class RunConfig(Section):
    steps: int = Field(100, ge=0, description="RL steps (0: an SFT-only run)")
    max_minutes: float | None = Field(None, gt=0, description="stop RL after this long (wall clock, whole run)")
    out_dir: str = "runs"
    name: str | None = Field(None, description="run directory name (default: recipe name + timestamp)")
    checkpoint_every: int = Field(0, ge=0, description="RL steps between checkpoints (0: only at the end)")
    checkpoint_keep: int = Field(2, ge=1, description="newest checkpoints kept on disk")

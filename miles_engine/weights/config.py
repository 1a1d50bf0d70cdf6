"""The recipe's ``weights`` section: how the trainer's weights reach the engines."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles_engine.components import Section
from miles_engine.weights.check.options import CheckOptions, CheckTolerance
from miles_engine.weights.disk_delta.options import DiskDeltaOptions


class P2POptions(Section):
    """``weights.p2p``: the trainer ranks write into the engines point to point (:mod:`miles_engine.weights.p2p`)."""

    bucket_mb: float = Field(64.0, gt=0, description="bytes per write (and per staging buffer: two per trainer rank)")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="the group's backend (auto: nccl with CUDA)")
    timeout_s: float = Field(120.0, gt=0, description="a write or a join that takes longer fails the update")


class WeightsConfig(Section):
    transport: Literal["colocated", "broadcast", "disk_delta", "p2p"] = Field(
        "colocated", description="colocated (engines in this process), broadcast (one sender, every engine gets "
        "every tensor), disk_delta (versioned patches on a shared disk), p2p (every trainer rank writes to the "
        "engines the plan gives it, each engine gets what its layout declares)")
    p2p: P2POptions = Field(default_factory=P2POptions, description="options of transport=p2p")
    disk_delta: DiskDeltaOptions = Field(default_factory=DiskDeltaOptions,
                                         description="options of transport=disk_delta (root default: RUN_DIR/weights)")
    lora: Literal["auto", "merged", "adapters"] = Field(
        "auto", description="with trainer.lora: what a push carries -- 'merged' weights W + scaling * B @ A of every "
        "adapted module, or the 'adapters' alone (A, B and the scaling: rank x (in + out) numbers per module; the "
        "engine keeps the base it loaded and merges them exactly as the trainer would; embedded and server engines "
        "in full precision, transports colocated and broadcast); 'auto': adapters where every engine group can "
        "take them, else merged")
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

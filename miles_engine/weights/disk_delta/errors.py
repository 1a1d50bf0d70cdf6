"""Errors of the disk-delta transport; each names the version and tensor at fault."""

from __future__ import annotations

from miles_engine.weights.protocol import WeightPushError


class DiskDeltaError(WeightPushError):
    """A disk-delta publish or apply failed; the engines keep their previous version."""


class BaselineMismatchError(DiskDeltaError):
    """The trainer's exported tensors do not match the baseline checkpoint (raised before training)."""


class LineageError(DiskDeltaError):
    """A delta's base is not what the engine holds (wrong base, applied twice, or a rollback)."""


class TornVersionError(DiskDeltaError):
    """A version directory has no index: its publish never completed, so it is never activated."""


class ChecksumError(DiskDeltaError):
    """A patched tensor's bytes do not hash to the checksum its version recorded."""


class ReplicaConflictError(DiskDeltaError):
    """Two sources published the same replicated tensor with different final bytes."""


class CorruptDeltaError(DiskDeltaError):
    """A delta payload cannot be decoded (truncated shard, bad lengths, wrong size)."""

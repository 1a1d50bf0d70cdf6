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


def remote_sync_error(url: str, status: int, body: object, message: str, version: int) -> DiskDeltaError:
    """The error an engine server's ``/update_weights_from_disk_delta`` refusal stands for, naming
    the engine's URL (the ``error.type`` of the answer picks the class)."""
    if status == 404:
        return DiskDeltaError(f"engine {url} has no /update_weights_from_disk_delta (not a miles engine server; "
                              f"SGLang only reloads whole checkpoints): set weights.disk_delta.apply_on=trainer")
    kind = ""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        kind = str(body["error"].get("type", ""))
    classes = {c.__name__: c for c in (DiskDeltaError, LineageError, TornVersionError, ChecksumError,
                                       CorruptDeltaError, BaselineMismatchError, ReplicaConflictError)}
    cls = classes.get(kind, DiskDeltaError)
    held = body.get("weight_version") if isinstance(body, dict) else None
    keeps = f"; it keeps serving weight version {held}" if held is not None else ""
    return cls(f"engine {url} refused disk_delta sync to version {version} (HTTP {status}): {message}{keeps}")

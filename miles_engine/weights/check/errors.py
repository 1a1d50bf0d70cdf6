"""The check's error (no torch)."""

from __future__ import annotations

from miles_engine.weights.protocol import WeightPushError


class WeightCheckError(WeightPushError):
    """check_update_equal found engine tensors that are not the trainer's (or could not read them)."""

"""Per-step engine figures from an engine's cumulative counters (the embedded engine's ``stats()``),
and the sandbox backend's per-step figures (its optional ``step_metrics()``)."""

from __future__ import annotations

import time
from typing import Any


class EngineStepMetrics:
    """``engine/*`` per logged step: forward passes, mean decode batch, busy fraction, tokens/s.

    Engines without a ``stats()`` dict (HTTP servers, routers) contribute nothing.
    """

    def __init__(self, engine: Any) -> None:
        self._stats = getattr(engine, "stats", None)
        self._last = self._read()
        self._t = time.monotonic()

    def _read(self) -> dict[str, Any] | None:
        if not callable(self._stats):
            return None
        stats = self._stats()
        return stats if isinstance(stats, dict) else None

    def metrics(self) -> dict[str, float]:
        now, t = self._read(), time.monotonic()
        last, dt = self._last, t - self._t
        self._last, self._t = now, t
        if now is None or last is None or dt <= 0:
            return {}

        def delta(key: str) -> float:
            return float(now.get(key, 0)) - float(last.get(key, 0))

        steps, prefills = delta("steps"), delta("prefill_forwards")
        return {"engine/decode_steps": steps, "engine/prefill_forwards": prefills,
                "engine/mean_decode_batch": delta("batch_rows") / steps if steps else 0.0,
                "engine/busy_fraction": min(1.0, delta("busy_s") / dt),
                "engine/output_tokens_per_s": delta("output_tokens") / dt}


def sandbox_step_metrics(backend: Any) -> dict[str, float]:
    """``sandbox/*`` for one logged step from a backend with ``step_metrics()`` (the docker backend:
    create / exec / destroy latency p50 / p95 / n, builds and build cache hits since the last step);
    backends without one contribute nothing."""
    step_metrics = getattr(backend, "step_metrics", None)
    if not callable(step_metrics):
        return {}
    out = step_metrics()
    return {k: float(v) for k, v in out.items()} if isinstance(out, dict) else {}

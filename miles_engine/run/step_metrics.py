"""A step's logged figures beyond the trainer's: the rollout metrics of the groups it trained on,
the engine's from its cumulative counters (the embedded engine's ``stats()``), and the sandbox
backend's (its optional ``step_metrics()``)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from miles_engine.rollout.types import Group


class EngineStepMetrics:
    """``engine/*`` per logged step: forward passes, mean decode batch, busy fraction, tokens/s,
    requests retracted, aborted (by pushes' pauses, or callers) or kept running across an update.

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
        speculation: dict[str, float] = {}
        if "spec_verify_rows" in now:  # engines.N.options.speculative: tokens a row gains per verify step
            rows = delta("spec_verify_rows")
            speculation = {"engine/spec_acceptance_length": (delta("spec_accepted_tokens") + rows) / rows
                           if rows else 0.0, "engine/spec_proposed_tokens": delta("spec_proposed_tokens")}
        return {**speculation,"engine/decode_steps": steps, "engine/prefill_forwards": prefills,
                "engine/mean_decode_batch": delta("batch_rows") / steps if steps else 0.0,
                "engine/busy_fraction": min(1.0, delta("busy_s") / dt),
                "engine/output_tokens_per_s": delta("output_tokens") / dt,
                # requests a push's pause put back to be re-prefilled (rollout.on_update=retract), once each
                "engine/retracted": delta("retracted"), "engine/aborted": delta("aborted"),
                "engine/kept_in_place": delta("kept_in_place")}


def sandbox_step_metrics(backend: Any) -> dict[str, float]:
    """``sandbox/*`` for one logged step from a backend with ``step_metrics()`` (the docker backend:
    create / exec / destroy latency p50 / p95 / n, builds and build cache hits since the last step);
    backends without one contribute nothing."""
    step_metrics = getattr(backend, "step_metrics", None)
    if not callable(step_metrics):
        return {}
    out = step_metrics()
    return {k: float(v) for k, v in out.items()} if isinstance(out, dict) else {}


def group_metrics(groups: Sequence[Group]) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajs if t.reward is not None]
    out: dict[str, float] = {"rollout/num_samples": float(len(trajs)), "rollout/num_groups": float(len(groups))}
    if rewards:
        out.update({"reward/mean": statistics.fmean(rewards), "reward/min": min(rewards),
                    "reward/max": max(rewards)})
    by_kind: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        if t.reward is not None and "kind" in t.tags:
            by_kind[t.tags["kind"]].append(t.reward)
    out.update({f"reward/{kind}": statistics.fmean(v) for kind, v in sorted(by_kind.items())})
    for key, name in (("tool_use", "rollout/tool_use_rate"), ("turns", "rollout/turns"),
                      ("generation_s", "time/generation"), ("reward_s", "time/reward"),
                      ("episode_s", "rollout/episode_s"), ("tito_mismatch_bug", "tito/mismatch_bug_rate"),
                      ("truncated", "rollout/truncated_rate")):
        values = [t.metrics[key] for t in trajs if key in t.metrics]
        if values:
            out[name] = statistics.fmean(values)
    # tito/mismatch_rate/<type> and tito/mismatch_bug_rate/<wire format> (chat, messages, responses)
    for prefix, name in (("tito_mismatch_type/", "tito/mismatch_rate/"),
                         ("tito_mismatch_wire/", "tito/mismatch_bug_rate/")):
        keys = sorted({k for t in trajs for k in t.metrics if k.startswith(prefix)})
        for key in keys:
            out[name + key[len(prefix):]] = statistics.fmean(t.metrics[key] for t in trajs if key in t.metrics)
    # session_server.diagnose_every: the mismatch rate is over the diagnosed trajectories only
    out["tito/diagnosed"] = float(sum("tito_mismatch_bug" in t.metrics for t in trajs))
    sampled = [t.num_sampled for t in trajs]
    if sampled:
        out["rollout/sampled_tokens"] = statistics.fmean(sampled)
    # a failed attempt kept with reward 0.0 has status "ok" and tags["failure"]
    out["rollout/failed"] = float(sum(t.status != "ok" or "failure" in t.tags for t in trajs))
    return out

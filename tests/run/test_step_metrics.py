"""engine/* step metrics: deltas of the engine's cumulative counters over the step's wall time."""

from __future__ import annotations

import pytest

from miles_engine.run import step_metrics as engine_metrics
from miles_engine.run.step_metrics import EngineStepMetrics


class CountingEngine:
    def __init__(self) -> None:
        self.counters = dict(steps=0, batch_rows=0, prefill_forwards=0, busy_s=0.0, output_tokens=0, retracted=0,
                             aborted=0, kept_in_place=0)

    def stats(self) -> dict:
        return dict(self.counters)


def test_step_metrics_are_deltas_over_the_step(monkeypatch):
    clock = iter([100.0, 102.0, 103.0])
    monkeypatch.setattr(engine_metrics.time, "monotonic", lambda: next(clock))
    engine = CountingEngine()
    m = EngineStepMetrics(engine)
    engine.counters.update(steps=10, batch_rows=80, prefill_forwards=4, busy_s=1.5, output_tokens=120, retracted=3)
    assert m.metrics() == pytest.approx({"engine/decode_steps": 10, "engine/prefill_forwards": 4,
                                         "engine/mean_decode_batch": 8.0, "engine/busy_fraction": 0.75,
                                         "engine/output_tokens_per_s": 60.0, "engine/retracted": 3,
                                         "engine/aborted": 0, "engine/kept_in_place": 0})
    engine.counters.update(steps=12, batch_rows=83, prefill_forwards=4, busy_s=2.0, output_tokens=126)
    assert m.metrics() == pytest.approx({"engine/decode_steps": 2, "engine/prefill_forwards": 0,
                                         "engine/mean_decode_batch": 1.5, "engine/busy_fraction": 0.5,
                                         "engine/output_tokens_per_s": 6.0, "engine/retracted": 0,
                                         "engine/aborted": 0, "engine/kept_in_place": 0})


def test_engines_without_a_stats_dict_add_nothing():
    class Router:
        def stats(self) -> list:  # one dict per engine: not summed here
            return [{"steps": 1}]

    assert EngineStepMetrics(object()).metrics() == {}
    assert EngineStepMetrics(Router()).metrics() == {}


def test_sandbox_step_metrics_come_from_backends_that_have_them():
    from miles_engine.run.step_metrics import sandbox_step_metrics

    class Backend:
        def step_metrics(self) -> dict:
            return {"sandbox/create_p50_s": 0.5, "sandbox/builds": 1}

    assert sandbox_step_metrics(Backend()) == {"sandbox/create_p50_s": 0.5, "sandbox/builds": 1.0}
    assert sandbox_step_metrics(object()) == {} and sandbox_step_metrics(None) == {}


def test_speculation_reports_acceptance_length_per_step(monkeypatch):
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(engine_metrics.time, "monotonic", lambda: next(clock))
    engine = CountingEngine()
    engine.counters.update(spec_verify_rows=0, spec_accepted_tokens=0, spec_proposed_tokens=0)
    m = EngineStepMetrics(engine)
    engine.counters.update(steps=5, spec_verify_rows=10, spec_accepted_tokens=15, spec_proposed_tokens=40)
    out = m.metrics()
    assert out["engine/spec_acceptance_length"] == 2.5 and out["engine/spec_proposed_tokens"] == 40

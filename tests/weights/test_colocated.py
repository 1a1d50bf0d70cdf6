"""Colocated pushes into a real EmbeddedEngine, verified tensor by tensor; refusals; missed pushes."""

from __future__ import annotations

import pytest
import torch

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.router import Router
from miles_engine.errors import EngineRequestError, UnknownComponentError, WeightUpdateError
from miles_engine.weights import PushStats, WeightPushError, create_transport, verify_versions
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.weights.helpers import TINY_QWEN3, differing, trainer_model


def _engine(**kw) -> EmbeddedEngine:
    return EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128, **kw)


def test_colocated_push_lands_tensor_by_tensor():
    trainer = trainer_model(seed=1)
    engine = _engine()

    async def main():
        before = digests(engine.model.state_dict())
        wanted = digests(trainer.state_dict())
        assert differing(before, wanted) == sorted(wanted)  # every tensor differs before the push
        transport = create_transport("colocated", engine)
        stats = await transport.push(trainer.named_parameters(), version=1)
        after = digests(engine.model.state_dict())
        assert differing(after, wanted) == []  # ... and none after
        assert engine.weight_version == 1 and isinstance(stats, PushStats)
        assert stats.tensors == len(wanted) and stats.missing == 0 and stats.engines == 1
        assert stats.bytes == sum(p.numel() * 4 for p in trainer.parameters())
        assert stats.pause_s > 0 and stats.push_s >= stats.pause_s
        m = stats.metrics()
        assert m["weights/version"] == 1 and m["weights/bytes_pushed"] == stats.bytes and "weights/push_s" in m
        # the engine samples from the pushed weights, labelled with the pushed version
        res = await engine.generate(GenerateRequest([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=4)))
        assert res.weight_versions == [1] * len(res.output_ids)
        with torch.no_grad():  # later optimizer steps do not leak into the engine
            next(trainer.parameters()).add_(1.0)
        assert digests(engine.model.state_dict()) == after
        await transport.close()
        await engine.aclose()
    run(main(), 60)


def test_colocated_casts_to_the_engine_dtype_and_pushes_through_a_router():
    trainer = trainer_model(seed=2)
    engines = [_engine(dtype="bfloat16"), _engine(dtype="bfloat16", seed=5)]

    async def main():
        router = Router(engines, health_interval_s=0)
        transport = create_transport("colocated", router)
        stats = await transport.push(trainer.state_dict().items(), version=7)
        wanted = digests({n: t.to(torch.bfloat16) for n, t in trainer.state_dict().items()})
        for e in engines:
            assert differing(digests(e.model.state_dict()), wanted) == [] and e.weight_version == 7
        assert router.weight_version == 7 and stats.bytes == sum(t.numel() * 2 for t in trainer.state_dict().values())
        await router.aclose()
    run(main(), 60)


def test_bad_pushes_are_refused_before_anything_changes():
    engine = _engine()

    async def main():
        before = digests(engine.model.state_dict())
        transport = create_transport("colocated", engine)
        good = dict(trainer_model(seed=3).named_parameters())
        bad_name = {**good, "model.layers.0.mlp.gate_prj.weight": torch.zeros(64, 32)}
        with pytest.raises(WeightPushError, match="gate_prj.*did you mean"):
            await transport.push(bad_name.items(), version=1)
        bad_shape = {**good, "model.norm.weight": torch.zeros(33)}
        with pytest.raises(WeightPushError, match=r"model.norm.weight.*shape \(33,\)"):
            await transport.push(bad_shape.items(), version=1)
        bad_dtype = {**good, "model.norm.weight": torch.zeros(32, dtype=torch.int32)}
        with pytest.raises(WeightPushError, match="only floating-point"):
            await transport.push(bad_dtype.items(), version=1)
        assert digests(engine.model.state_dict()) == before and engine.weight_version == 0
        assert not engine.stats()["paused"]
        await engine.aclose()
    run(main(), 60)


class _Lagging:
    """An engine whose update 'succeeds' without taking effect (e.g. a restarted replica)."""

    def __init__(self, inner):
        self.inner, self.name = inner, "lagging-engine"

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    async def update_weights(self, weights, *, version=None):
        return version


def test_an_engine_that_missed_the_push_is_detected():
    good, lagging = _engine(), _engine()

    async def main():
        transport = create_transport("colocated", [good, _Lagging(lagging)])
        with pytest.raises(WeightPushError, match="lagging-engine reports 0.*missed the push"):
            await transport.push(trainer_model(seed=4).named_parameters(), version=1)
        await verify_versions([good], 1)
        await good.aclose()
        await lagging.aclose()
    run(main(), 60)


def test_unknown_transport_lists_the_names():
    with pytest.raises(UnknownComponentError, match="available: broadcast, colocated"):
        create_transport("nccl-magic", [])


class _NoSeparateCalls:
    """Fails the test if the transport falls back to pause / update_weights / resume."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, attr):
        if attr in ("pause", "update_weights", "resume"):
            raise AssertionError(f"{attr} called: one engine must get a single swap_weights")
        return getattr(self.inner, attr)


def test_one_engine_gets_one_swap_not_pause_update_resume():
    trainer = trainer_model(seed=6)
    engine = _engine()

    async def main():
        transport = create_transport("colocated", _NoSeparateCalls(engine))
        stats = await transport.push(trainer.named_parameters(), version=3)
        assert stats.version == 3 and engine.weight_version == 3 and not engine.stats()["paused"]
        assert differing(digests(engine.model.state_dict()), digests(trainer.state_dict())) == []
        await engine.aclose()
    run(main(), 60)


def test_swap_keeps_a_paused_engine_paused_and_a_bad_swap_changes_nothing():
    engine = _engine()

    async def main():
        good = dict(trainer_model(seed=7).named_parameters())
        await engine.pause("in_place")
        assert await engine.swap_weights(good, version=2, pause_mode="in_place") == 2
        assert engine.stats()["paused"]
        await engine.resume()
        before = digests(engine.model.state_dict())
        with pytest.raises(WeightUpdateError, match="shape"):
            await engine.swap_weights({**good, "model.norm.weight": torch.zeros(33)}, version=3)
        with pytest.raises(EngineRequestError, match="unknown pause mode 'stop'; allowed"):
            await engine.swap_weights(good, version=3, pause_mode="stop")
        assert digests(engine.model.state_dict()) == before and engine.weight_version == 2
        assert not engine.stats()["paused"]
        await engine.aclose()
    run(main(), 60)

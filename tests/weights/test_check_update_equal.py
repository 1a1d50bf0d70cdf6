"""check-weight-update-equal over the colocated transport (in-process engines), the comparison
rules, the tolerance, metrics and options."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pydantic import ValidationError

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.weights.config import WeightsConfig
from miles_engine.weights import PushStats, WeightPushError, create_transport
from miles_engine.weights.check import CheckOptions, CheckTolerance
from miles_engine.weights.check.compare import max_abs_diff, random_fill_as, same_bytes
from miles_engine.weights.check import WeightCheckError
from miles_engine.weights.check.transport import CheckedTransport
from miles_engine.weights.tensors import digest, digests
from tests.rollout.helpers import run
from tests.weights.check_helpers import Alter, SkipOne, truncate_to_bf16
from tests.weights.helpers import TINY_QWEN3, differing, trainer_model
from miles_engine.hub import default_hub

SKIPPED = "model.layers.1.mlp.down_proj.weight"


def _engine(**kw) -> EmbeddedEngine:
    return EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128, **kw)


def _bump(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))


def test_checked_colocated_push_passes_and_reports_metrics():
    trainer = trainer_model(seed=1)
    engine = _engine()

    async def main():
        transport = create_transport("colocated", engine, check=CheckOptions())
        assert isinstance(transport, CheckedTransport)
        assert await transport.preflight([]) is None and await transport.rewind(0) == []  # the protocol's no-ops
        stats = await transport.push(trainer.named_parameters(), version=1)
        n = len(dict(trainer.named_parameters()))
        assert isinstance(stats, PushStats) and stats.tensors_checked == n and stats.check_s > 0
        m = stats.metrics()
        assert m["weights/tensors_checked"] == n and m["weights/check_s"] == stats.check_s
        assert differing(digests(engine.model.state_dict()), digests(trainer.state_dict())) == []
        assert engine.weight_version == 1
        _bump(trainer, seed=2)  # later pushes are checked too (no second fill)
        stats = await transport.push(trainer.named_parameters(), version=2)
        assert stats.tensors_checked == n and engine.weight_version == 2
        await transport.close()
        await engine.aclose()
    run(main(), 60)


def test_unchecked_push_has_no_check_metrics():
    stats = PushStats(version=3)
    assert "weights/check_s" not in stats.metrics() and "weights/tensors_checked" not in stats.metrics()


def test_a_transport_that_skips_one_tensor_fails_naming_exactly_it():
    engine = _engine()
    # the trainer starts from the engine's own weights: without the random fill the skipped
    # tensor would already equal the trainer's and the bug would go unnoticed
    trainer = copy.deepcopy(engine.model)

    async def main():
        transport = CheckedTransport(SkipOne(create_transport("colocated", engine), SKIPPED), engine)
        with pytest.raises(WeightCheckError) as err:
            await transport.push(trainer.named_parameters(), version=1)
        msg = str(err.value)
        n = len(dict(trainer.named_parameters()))
        assert f"1 of {n} tensors" in msg and f"{SKIPPED!r} was never written" in msg and "max abs diff" in msg
        assert "colocated push of weight version 1" in msg and "(in_process)" in msg
        bad = differing(digests(engine.model.state_dict()), digests(trainer.state_dict()))
        assert bad == [SKIPPED]  # the message names exactly the tensor that differs
        assert engine.weight_version == 1 and engine._sched.paused  # left paused: it holds noise
        assert "engines are left paused" in msg
        await engine.aclose()
    run(main(), 60)


def test_a_skip_on_a_later_push_is_a_difference_with_its_max_abs_diff():
    engine = _engine()
    trainer = trainer_model(seed=3)

    async def main():
        skipper = SkipOne(create_transport("colocated", engine), "nothing-yet")
        transport = CheckedTransport(skipper, engine)
        await transport.push(trainer.named_parameters(), version=1)
        _bump(trainer, seed=4)
        skipper.skip = "model.norm.weight"
        with pytest.raises(WeightCheckError) as err:
            await transport.push(trainer.named_parameters(), version=2)
        held = engine.model.state_dict()["model.norm.weight"]
        want = max_abs_diff(held, trainer.state_dict()["model.norm.weight"])
        msg = str(err.value)
        assert "'model.norm.weight' differs, max abs diff" in msg and f"{want:.6g}" in msg
        assert "never written" not in msg and msg.count("differs") == 1
        await engine.aclose()
    run(main(), 60)


def test_a_bf16_engine_is_exact_against_the_cast_and_a_lossy_cast_needs_a_tolerance():
    trainer = trainer_model(seed=5)

    async def push(check: CheckOptions, lossy: bool) -> None:
        engine = _engine(dtype="bfloat16")
        inner = create_transport("colocated", engine)
        if lossy:
            inner = Alter(inner, lambda n, t: truncate_to_bf16(t))
        transport = CheckedTransport(inner, engine, check)
        try:
            await transport.push(trainer.named_parameters(), version=1)
        finally:
            await engine.aclose()

    run(push(CheckOptions(), lossy=False), 60)  # fp32 trainer -> bf16 engine: the cast itself is exact
    with pytest.raises(WeightCheckError, match=r"exact: bit for bit.*differs, max abs diff"):
        run(push(CheckOptions(), lossy=True), 60)  # truncation instead of round-to-nearest
    run(push(CheckOptions(tolerance=CheckTolerance(rtol=2 ** -7)), lossy=True), 60)  # within bf16's spacing
    with pytest.raises(WeightCheckError, match=r"within \|diff\| <= 0 \+ 0.0001\*\|trainer\|"):
        run(push(CheckOptions(tolerance=CheckTolerance(rtol=1e-4)), lossy=True), 60)


def test_a_perturbed_tensor_within_and_outside_an_absolute_tolerance():
    trainer = trainer_model(seed=6)
    target = "model.layers.0.self_attn.q_proj.weight"

    def nudge(name: str, t: torch.Tensor) -> torch.Tensor:
        return t + 1e-3 if name == target else t

    async def push(tol: CheckTolerance | None) -> None:
        engine = _engine()
        transport = CheckedTransport(Alter(create_transport("colocated", engine), nudge), engine,
                                     CheckOptions(tolerance=tol))
        try:
            await transport.push(trainer.named_parameters(), version=1)
        finally:
            await engine.aclose()

    run(push(CheckTolerance(atol=2e-3)), 60)
    with pytest.raises(WeightCheckError) as err:
        run(push(CheckTolerance(atol=5e-4)), 60)
    assert f"{target!r} differs, max abs diff 0.001" in str(err.value) and "1 of" in str(err.value)


def test_comparison_rules():
    a = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    assert max_abs_diff(a, a.clone()) == 0.0  # NaN against NaN and equal infs are no difference
    assert max_abs_diff(a, torch.tensor([1.0, 0.0, float("inf"), -2.0])) == math.inf
    assert max_abs_diff(a, torch.tensor([1.5, float("nan"), float("inf"), -2.0])) == 0.5
    gen = torch.Generator().manual_seed(0)
    for exact in (torch.tensor(True), torch.tensor([False]), torch.tensor(3, dtype=torch.int8),
                  torch.zeros(2, dtype=torch.bfloat16), torch.randn(5, 7)):
        for _ in range(20):  # the fill never equals the trainer's bytes, even for one-element tensors
            fill = random_fill_as(exact.dtype, tuple(exact.shape), gen, digest(exact))
            assert fill.dtype == exact.dtype and fill.shape == exact.shape and not same_bytes(fill, exact)


def test_recipe_options():
    assert WeightsConfig().check is None
    cfg = WeightsConfig(check_update_equal=True, check_tolerance={"atol": 1e-3})
    assert cfg.check == CheckOptions(tolerance=CheckTolerance(atol=1e-3))
    with pytest.raises(ValidationError, match="check_tolerance is set but weights.check_update_equal is false"):
        WeightsConfig(check_tolerance={"rtol": 0.01})
    with pytest.raises(ValidationError, match="extra"):
        WeightsConfig(check_update_equal=True, check_tolerance={"rtoll": 0.01})
    with pytest.raises(ValidationError):
        WeightsConfig(check_update_equal=True, check_tolerance={"atol": -1})
    # through recipe overrides: one error naming the key
    from miles_engine.config.recipe import load_recipe
    from miles_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown key 'weights.check_tolerance.rtl' \(did you mean 'rtol'\?\)"):
        load_recipe("tiny-terminal", ["weights.check_update_equal=true", "weights.check_tolerance.rtl=0.01"],
                    hub=default_hub())
    cfg = load_recipe("tiny-terminal", ["weights.check_update_equal=true", "weights.check_tolerance.rtol=0.01"],
                      hub=default_hub())
    assert cfg.weights.check == CheckOptions(tolerance=CheckTolerance(rtol=0.01))


def test_a_push_failing_after_the_fill_leaves_the_engines_paused_and_says_why():
    engine = _engine()
    trainer = trainer_model(seed=8)

    async def main():
        transport = create_transport("colocated", engine, check=CheckOptions())
        bad = [*trainer.named_parameters(), ("model.norm.weight", torch.zeros(3))]  # the transport refuses it
        with pytest.raises(WeightPushError, match=r"shape.*filled the engines with random data.*left paused"):
            await transport.push(bad, version=1)
        assert engine._sched.paused and engine.weight_version == 0  # noise is never sampled
        stats = await transport.push(trainer.named_parameters(), version=1)  # a good push resumes and passes
        assert not engine._sched.paused and stats.tensors_checked > 0
        await engine.aclose()
    run(main(), 60)

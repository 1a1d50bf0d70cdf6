"""check-weight-update-equal over the disk_delta transport: the fill comes after the baseline is
materialised (so the baseline is the engine's real weights, not noise); a transport that skips
a tensor in a delta, and an engine-side applier that never loads one, are both named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import miles_engine.weights.disk_delta.transport as dd_transport
from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions
from miles_engine.weights.check import WeightCheckError
from miles_engine.weights.check.transport import CheckedTransport
from miles_engine.weights.disk_delta.applier import DeltaApplier
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.weights.check_helpers import SkipOne
from tests.weights.helpers import TINY_QWEN3, differing

SKIPPED = "model.layers.1.self_attn.o_proj.weight"


def _engine() -> EmbeddedEngine:
    return EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128)


def _step(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("preflight", [True, False])
def test_checked_disk_delta_pushes_pass(tmp_path: Path, preflight: bool) -> None:
    engine = _engine()
    trainer = copy.deepcopy(engine.model)  # trainer and engine start from the same baseline

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), check=CheckOptions())
        assert isinstance(transport, CheckedTransport) and transport.name == "disk_delta"
        if preflight:  # as the training stack does, through the wrapper
            await transport.preflight(list(trainer.named_parameters()))
        # without a preflight the wrapper opens the baseline before the fill: were the baseline
        # written from the noise, the engine would load noise at version 0 and this check would fail
        first = await transport.push(trainer.named_parameters(), version=0)
        n = len(dict(trainer.named_parameters()))
        assert first.tensors_checked == n and engine.weight_version == 0
        for version in (1, 2):
            _step(trainer, seed=version)
            stats = await transport.push(trainer.named_parameters(), version=version)
            assert stats.tensors_checked == n and stats.changed_bytes > 0  # disk_delta's own stats survive
            assert "weights/check_s" in stats.metrics() and "weights/changed_density" in stats.metrics()
        assert differing(digests(engine.model.state_dict()), digests(trainer.state_dict())) == []
        await transport.close()
        await engine.aclose()
    run(main(), 90)


def test_a_delta_that_skips_one_tensor_is_named(tmp_path: Path) -> None:
    engine = _engine()
    trainer = copy.deepcopy(engine.model)

    async def main() -> None:
        inner = create_transport("disk_delta", engine, root=str(tmp_path))
        transport = CheckedTransport(SkipOne(inner, SKIPPED), engine)
        await transport.push(trainer.named_parameters(), version=0)  # the baseline holds every tensor
        _step(trainer, seed=7)
        with pytest.raises(WeightCheckError) as err:
            await transport.push(trainer.named_parameters(), version=1)
        msg = str(err.value)
        n = len(dict(trainer.named_parameters()))
        assert f"1 of {n} tensors: {SKIPPED!r} differs, max abs diff" in msg and "disk_delta push" in msg
        assert differing(digests(engine.model.state_dict()), digests(trainer.state_dict())) == [SKIPPED]
        await transport.close()
        await engine.aclose()
    run(main(), 90)


class _ApplierDroppingOne(DeltaApplier):
    """An engine-side bug: one tensor is never loaded into the engine."""

    async def _activate(self, names, source, version):
        return await super()._activate([n for n in names if n != SKIPPED], source, version)


def test_an_applier_that_never_loads_a_tensor_is_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(dd_transport, "DeltaApplier", _ApplierDroppingOne)
    engine = _engine()
    trainer = copy.deepcopy(engine.model)  # equal before the push: only the fill exposes the bug

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), check=CheckOptions())
        with pytest.raises(WeightCheckError) as err:
            await transport.push(trainer.named_parameters(), version=0)
        assert f"{SKIPPED!r} was never written (still holds the pre-push random fill" in str(err.value)
        assert str(err.value).count("was never written") == 1
        await transport.close()
        await engine.aclose()
    run(main(), 90)

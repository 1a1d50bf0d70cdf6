"""disk_delta into an engine holding FP8 weights: the baseline, every version and the engine's copy
hold the quantizer's codes and scales (quantised once, on the trainer's side), so the published
bytes are a quarter of float32's for those weights; a delta that changes a weight's codes but not
its scales still loads the whole weight; every push is checked tensor by tensor."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.models.loading import load_model
from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions
from miles_engine.weights.disk_delta.applier import with_sibling_parts
from miles_engine.weights.disk_delta.layout import read_index
from tests.rollout.helpers import run
from tests.weights.helpers import TINY_QWEN3

O_PROJ = "model.layers.1.self_attn.o_proj.weight"


def test_every_part_of_a_touched_weight_loads_together() -> None:
    source = {"a.weight:q.codes": 1, "a.weight:q.scales": 2, "b.weight": 3, "c.weight:q.codes": 4,
              "c.weight:q.scales": 5}
    assert with_sibling_parts(["a.weight:q.codes", "b.weight"], source) == [
        "a.weight:q.codes", "b.weight", "a.weight:q.scales"]
    assert with_sibling_parts(["b.weight"], source) == ["b.weight"]


def test_disk_delta_ships_codes_and_scales_to_an_fp8_engine(tmp_path: Path) -> None:
    trainer, _ = load_model(dict(TINY_QWEN3), seed=3)
    engine = EmbeddedEngine.from_model(copy.deepcopy(trainer), weight_format="fp8", num_threads=1, max_context=128)
    held = {m.name for m in engine.weight_metadata() if m.format == "fp8"}
    assert O_PROJ in held

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), check=CheckOptions())
        await transport.preflight(list(trainer.named_parameters()))
        n = len(dict(trainer.named_parameters()))
        assert (await transport.push(trainer.named_parameters(), version=0)).tensors_checked == n

        baseline = read_index(tmp_path, 0)
        assert f"{O_PROJ}:q.codes" in baseline.tensors and O_PROJ not in baseline.tensors
        assert baseline.tensors[f"{O_PROJ}:q.codes"].dtype == "uint8"
        full = sum(p.numel() * 4 for p in trainer.parameters())
        as_codes = sum(p.numel() * 3 for name, p in trainer.named_parameters() if name in held)
        assert baseline.total_bytes < full - as_codes + 4 * len(held) * 4  # 1 byte a code, a few tile scales

        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        stats = await transport.push(trainer.named_parameters(), version=1)
        assert stats.tensors_checked == n and stats.changed_bytes > 0

        # a change inside a tile that keeps its amax: the codes move, the scales do not
        weight = dict(trainer.named_parameters())[O_PROJ]
        before = quantize(weight.detach(), "fp8", O_PROJ)
        with torch.no_grad():
            flat = weight.view(-1)
            small = int(flat.abs().argmin())
            flat[small] = flat[small] + 1e-3
        after = quantize(weight.detach(), "fp8", O_PROJ)
        assert torch.equal(before.scales, after.scales) and not torch.equal(before.codes, after.codes)
        stats = await transport.push(trainer.named_parameters(), version=2)
        assert stats.tensors_checked == n and stats.tensors == 1  # only the codes were published
        served = engine.served_tensors([O_PROJ])[O_PROJ]
        assert torch.equal(served, dequantize(after, served.dtype))
        await transport.close()
        await engine.aclose()
    run(main(), 120)


def test_an_engine_server_holding_fp8_pulls_codes_and_scales_itself(tmp_path: Path) -> None:
    """The same through our engine server in another process, which patches its own copy, from a
    full-precision baseline checkpoint (quantised by the transport as the engine holds it)."""
    import json

    from safetensors.torch import save_file

    from miles_engine.engines.http.client import HttpEngine
    from miles_engine.weights.disk_delta.remote import RemoteDeltaSync
    from tests.weights.helpers import engine_process, trainer_model

    trainer = trainer_model(seed=5)
    (tmp_path / "engine").mkdir()
    baseline = tmp_path / "baseline.safetensors"
    save_file({n: t.detach().clone() for n, t in trainer.state_dict().items()}, str(baseline))
    with engine_process(tmp_path / "engine", "--engine-options", json.dumps({"weight_format": "fp8"}),
                        start_s=75) as proc:
        async def main() -> None:
            engine = await HttpEngine(proc.url, name="engine-fp8").connect()
            assert O_PROJ in {m.name for m in engine.weight_metadata() if m.format == "fp8"}
            transport = create_transport("disk_delta", engine, root=str(tmp_path / "root"), baseline=str(baseline),
                                         check=CheckOptions())
            n = len(dict(trainer.named_parameters()))
            assert (await transport.push(trainer.named_parameters(), version=0)).tensors_checked == n
            for version in (1, 2):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
                stats = await transport.push(trainer.named_parameters(), version=version)
                assert stats.tensors_checked == n
            assert isinstance(next(iter(transport.inner.appliers.values())), RemoteDeltaSync)
            assert f"{O_PROJ}:q.scales" in read_index(tmp_path / "root", 0).tensors
            await transport.close()
            await engine.aclose()
        run(main(), 150)


def test_the_baseline_is_the_engines_own_codes_and_scales(tmp_path: Path) -> None:
    """NVFP4: quantising the decoded values again gives another tensor scale, so the baseline takes
    the engine's parts as held; the trainer's version 0 is then the same version, byte for byte."""
    trainer, _ = load_model(dict(TINY_QWEN3), seed=4)
    engine = EmbeddedEngine.from_model(copy.deepcopy(trainer), weight_format="nvfp4", num_threads=1, max_context=128)
    held = engine.held_parts()
    assert not torch.equal(quantize(engine.served_tensors([O_PROJ])[O_PROJ], "nvfp4").tensor_scale,
                           held[f"{O_PROJ}:q.tensor_scale"])  # why the values would not do

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), check=CheckOptions())
        n = len(dict(trainer.named_parameters()))
        assert (await transport.push(trainer.named_parameters(), version=0)).tensors_checked == n
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(1.01)
        assert (await transport.push(trainer.named_parameters(), version=1)).tensors_checked == n
        await transport.close()
        await engine.aclose()
    run(main(), 60)

"""The FP8 contract on ``sglang`` engines, against the fake ``sglang.launch_server`` (SGLang's weight
routes; given a quantised checkpoint it loads it and, as SGLang's ``load_weights`` does, refuses a
tensor of another name, dtype or shape): the kind writes the policy's FP8 checkpoint and launches
SGLang on it; every push ships the quantizer's codes as ``float8_e4m3fn`` weights and their
``weight_scale_inv`` under the checkpoint's names, and check-weight-update-equal reads both back
through ``/get_weights_by_name`` and finds the trainer's quantised values. What SGLang cannot hold
is refused at load. Unverified here: SGLang's own kernels (CUDA), NCCL carrying float8."""

from __future__ import annotations

import asyncio
import copy
import json
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch

from miles_engine.engines.fleet.build import check_precision, create_kinds, start_fleet
from miles_engine.engines.fleet.config import EngineGroupConfig
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.engines.fp8_checkpoint import fused_scale_rows
from miles_engine.engines.held import fp8_wire_specs
from miles_engine.engines.protocol import TensorMeta
from miles_engine.engines.sglang import SGLangLaunchConfig, SGLangServer
from miles_engine.errors import ConfigError
from miles_engine.hub import default_hub
from miles_engine.precision.checkpoint import scale_name
from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.trainer.models import build_causal_lm
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions
from miles_engine.weights.check.errors import WeightCheckError
from miles_engine.weights.check.transport import CheckedTransport
from tests.engines.serving.test_sglang_launcher import fake_env  # noqa: F401 - the fixture
from tests.trainer.helpers import TINY

QKV = "*.self_attn.[qkv]_proj.weight"  # TINY's 64 / 32-row q / k / v would share 128-row tiles


def _groups(**kw: object) -> list[EngineGroupConfig]:
    return [EngineGroupConfig(**{"kind": "sglang", "device": "cuda:0", "dtype": "bfloat16",
                                 "options": {"start_timeout_s": 60}, **kw})]


def test_sglang_holds_fp8_weights_only_where_it_can_compute_and_receive_them() -> None:
    def refusal(fmt: str, kv: str = "full", **kw: object) -> str:
        groups = _groups(**kw)
        with pytest.raises(ConfigError) as err:
            check_precision(fmt, kv, groups, create_kinds(default_hub(), groups))
        return str(err.value)

    groups = _groups()
    check_precision("fp8", "full", groups, create_kinds(default_hub(), groups))  # bf16 on CUDA: held
    assert "engines.0.kind='sglang': precision.rollout='mxfp8': sglang engines receive full, fp8" in refusal("mxfp8")
    assert "receive full, fp8" in refusal("nvfp4") and "receive full, fp8" in refusal("int4")
    assert "one number" in refusal("fp8", "fp8")
    assert "set the group's dtype to bfloat16" in refusal("fp8", dtype="float32")
    assert "gloo (the CPU backend) cannot carry float8_e4m3fn" in refusal("fp8", device="cpu")


def test_fp8_wire_names_are_the_checkpoints() -> None:
    meta = [TensorMeta("m.o_proj.weight", "bfloat16", (128, 64), "fp8"), TensorMeta("m.norm.weight", "bfloat16", (64,))]
    names, dtypes, shapes = fp8_wire_specs(["m.o_proj.weight:q.codes", "m.o_proj.weight:q.scales", "m.norm.weight"],
                                           ["uint8", "float32", "bfloat16"], [[128, 64], [1, 1], [64]], meta)
    assert names == ["m.o_proj.weight", "m.o_proj.weight_scale_inv", "m.norm.weight"]
    assert dtypes == ["float8_e4m3fn", "float32", "bfloat16"] and shapes == [[128, 64], [1, 1], [64]]
    # a fused part's tile scales, read back out of the fused parameter (SmolLM2's q / k / v rows)
    shapes = {"m.q_proj.weight": (576, 576), "m.k_proj.weight": (192, 576), "m.v_proj.weight": (192, 576)}
    assert fused_scale_rows("m.k_proj.weight", shapes) == ("m.qkv_proj.weight_scale_inv", 5, 2, 9)
    assert fused_scale_rows("m.o_proj.weight", shapes) is None


def _trained(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return out


async def _read(engine, name: str, rows: int) -> torch.Tensor:
    return torch.tensor(await engine.get_weights_by_name(name, truncate_size=rows))


@pytest.mark.timeout(240)
def test_the_kind_serves_the_fp8_checkpoint_and_pushes_codes_and_scales(fake_env: dict[str, str],  # noqa: F811
                                                                        tmp_path: Path) -> None:
    rec = Path(fake_env["FAKE_SGLANG_DIR"])
    policy = build_causal_lm(TINY, torch.device("cpu"), 0)
    trainer = _trained(policy, 1)
    groups = _groups()
    ctx = FleetContext(model=policy, state_dir=tmp_path / "engines", env=fake_env, weight_format="fp8",
                       weight_exceptions=(QKV,))
    down = "model.layers.1.mlp.down_proj.weight"

    async def main() -> None:
        async with AsyncExitStack() as stack:
            router = await start_fleet(groups, create_kinds(default_hub(), groups), ctx, stack)
            [engine] = [slot.engine for slot in router.slots]
            argv = json.loads((rec / "argv.json").read_text())
            served = Path(argv[argv.index("--model-path") + 1])
            assert served == tmp_path / "engines" / "sglang-model-fp8" and "--skip-tokenizer-init" in argv
            quant = json.loads((served / "config.json").read_text())["quantization_config"]
            assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
            meta = {m.name: m for m in engine.weight_metadata()}
            fp8 = {n for n, m in meta.items() if m.format == "fp8"}
            assert down in fp8 and "model.layers.0.self_attn.q_proj.weight" in meta
            assert not any("self_attn.q_proj" in n or "norm" in n or "embed" in n for n in fp8)
            assert all(m.dtype == "bfloat16" for m in meta.values())

            transport = CheckedTransport(create_transport("broadcast", engine, bucket_bytes=32 << 10, backend="gloo",
                                                          timeout_s=60, group_name="sglang-fp8"),
                                         engine, CheckOptions())
            stats = await transport.push(list(trainer.named_parameters()), version=1)
            assert stats.missing == 0 and stats.tensors_checked == len(meta)
            full_bytes = sum(p.numel() * 4 for p in trainer.parameters())
            assert stats.bytes < 0.6 * full_bytes  # FP8 codes + tile scales, the rest bfloat16

            # what SGLang holds: the quantizer's codes as float8 weights, its scales as weight_scale_inv
            want = quantize(dict(trainer.named_parameters())[down].detach(), "fp8", down)
            codes = (await _read(engine, down, 64)).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(codes, want.codes)
            assert torch.equal(await _read(engine, scale_name(down), 1), want.scales)
            assert await engine.fetch_weight_version() == 1

            # an update from memory (a restore, the check's fill) is quantised by the client the same way
            again = _trained(policy, 2)
            await engine.update_weights(dict(again.named_parameters()), version=2)
            want = quantize(dict(again.named_parameters())[down].detach(), "fp8", down)
            held = (await _read(engine, down, 64)).to(torch.float8_e4m3fn).view(torch.uint8)
            assert torch.equal(held, want.codes)
            with pytest.raises(Exception, match="has no tensor 'model.layers.1.mlp.down_prj.weight'"):
                await engine.update_weights({"model.layers.1.mlp.down_prj.weight": torch.zeros(64, 128)})
            await transport.close()

    asyncio.run(asyncio.wait_for(main(), 200))


@pytest.mark.timeout(180)
def test_the_check_names_the_fused_part_whose_scales_the_server_changed(fake_env: dict[str, str],  # noqa: F811
                                                                       tmp_path: Path) -> None:
    from miles_engine.engines.fp8_checkpoint import held_metadata, save_fp8_policy

    policy = build_causal_lm(TINY, torch.device("cpu"), 0)
    directory = save_fp8_policy(policy, tmp_path / "fp8", [QKV], "sglang")
    up = "model.layers.0.mlp.up_proj.weight"  # the second part of a fused layer: its tiles come second
    env = {**fake_env, "FAKE_SGLANG_CORRUPT": scale_name(up)}
    trainer = _trained(policy, 3)

    async def main() -> None:
        server = SGLangServer(SGLangLaunchConfig(model_path=directory, env=env, start_timeout_s=60),
                              name="sglang-fp8", held=held_metadata(directory, "bfloat16"))
        engine = await server.start()
        try:
            transport = CheckedTransport(create_transport("broadcast", engine, bucket_bytes=1 << 20, backend="gloo",
                                                          timeout_s=60, group_name="sglang-corrupt"),
                                         engine, CheckOptions())
            with pytest.raises(WeightCheckError, match=rf"on sglang-fp8 \(get_weights_by_name\), 1 of \d+ tensors: "
                                                       rf"'{up}' differs, max abs diff"):
                await transport.push(list(trainer.named_parameters()), version=1)
            await transport.close()
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(main(), 150))


def test_held_values_decode_as_the_quantizer_decodes() -> None:
    """The read-back's decoding (codes as float32 lists, scales) gives the quantizer's values."""
    w = torch.randn(130, 200)
    q = quantize(w, "fp8", "w")
    codes = torch.tensor(q.codes.view(torch.float8_e4m3fn).float().tolist()).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), q.codes)
    assert torch.equal(dequantize(q, torch.bfloat16), dequantize(type(q)("fp8", q.shape, codes.view(torch.uint8),
                                                                         q.scales), torch.bfloat16))

"""The FP8 contract's rules for vLLM engines that need no vLLM: which fused groups vLLM can serve
with their own scales, the policy's FP8 checkpoint the kind writes, a user's model directory
checked against the contract, and the bridge's name mapping and read-back on stand-in layers
(the real server: test_vllm_fp8.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from miles_engine.engines.fp8_checkpoint import check_model_path, fused_group_problems, save_fp8_policy
from miles_engine.errors import ConfigError
from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.trainer.models import build_causal_lm
from tests.trainer.helpers import TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "miles_engine" / "engines" / "vllm" / "bridge"))
from miles_vllm_bridge import fp8 as bridge  # noqa: E402  (vLLM's environment imports it the same way)

SMOLLM2_ATTN = {"model.layers.0.self_attn.q_proj.weight": (576, 576),
                "model.layers.0.self_attn.k_proj.weight": (192, 576),
                "model.layers.0.self_attn.v_proj.weight": (192, 576),
                "model.layers.0.mlp.gate_proj.weight": (1536, 576),
                "model.layers.0.mlp.up_proj.weight": (1536, 576)}


def test_fused_groups_must_be_tile_aligned_and_all_of_one_format():
    every = set(SMOLLM2_ATTN)
    [misaligned] = fused_group_problems(SMOLLM2_ATTN, every)
    assert "model.layers.0.self_attn.k_proj.weight 192" in misaligned
    assert "add 'model.layers.*.self_attn.[qkv]_proj.weight' to precision.exceptions" in misaligned
    mlp_only = {n for n in every if ".mlp." in n}
    assert fused_group_problems(SMOLLM2_ATTN, mlp_only) == []  # q/k/v kept whole, gate/up 12 tiles each
    [mixed] = fused_group_problems(SMOLLM2_ATTN, mlp_only - {"model.layers.0.mlp.up_proj.weight"})
    assert "model.layers.0.mlp.gate_proj.weight is fp8 while model.layers.0.mlp.up_proj.weight is kept" in mixed
    assert "'model.layers.*.mlp.gate_proj.weight', 'model.layers.*.mlp.up_proj.weight'" in mixed
    # the last part may end inside a tile: nothing of another weight shares it
    assert fused_group_problems({"a.q_proj.weight": (128, 64), "a.k_proj.weight": (128, 64),
                                 "a.v_proj.weight": (64, 64)}, {"a.q_proj.weight", "a.k_proj.weight",
                                                                "a.v_proj.weight"}) == []


def test_the_kind_writes_the_fp8_checkpoint_once_and_refuses_what_vllm_would_misread(tmp_path):
    model = build_causal_lm(TINY, torch.device("cpu"), 0)
    with pytest.raises(ConfigError, match=r"precision.rollout='fp8' on vllm engines: vLLM fuses .*k_proj"):
        save_fp8_policy(model, tmp_path / "refused", ())
    assert not (tmp_path / "refused").exists() and not (tmp_path / "refused.tmp").exists()
    exceptions = ["*.self_attn.[qkv]_proj.weight"]
    out = Path(save_fp8_policy(model, tmp_path / "fp8", exceptions))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] and config["quantization_config"]["weight_block_size"] == [128, 128]
    assert "model.layers.0.self_attn.k_proj" in config["quantization_config"]["modules_to_not_convert"]
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert save_fp8_policy(model, tmp_path / "fp8", exceptions) == str(out)  # reused: same contract
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    check_model_path(str(out), exceptions)
    with pytest.raises(ConfigError, match=r"model_path=.* is format 'fp8' with exceptions .*needs the FP8 "
                                          r"checkpoint of this contract \(exceptions \['\*\.mlp\.\*'\]\)"):
        check_model_path(str(out), ["*.mlp.*"])
    model.save_pretrained(str(tmp_path / "full"))
    with pytest.raises(ConfigError, match="is a full-precision or unreadable checkpoint"):
        check_model_path(str(tmp_path / "full"), exceptions)


class _Fp8Linear(nn.Module):
    """What vLLM's FP8 linear layer holds: FP8 codes and a float32 scale per 128x128 tile."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, output_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(codes.view(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        if output_sizes is not None:
            self.output_sizes = output_sizes


class _Model(nn.Module):
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


def _fused(gate: torch.Tensor, up: torch.Tensor) -> _Model:
    qg, qu = quantize(gate, "fp8"), quantize(up, "fp8")
    mlp = nn.Module()
    mlp.gate_up_proj = _Fp8Linear(torch.cat([qg.codes, qu.codes]), torch.cat([qg.scales, qu.scales]),
                                  [gate.shape[0], up.shape[0]])
    mlp.down_proj = _Fp8Linear(quantize(gate.T.contiguous(), "fp8").codes, quantize(gate.T.contiguous(), "fp8").scales)
    return _Model(mlp)


def test_the_bridge_reads_each_part_of_a_fused_fp8_layer_as_the_quantizers_values():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(256, 200, generator=g), torch.randn(130, 200, generator=g) * 3
    model = _fused(gate, up)
    held = bridge.held_fp8(model)
    assert held == {"mlp.gate_proj.weight": bridge.HeldFp8("mlp.gate_up_proj", 0, 256, 200),
                    "mlp.up_proj.weight": bridge.HeldFp8("mlp.gate_up_proj", 256, 130, 200),
                    "mlp.down_proj.weight": bridge.HeldFp8("mlp.down_proj", 0, 200, 256)}
    assert bridge.metadata(held, torch.bfloat16)[1] == ["mlp.up_proj.weight", "bfloat16", [130, 200], "fp8"]
    for name, w in (("mlp.gate_proj.weight", gate), ("mlp.up_proj.weight", up)):
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(bridge.decoded(model, held[name], dtype), dequantize(quantize(w, "fp8"), dtype)), name


def test_a_fused_part_starting_inside_a_tile_cannot_be_read_as_its_own():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match=r"mlp.up_proj.weight starts at row 192, inside a 128-row scale tile"):
        bridge.held_fp8(_fused(torch.randn(192, 128, generator=g), torch.randn(128, 128, generator=g)))


def test_the_bridge_maps_parts_to_the_checkpoints_names_and_refuses_the_rest():
    held = {"mlp.down_proj.weight": bridge.HeldFp8("mlp.down_proj", 0, 8, 8)}
    codes, scales = torch.zeros(8, 8, dtype=torch.uint8), torch.ones(1, 1)
    named = bridge.to_checkpoint_names([("mlp.down_proj.weight:q.codes", codes), ("mlp.down_proj.weight:q.scales", scales),
                                        ("norm.weight", torch.ones(8))], held)
    assert [(n, t.dtype) for n, t in named] == [("mlp.down_proj.weight", torch.float8_e4m3fn),
                                                ("mlp.down_proj.weight_scale_inv", torch.float32),
                                                ("norm.weight", torch.float32)]
    with pytest.raises(ValueError, match=r"'mlp.down_proj.weight' is held in fp8 by this server: send its parts"):
        bridge.to_checkpoint_names([("mlp.down_proj.weight", torch.zeros(8, 8))], held)
    with pytest.raises(ValueError, match=r"'norm.weight' is not held in fp8"):
        bridge.to_checkpoint_names([("norm.weight:q.codes", codes)], held)
    with pytest.raises(ValueError, match=r"part 'tensor_scale' belongs to another format"):
        bridge.to_checkpoint_names([("mlp.down_proj.weight:q.tensor_scale", torch.ones(1))], held)


def test_stacked_moe_experts_are_refused_for_vllm_with_the_exception_to_add(tmp_path):
    from tests.trainer.helpers import MOE

    model = build_causal_lm(MOE, torch.device("cpu"), 0)
    with pytest.raises(ConfigError, match=r"vLLM loads a MoE layer's FP8 experts one by one .*add '\*\.mlp\.experts\.\*' "
                                          r"to precision.exceptions"):
        save_fp8_policy(model, tmp_path / "moe", ["*.self_attn.[qkv]_proj.weight"])
    assert not (tmp_path / "moe").exists()

"""tiny-terminal's "full-precision train + FP8 serve" on a real vLLM engine (the CPU build in its own
environment, ``./dev.sh vllm``), from the SFT weights (the shared ``warm_run``): the run writes the
policy as the precision contract's FP8 checkpoint for vLLM (q/k/v kept in high precision: the tiny
policy's k/v projections have 64 rows, not whole 128-row tiles), every push ships codes and scales and is
read back equal (``weights.check_update_equal``), and the engine-trainer log-prob gap is watched under
``precision.max_logprob_gap``. A module of its own so the test scheduler can run it beside the
other vLLM e2e test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_engine.engines.vllm.options import default_python
from tests.run.fleet_helpers import assert_accounted, vllm_pid
from tests.run.learning import rl_from_sft_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200),
              pytest.mark.skipif(not Path(default_python()).is_file(),
                                 reason=f"no vLLM environment at {default_python()} (./dev.sh vllm builds it)")]


def test_tiny_terminal_serves_fp8_weights_on_a_vllm_engine(warm_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "vllm-fp8"
    train = rl_from_sft_weights(
        warm_run, run, 4, "engines=[{kind: vllm, dtype: bfloat16, options: {cpu_kv_cache_gib: 1, max_num_seqs: 64}}]",
        "precision.rollout=fp8", "precision.exceptions=['*.self_attn.[qkv]_proj.weight']",
        "precision.max_logprob_gap=0.5", "trainer.algorithm.old_logprobs=recompute", "weights.transport=broadcast",
        "weights.check_update_equal=true", "rollout.mode=sync")
    config = json.loads((run / "engines" / "vllm-model-fp8" / "config.json").read_text())
    assert config["quantization_config"]["miles"]["quantized"] == [
        f"model.layers.{i}.{m}.weight" for i in range(2)
        for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.o_proj")]
    assert vllm_pid(run) is None
    assert_accounted(run, train)
    for r in train:
        assert r["weights/tensors_checked"] > 0 and r["weights/missing"] == 0, r
        assert 0 < r["precision/logprob_gap_mean"] < 0.05, r["precision/logprob_gap_mean"]
    # codes (1 byte) + a scale per 128x128 tile for the FP8 weights, float32 for the rest
    from safetensors.torch import load_file

    served = load_file(str(run / "engines" / "vllm-model-fp8" / "model.safetensors"))
    params = sum(t.numel() for n, t in served.items() if not n.endswith("weight_scale_inv"))
    assert train[-1]["weights/bytes_pushed"] < 0.6 * 4 * params, (train[-1]["weights/bytes_pushed"], params)

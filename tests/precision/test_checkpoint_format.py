"""The first stage: a model written in a quantised format (``miles convert``, ``miles export
--format``) reads back into exactly the quantizer's values; fp8 uses Hugging Face's fine-grained
FP8 layout; a quantised layout we did not write is one clear error; a failed write leaves nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from miles_engine.cli.main import cli
from miles_engine.engines.embedded import EmbeddedEngine
from miles_engine.errors import ConfigError
from miles_engine.models.loading import load_model
from miles_engine.precision.quantizer import dequantize, quantize
from miles_engine.precision.targets import quantized_weights
from miles_engine.trainer.models import build_causal_lm
from tests.rollout.helpers import run
from tests.trainer.helpers import TINY


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("src") / "model"
    build_causal_lm(TINY, torch.device("cpu"), 0).save_pretrained(str(path), safe_serialization=True)
    return path


def convert(source: Path, dest: Path, fmt: str, *exceptions: str) -> None:
    args = ["convert", str(source), str(dest), "--format", fmt]
    for e in exceptions:
        args += ["--exception", e]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4", "int4"])
def test_a_converted_model_loads_into_the_quantizers_values(source, tmp_path, fmt):
    dest = tmp_path / fmt
    convert(source, dest, fmt, "model.layers.1.self_attn.*")
    original, _ = load_model(str(source))
    loaded, _ = load_model(str(dest))
    chosen = quantized_weights(original, fmt, ["model.layers.1.self_attn.*"])
    assert "model.layers.1.self_attn.q_proj.weight" not in chosen and "model.layers.1.mlp.up_proj.weight" in chosen
    want, got = original.state_dict(), loaded.state_dict()
    for name, t in want.items():
        expected = dequantize(quantize(t, fmt, name)) if name in chosen else t
        assert torch.equal(got[name], expected), name
    config = json.loads((dest / "config.json").read_text())["quantization_config"]
    assert config["miles"]["format"] == fmt and config["miles"]["exceptions"] == ["model.layers.1.self_attn.*"]
    if fmt == "fp8":  # where Hugging Face and vLLM read the layers kept in high precision (they would load them as FP8)
        assert config["modules_to_not_convert"] == ["lm_head"] + [f"model.layers.1.self_attn.{p}_proj" for p in "koqv"]
    # an engine serving the directory in its own format holds the same values (quantising them again changes nothing)
    engine = EmbeddedEngine.from_model(str(dest), weight_format=fmt,
                                       weight_exceptions=("model.layers.1.self_attn.*",))
    try:
        held = engine.model.state_dict()
        assert all(torch.equal(held[n], got[n]) for n in chosen)
    finally:
        run(engine.aclose(), 30)


def test_fp8_is_written_in_hugging_faces_fine_grained_layout(source, tmp_path):
    dest = tmp_path / "fp8"
    convert(source, dest, "fp8")
    config = json.loads((dest / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert config["modules_to_not_convert"] == ["lm_head"]  # every other linear layer is FP8
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        weight = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        scale = f.get_tensor("model.layers.0.mlp.down_proj.weight_scale_inv")
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert tuple(scale.shape) == (1, 1)  # 64 x 128: one 128x128 tile
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def test_a_quantised_layout_we_did_not_write_is_one_error(source, tmp_path):
    dest = tmp_path / "gptq"
    dest.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match=r"config\.json: quantization_config .*'gptq'.*miles convert"):
        load_model(str(dest))


def test_a_failed_conversion_leaves_nothing(tmp_path):
    src = tmp_path / "odd"
    build_causal_lm(dict(TINY, intermediate_size=48), torch.device("cpu"), 0).save_pretrained(str(src))
    result = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "out"), "--format", "mxfp8"])
    assert isinstance(result.exception, ConfigError), result.output
    assert "down_proj.weight (64, 48)" in str(result.exception) and "--exception" in str(result.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd"]

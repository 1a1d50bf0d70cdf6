"""Loading: tiny spec, config.json, saved model dir, instance; sliding-window models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_engine.engines.embedded import EmbeddedEngine, load_engine
from miles_engine.errors import ConfigError

from .helpers import DENSE, engine, greedy, prompt, req, run, teacher_forced


def test_every_local_source_builds_the_same_model(tmp_path: Path) -> None:
    async def main() -> None:
        base = engine(seed=3)
        p = prompt(7, 0)
        want = (await base.generate(req(p, greedy(6)))).output_ids
        # a saved model directory (from_pretrained, local files only)
        base.model.save_pretrained(tmp_path / "saved")
        from_dir = EmbeddedEngine.from_model(tmp_path / "saved", num_threads=1)
        assert (await from_dir.generate(req(p, greedy(6)))).output_ids == want
        # a model instance is deep-copied: changing the original does not touch the engine
        from_inst = EmbeddedEngine.from_model(base.model, num_threads=1)
        with torch.no_grad():
            base.model.model.norm.weight.mul_(3.0)
        assert (await from_inst.generate(req(p, greedy(6)))).output_ids == want
        # a config.json (random init, seeded) and the tiny spec of the HTTP server factory
        (tmp_path / "config.json").write_text(json.dumps(DENSE))
        from_json = EmbeddedEngine.from_model(tmp_path / "config.json", num_threads=1, seed=3)
        assert (await from_json.generate(req(p, greedy(6)))).output_ids == want
        tiny = load_engine("tiny:qwen3_moe,num_experts=8", dtype="bfloat16", threads=1)
        assert tiny.is_moe and tiny.model.dtype == torch.bfloat16 and tiny.model.config.num_experts == 8
        res = await tiny.generate(req(prompt(5, 1), greedy(5), return_routed_experts=True))
        assert len(res.routed_experts) == 5 and max(max(r) for row in res.routed_experts for r in row) < 8
        for e in (base, from_dir, from_inst, from_json, tiny):
            await e.aclose()

    run(main())


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        EmbeddedEngine.from_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="unknown tiny model"):
        EmbeddedEngine.from_model("tiny:gpt9")
    with pytest.raises(ConfigError, match="model_type"):
        EmbeddedEngine.from_model({"hidden_size": 8})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no weights"):
        EmbeddedEngine.from_model(tmp_path / "empty")


@pytest.mark.parametrize("cfg", [
    dict(DENSE, use_sliding_window=True, sliding_window=6, max_window_layers=1),  # mixed full/sliding
    {**{k: v for k, v in DENSE.items() if k != "head_dim"}, "model_type": "mistral", "sliding_window": 6},
], ids=["qwen3-mixed", "mistral-all-sliding"])
def test_sliding_window_models_match_teacher_forcing(cfg: dict) -> None:
    async def main() -> None:
        eng = engine(cfg)
        p = prompt(12, 2)
        res = await eng.generate(req(p, greedy(20)))
        ref = teacher_forced(eng.model, p, res, greedy(20))
        assert max(abs(a - b) for a, b in zip(ref, res.output_logprobs)) < 1e-4
        await eng.aclose()

    run(main())

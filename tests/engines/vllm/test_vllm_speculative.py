"""Speculative decoding through a real vLLM (the CPU build, ``./dev.sh vllm``) on the real
SmolLM2-135M, typed as ``options.speculative`` (n-gram proposals, 4 tokens): one server start.

What the RL loop needs from it, checked against the model itself (the Hugging Face forward of the
same weights, teacher-forced over what vLLM returned):
- greedy: every token is the target's argmax (wherever the top two are not a near tie), batch 1
  and 8 requests at once, on prompts that copy from their context (where n-gram proposals land);
- T = 1: the recorded log-prob of each sampled token is the target's own log-softmax (the policy's
  distribution, not the proposer's), so TITO's guarantee holds with speculation on. (A speculative
  server records vLLM's raw log-probs: its processed ones come back NaN for some accepted tokens
  under speculation in vLLM 0.32; so a request at another temperature is refused, with the reason);
- proposals were made and accepted (vLLM's own ``spec_decode`` counters): speculation really ran;
- after a weight push (vLLM's weight-transfer API) the log-probs follow the new weights.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import pytest
import torch

from miles_engine.engines.fleet.config import EngineGroupConfig
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.engines.fleet.vllm_kind import VllmKind
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.vllm.options import VllmKindOptions, VllmSpeculativeOptions
from miles_engine.errors import EngineRequestError
from tests.engines.vllm.helpers import GGUF, IM_END, VLLM_MARKS

pytestmark = VLLM_MARKS
NEAR_TIE = 1e-2  # logits closer than this may order differently between two float32 kernels
COPY_PROMPTS = [
    "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape.",
    "Copy the line: the quick brown fox jumps over the lazy dog. Again: the quick brown fox",
    "Say the numbers 1 2 3 4 5 6 7 8 9 10 then say them again: 1 2 3",
    "ls -la /tmp/build/output/logs && cat /tmp/build/output/logs/error.log; ls -la /tmp/build/output/",
]


def _chat(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def _teacher_forced(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's logits at each position that sampled one of ``output``."""
    with torch.no_grad():
        return model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()


def _assert_greedy(model, prompt: list[int], output: list[int]) -> None:
    logits = _teacher_forced(model, prompt, output)
    top2 = logits.topk(2, -1)
    for i, token in enumerate(output):
        if top2.values[i, 0] - top2.values[i, 1] < NEAR_TIE:
            return  # a near tie may go either way; after it the sequences are not comparable
        assert token == int(top2.indices[i, 0]), f"token {i}: vLLM {token}, the target's argmax {int(top2.indices[i, 0])}"


def _assert_target_logprobs(model, prompt: list[int], output: list[int], logprobs: list[float]) -> None:
    expected = torch.log_softmax(_teacher_forced(model, prompt, output), -1).gather(1, torch.tensor(output)[:, None])[:, 0]
    assert logprobs == pytest.approx(expected.tolist(), abs=2e-3)


async def _spec_counters(base_url: str) -> tuple[float, float]:
    """(drafts, accepted tokens) from vLLM's /metrics."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        text = (await http.get("/metrics")).text

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    return total("vllm:spec_decode_num_drafts_total"), total("vllm:spec_decode_num_accepted_tokens_total")


def test_ngram_speculation_keeps_the_target_policy(tmp_path: Path) -> None:
    from miles_engine.models.loading import load_model
    from miles_engine.models.tokenizer import load_tokenizer
    from miles_engine.weights.broadcast import BroadcastTransport
    from miles_engine.weights.check.transport import CheckedTransport

    model, _ = load_model(str(GGUF), dtype="float32")
    model_dir = tmp_path / "hf"
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tok = load_tokenizer(str(GGUF))
    weights = {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}

    async def restore():
        return weights, 0

    spec = VllmSpeculativeOptions(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    prompts = [_chat(tok, p) for p in COPY_PROMPTS] * 2

    async def main() -> None:
        kind = VllmKind(VllmKindOptions(cpu_kv_cache_gib=1, max_model_len=2048, start_timeout_s=900, speculative=spec))
        ctx = FleetContext(model=str(model_dir), state_dir=tmp_path / "engines", seed=0, restore=restore)
        async with AsyncExitStack() as stack:
            [engine] = await kind.start(EngineGroupConfig(kind="vllm"), "vllm", ctx, stack)

            def greedy(prompt: list[int]) -> GenerateRequest:
                return GenerateRequest(prompt, SamplingParams(temperature=0.0, max_new_tokens=48, stop_token_ids=(IM_END,)))

            alone = await engine.generate(greedy(prompts[0]))
            _assert_greedy(model, prompts[0], alone.output_ids)
            batch = await asyncio.gather(*(engine.generate(greedy(p)) for p in prompts))
            for prompt, result in zip(prompts, batch):
                assert result.output_ids and result.weight_versions == [0] * len(result.output_ids)
                _assert_greedy(model, prompt, result.output_ids)
            drafts, accepted = await _spec_counters(engine.client.base_url)
            assert drafts > 0 and accepted > 0, f"no speculation ran (drafts {drafts}, accepted {accepted})"

            sampled = await asyncio.gather(*(engine.generate(GenerateRequest(p, SamplingParams(
                temperature=1.0, max_new_tokens=32, stop_token_ids=(IM_END,), seed=i))) for i, p in enumerate(prompts)))
            for prompt, result in zip(prompts, sampled):
                _assert_target_logprobs(model, prompt, result.output_ids, result.output_logprobs)

            with pytest.raises(EngineRequestError, match="temperature=0.7"):
                await engine.generate(GenerateRequest(prompts[0], SamplingParams(temperature=0.7, max_new_tokens=4)))

            # new weights through the weight-transfer API: log-probs follow them
            gen = torch.Generator().manual_seed(0)
            new = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in weights.items()}
            pusher = CheckedTransport(BroadcastTransport([engine], backend="gloo", bucket_bytes=64 << 20), [engine])
            stack.push_async_callback(pusher.close)
            await pusher.push(list(new.items()), 1)
            model.load_state_dict(new, strict=False)
            model.tie_weights()
            after = await engine.generate(GenerateRequest(prompts[1], SamplingParams(
                temperature=1.0, max_new_tokens=32, stop_token_ids=(IM_END,), seed=7)))
            assert after.weight_versions == [1] * len(after.output_ids)
            _assert_target_logprobs(model, prompts[1], after.output_ids, after.output_logprobs)
            drafts_after, accepted_after = await _spec_counters(engine.client.base_url)
            print(f"vLLM n-gram speculation: {drafts_after:.0f} drafts, acceptance length "
                  f"{1 + accepted_after / drafts_after:.2f}")

    asyncio.run(main())

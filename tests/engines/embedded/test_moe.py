"""MoE: routed-expert capture matches a reference forward with its own hooks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_engine.engines.protocol import SamplingParams
from miles_engine.errors import EngineRequestError

from .helpers import MOE, engine, greedy, prompt, req, run, teacher_forced


def reference_routing(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), moe_layers, top_k] from one full forward, hooking every layer's `mlp.gate`."""
    seen: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2]))
             for layer in model.model.layers]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1)


def test_routed_experts_match_reference_forward() -> None:
    async def main() -> None:
        eng = engine(MOE)
        assert eng.is_moe and eng.num_moe_layers == 2 and eng.moe_top_k == 2
        p = prompt(11, 0)
        sps = [greedy(14), SamplingParams(temperature=1.0, max_new_tokens=9, seed=4)]
        results = await asyncio.gather(*(eng.generate(req(p if i == 0 else prompt(7, 1), sp,
                                                          return_routed_experts=True))
                                         for i, sp in enumerate(sps)))
        for prompt_ids, sp, res in zip([p, prompt(7, 1)], sps, results):
            rows = torch.tensor(res.routed_experts)
            assert rows.shape == (len(res.output_ids), 2, 2)
            ref = reference_routing(eng.model, prompt_ids + res.output_ids[:-1])
            n = len(prompt_ids)
            assert torch.equal(rows, ref[n - 1 :].to(rows.dtype))
            assert torch.equal(torch.tensor(res.info["prompt_routed_experts"]), ref[: n - 1].to(rows.dtype))
            assert int(rows.min()) >= 0 and int(rows.max()) < 4
            lp = teacher_forced(eng.model, prompt_ids, res, sp)
            assert max(abs(a - b) for a, b in zip(lp, res.output_logprobs)) < 1e-4
        # not requested: not returned
        res = await eng.generate(req(p, greedy(3)))
        assert res.routed_experts is None
        await eng.aclose()

    run(main())


def test_routed_experts_with_session_prefix_reuse() -> None:
    async def main() -> None:
        eng = engine(MOE)
        row = prompt(15, 2)
        first = await eng.generate(req(row, greedy(6), session_id="m", return_routed_experts=True))
        row2 = row + first.output_ids + prompt(4, 3)
        res = await eng.generate(req(row2, greedy(6), session_id="m", return_routed_experts=True))
        assert res.cached_tokens == len(row) + 6 - 1
        ref = reference_routing(eng.model, row2 + res.output_ids[:-1])
        full = torch.tensor(res.info["prompt_routed_experts"] + res.routed_experts)
        assert torch.equal(full, ref.to(full.dtype))
        await eng.aclose()

    run(main())


def test_routed_experts_on_dense_model_is_an_error() -> None:
    async def main() -> None:
        eng = engine()
        assert not eng.is_moe and eng.num_moe_layers is None
        with pytest.raises(EngineRequestError, match="dense"):
            await eng.generate(req(prompt(5, 0), greedy(3), return_routed_experts=True))
        assert len((await eng.generate(req(prompt(5, 0), greedy(3)))).output_ids) == 3
        await eng.aclose()

    run(main())

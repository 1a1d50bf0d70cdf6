"""Shared-prompt cache: the attempts of a GRPO group prefill their common prompt once."""

from __future__ import annotations

import asyncio

import torch

from miles_engine.engines.protocol import SamplingParams

from .helpers import MOE, engine, greedy, prompt, req, run


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed)


async def admitted_together(eng, requests):
    """Queue every request while paused, then admit them in one engine iteration."""
    await eng.pause("in_place")
    tasks = [asyncio.create_task(eng.generate(r)) for r in requests]
    while eng.stats()["waiting"] < len(requests):
        await asyncio.sleep(0.002)
    await eng.resume()
    return await asyncio.gather(*tasks)


def test_a_group_prefills_its_prompt_once_with_the_same_samples() -> None:
    async def main() -> None:
        shared, other = prompt(30, 1), prompt(17, 2)
        group = [req(shared, sampled(8, seed=i)) for i in range(8)] + [req(other, sampled(8, seed=99))]
        eng, off = engine(), engine(prompt_cache_tokens=0)
        before = eng.stats()["prefill_tokens"]
        results = await admitted_together(eng, group)
        # one forward: the shared prompt and the other one, the repeats copy the first attempt's row
        assert eng.stats()["prefill_tokens"] - before == 30 + 17 and eng.stats()["prefill_forwards"] == 1
        assert [r.cached_tokens for r in results] == [0] + [30] * 7 + [0]
        assert [r.info["prompt_hit"] for r in results] == [False] + [True] * 7 + [False]
        st = eng.stats()
        assert st["prompt_cache_entries"] == 2
        references = await admitted_together(off, group)
        assert off.stats()["prefill_tokens"] == 8 * 30 + 17 and off.stats()["prompt_lookups"] == 0
        for res, ref in zip(results, references):  # same seeds: same samples, log-probs to float noise
            assert res.output_ids == ref.output_ids
            assert max(abs(a - b) for a, b in zip(res.output_logprobs, ref.output_logprobs)) < 1e-4
        # a later attempt of the group: the cached prompt KV, its last token prefilled
        late = await eng.generate(req(shared, sampled(8, seed=8)))
        assert late.cached_tokens == 29 and late.info["prompt_hit"]
        assert late.output_ids == (await off.generate(req(shared, sampled(8, seed=8)))).output_ids
        await eng.aclose()
        await off.aclose()

    run(main())


def test_later_requests_hit_until_the_weights_change() -> None:
    async def main() -> None:
        eng = engine()
        p = prompt(24, 5)
        first = await eng.generate(req(p, greedy(6)))
        again = await eng.generate(req(p, greedy(6)))
        assert (first.cached_tokens, again.cached_tokens) == (0, 23) and again.output_ids == first.output_ids
        # a session's own prefix comes first; its first turn may use the shared prompt
        turn = await eng.generate(req(p, greedy(6), session_id="s"))
        assert turn.info["prompt_hit"] and not turn.info["session_hit"] and turn.cached_tokens == 23
        tensors = {n: t + 0.01 for n, t in eng.model.state_dict().items() if n.endswith("norm.weight")}
        await eng.update_weights(tensors)
        assert eng.stats()["prompt_cache_entries"] == 0  # KV of the old weights is never reused
        after = await eng.generate(req(p, greedy(6)))
        assert after.cached_tokens == 0 and not after.info["prompt_hit"]
        fresh = engine()
        await fresh.update_weights(tensors)
        assert after.output_ids == (await fresh.generate(req(p, greedy(6)))).output_ids
        await eng.aclose()
        await fresh.aclose()

    run(main())


def test_bounded_and_switchable() -> None:
    async def main() -> None:
        eng = engine(prompt_cache_tokens=50)
        for i in range(4):
            await eng.generate(req(prompt(20, 10 + i), greedy(3)))
        st = eng.stats()
        assert st["prompt_cache_tokens"] <= 50 and st["prompt_cache_evictions"] >= 2
        assert (await eng.generate(req(prompt(20, 13), greedy(3)))).cached_tokens == 19  # newest kept
        assert (await eng.generate(req(prompt(20, 10), greedy(3)))).cached_tokens == 0  # oldest evicted
        off = engine(prompt_cache_tokens=0)
        await off.generate(req(prompt(20, 1), greedy(3)))
        assert (await off.generate(req(prompt(20, 1), greedy(3)))).cached_tokens == 0
        await eng.aclose()
        await off.aclose()

    run(main())


def test_moe_routing_of_a_shared_prompt_is_the_full_prefill_routing() -> None:
    async def main() -> None:
        eng, off = engine(MOE), engine(MOE, prompt_cache_tokens=0)
        p = prompt(15, 4)
        await eng.generate(req(p, greedy(5)))
        res = await eng.generate(req(p, greedy(5), return_routed_experts=True))
        ref = await off.generate(req(p, greedy(5), return_routed_experts=True))
        assert res.cached_tokens == 14 and res.output_ids == ref.output_ids
        assert torch.equal(torch.tensor(res.info["prompt_routed_experts"] + res.routed_experts),
                           torch.tensor(ref.info["prompt_routed_experts"] + ref.routed_experts))
        await eng.aclose()
        await off.aclose()

    run(main())

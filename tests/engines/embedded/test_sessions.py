"""Per-session prefix reuse: hits, identical outputs, mismatch fallback, LRU bound."""

from __future__ import annotations

import asyncio

from .helpers import engine, greedy, prompt, req, run


def test_eight_turn_session_reuses_prefix_with_identical_outputs() -> None:
    async def main() -> None:
        eng = engine(max_context=1024, prompt_cache_tokens=0)  # base: a real full prefill
        row = prompt(20, 0)
        turns = []
        for turn in range(8):
            res = await eng.generate(req(row, greedy(12), session_id="s1"))
            base = await eng.generate(req(row, greedy(12)))  # no session: full prefill
            assert res.output_ids == base.output_ids
            assert max(abs(a - b) for a, b in zip(res.output_logprobs, base.output_logprobs)) < 1e-4
            turns.append((len(row), res.cached_tokens, res.info["session_hit"]))
            row = row + res.output_ids + prompt(6, 100 + turn)  # next user message
        assert turns[0][1:] == (0, False)
        prev_len = 20
        for turn, (length, cached, hit) in enumerate(turns[1:], start=1):
            assert hit, turn
            assert cached == length - 6 - 1  # everything but the new message and the last output token
            prev_len = length
        assert abs(res.info["session_hit_rate"] - 7 / 8) < 1e-9  # engine-wide, at the last turn
        st = eng.stats()
        assert st["session_lookups"] == 8 and st["session_hits"] == 7
        assert abs(st["session_hit_rate"] - 7 / 8) < 1e-9 and st["session_token_hit_rate"] > 0.5
        assert prev_len > 100
        await eng.aclose()

    run(main())


def test_mismatch_falls_back_and_partial_prefix_is_exact() -> None:
    async def main() -> None:
        eng = engine(prompt_cache_tokens=0)
        row = prompt(30, 1)
        first = await eng.generate(req(row, greedy(8), session_id="s"))
        # diverges at token 10: reuse exactly the common 10 tokens
        other = row[:10] + prompt(15, 2)
        res = await eng.generate(req(other, greedy(8), session_id="s"))
        base = await eng.generate(req(other, greedy(8)))
        assert res.cached_tokens == 10 and res.output_ids == base.output_ids
        # diverges at token 0: full prefill
        fresh = prompt(12, 3)
        res = await eng.generate(req(fresh, greedy(8), session_id="s"))
        assert res.cached_tokens == 0 and not res.info["session_hit"]
        assert res.output_ids == (await eng.generate(req(fresh, greedy(8)))).output_ids
        # the same prompt again reuses all but its last token
        again = await eng.generate(req(fresh, greedy(8), session_id="s"))
        assert again.cached_tokens == len(fresh) - 1 and again.output_ids == res.output_ids
        # branching: two concurrent requests off the same session prefix both hit
        branch = fresh + again.output_ids
        a, b = await asyncio.gather(eng.generate(req(branch + [1, 2], greedy(5), session_id="s")),
                                    eng.generate(req(branch + [3, 4], greedy(5), session_id="s")))
        assert a.cached_tokens > 0 and b.cached_tokens > 0
        assert first.output_ids  # (kept for readability)
        await eng.aclose()

    run(main())


def test_session_cache_is_bounded_lru() -> None:
    async def main() -> None:
        eng = engine(session_cache_tokens=100)
        for i in range(6):
            await eng.generate(req(prompt(30, 10 + i), greedy(10), session_id=f"s{i}"))
        st = eng.stats()
        assert st["session_cache_tokens"] <= 100 and st["session_cache_evictions"] >= 3
        # the most recent session survived, the oldest did not
        newest = prompt(30, 15)
        res = await eng.generate(req(newest + [7], greedy(4), session_id="s5"))
        assert res.cached_tokens == 30
        res = await eng.generate(req(prompt(30, 10) + [7], greedy(4), session_id="s0"))
        assert res.cached_tokens == 0
        # reuse disabled entirely
        off = engine(session_cache_tokens=0)
        await off.generate(req(newest, greedy(4), session_id="x"))
        res = await off.generate(req(newest + [7], greedy(4), session_id="x"))
        assert res.cached_tokens == 0
        await eng.aclose()
        await off.aclose()

    run(main())


def test_cached_and_fresh_prompts_share_one_prefill_batch() -> None:
    """A session hit (long cached prefix, short suffix) and fresh prompts (long suffix) in
    one left-padded prefill: rows with holes must give the same tokens as running alone."""

    async def main() -> None:
        eng = engine(prompt_cache_tokens=0)
        row = prompt(40, 7)
        first = await eng.generate(req(row, greedy(5), session_id="h"))
        nxt = row + first.output_ids + prompt(3, 8)
        fresh = [prompt(25 + 4 * i, 20 + i) for i in range(3)]
        before = eng.stats()["prefill_forwards"]
        await eng.pause("in_place")  # queue all four, then admit them together
        tasks = [asyncio.create_task(eng.generate(req(nxt, greedy(10), session_id="h")))]
        tasks += [asyncio.create_task(eng.generate(req(f, greedy(10)))) for f in fresh]
        while eng.stats()["waiting"] < 4:
            await asyncio.sleep(0.002)
        await eng.resume()
        hit, *others = await asyncio.gather(*tasks)
        assert eng.stats()["prefill_forwards"] - before == 1 and hit.cached_tokens == 44
        assert hit.output_ids == (await eng.generate(req(nxt, greedy(10)))).output_ids
        for f, res in zip(fresh, others):
            assert res.output_ids == (await eng.generate(req(f, greedy(10)))).output_ids
        await eng.aclose()

    run(main())

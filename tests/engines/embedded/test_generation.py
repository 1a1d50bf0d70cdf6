"""Generation: log-probs vs teacher forcing, continuous batching, seeds, stops, abort."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from miles_engine.engines.embedded.sampler import RowParams, filtered_logprobs
from miles_engine.engines.protocol import RolloutEngine, SamplingParams

from .helpers import engine, greedy, prompt, req, run, teacher_forced, wait_for_tokens


def test_protocol_and_greedy_logprobs_match_teacher_forcing() -> None:
    async def main() -> None:
        eng = engine()
        assert isinstance(eng, RolloutEngine)
        p = prompt(12, 0)
        sp = greedy(24)
        res = await eng.generate(req(p, sp))
        assert res.finish_reason == "length" and len(res.output_ids) == 24
        assert res.prompt_tokens == 12 and res.weight_versions == [0] * 24
        ref = teacher_forced(eng.model, p, res, sp)
        assert max(abs(a - b) for a, b in zip(ref, res.output_logprobs)) < 1e-4
        # greedy = argmax of the teacher-forced logits
        ids = torch.tensor([p + res.output_ids[:-1]])
        with torch.inference_mode():
            arg = eng.model(input_ids=ids).logits[0, len(p) - 1 :].argmax(-1).tolist()
        assert arg == res.output_ids
        await eng.aclose()

    run(main())


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0.7, max_new_tokens=20, seed=1),
    SamplingParams(temperature=1.3, top_k=20, max_new_tokens=20, seed=2),
    SamplingParams(temperature=1.0, top_p=0.8, top_k=50, max_new_tokens=20, seed=3),
])
def test_sampled_logprobs_match_teacher_forcing(sp: SamplingParams) -> None:
    async def main() -> None:
        eng = engine()
        p = prompt(9, 1)
        res = await eng.generate(req(p, sp))
        ref = teacher_forced(eng.model, p, res, sp)
        assert max(abs(a - b) for a, b in zip(ref, res.output_logprobs)) < 1e-4
        assert all(math.isfinite(x) and x <= 0 for x in res.output_logprobs)
        await eng.aclose()

    run(main())


@pytest.mark.parametrize("vocab,scale", [(50, 3.0), (3000, 0.3), (3000, 8.0)])
def test_filtered_logprobs_against_naive_filtering(vocab: int, scale: float) -> None:
    """(3000, 0.3): so flat that the top-p nucleus reaches past the first 1024 candidates."""
    torch.manual_seed(0)
    logits = torch.randn(4, vocab) * scale
    params = [RowParams(0.0, 1.0, -1), RowParams(0.5, 1.0, 5), RowParams(1.0, 0.6, -1), RowParams(2.0, 0.9, 10)]
    got = filtered_logprobs(logits, params)
    alone = filtered_logprobs(logits[2:3], params[2:3])  # top-p only: the candidate path
    assert torch.equal(torch.isfinite(alone[0]), torch.isfinite(got[2]))
    for row, p in zip(range(4), params):
        if p.temperature == 0:
            want = torch.log_softmax(logits[row], -1)
        else:
            x = logits[row] / p.temperature
            order = x.argsort(descending=True).tolist()
            keep = order[: p.top_k] if p.top_k > 0 else order
            probs = torch.softmax(x[keep], -1)
            kept, mass = [], 0.0
            for tok, pr in zip(keep, probs.tolist()):
                if mass >= p.top_p:
                    break
                kept.append(tok)
                mass += pr
            want = torch.full_like(x, float("-inf"))
            want[kept] = torch.log_softmax(x[kept], -1)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got[row]))
        assert torch.allclose(got[row][finite], want[finite], atol=1e-5)


def test_continuous_batching_matches_one_at_a_time() -> None:
    async def main() -> None:
        eng = engine(max_batch_size=6)
        reqs = [req(prompt(3 + 5 * i, 10 + i), greedy(4 + 7 * i)) for i in range(10)]
        together = await asyncio.gather(*(eng.generate(r) for r in reqs))
        stats = eng.stats()
        assert stats["mean_batch"] > 2 and stats["prefill_forwards"] < len(reqs)
        alone = [await eng.generate(req(list(r.input_ids), r.sampling)) for r in reqs]
        for a, b, r in zip(together, alone, reqs):
            assert a.output_ids == b.output_ids
            assert len(a.output_ids) == r.sampling.max_new_tokens
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
        await eng.aclose()

    run(main())


def test_requests_join_a_running_batch_and_leave_when_done() -> None:
    async def main() -> None:
        eng = engine(max_batch_size=4)
        long = asyncio.create_task(eng.generate(req(prompt(5, 1), greedy(150))))
        await wait_for_tokens(eng, 10)
        shorts = [asyncio.create_task(eng.generate(req(prompt(4 + i, 2 + i), greedy(3 + i)))) for i in range(8)]
        done = await asyncio.gather(*shorts)
        assert not long.done()  # the short ones finished while the long one kept decoding
        assert [len(r.output_ids) for r in done] == [3 + i for i in range(8)]
        res = await long
        assert len(res.output_ids) == 150
        assert eng.stats()["running"] == 0
        await eng.aclose()

    run(main())


def test_seed_reproducibility_independent_of_batch() -> None:
    async def main() -> None:
        eng = engine()
        sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=1234)
        p = prompt(6, 3)
        alone = await eng.generate(req(p, sp))
        noise = [req(prompt(5, 50 + i), SamplingParams(temperature=1.0, max_new_tokens=10 + i)) for i in range(5)]
        crowd = await asyncio.gather(eng.generate(req(p, sp)), *(eng.generate(r) for r in noise))
        assert crowd[0].output_ids == alone.output_ids
        other = await eng.generate(req(p, sp.model_copy(update={"seed": 99})))
        assert other.output_ids != alone.output_ids
        await eng.aclose()

    run(main())


def test_stop_tokens_eos_and_context_limit() -> None:
    async def main() -> None:
        eng = engine(max_context=40)
        p = prompt(8, 4)
        first = await eng.generate(req(p, greedy(10)))
        stop = first.output_ids[3]
        cut = first.output_ids.index(stop)
        res = await eng.generate(req(p, greedy(10, stop_token_ids=(stop,))))
        assert res.finish_reason == "stop" and res.output_ids == first.output_ids[: cut + 1]
        # the model's eos counts as a stop token
        eng.eos_token_ids = frozenset({stop})
        res = await eng.generate(req(p, greedy(10)))
        assert res.finish_reason == "stop" and res.output_ids[-1] == stop
        eng.eos_token_ids = frozenset()
        # prompt + output never exceeds the context
        res = await eng.generate(req(prompt(30, 5), greedy(100)))
        assert res.finish_reason == "length" and len(res.output_ids) == 10
        await eng.aclose()

    run(main())


def test_abort_request_and_cancelled_caller() -> None:
    async def main() -> None:
        eng = engine()
        r = req(prompt(5, 6), greedy(400))
        task = asyncio.create_task(eng.generate(r))
        await wait_for_tokens(eng, 5)
        assert await eng.abort(r.request_id)
        res = await task
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 400
        assert len(res.weight_versions) == len(res.output_ids) == len(res.output_logprobs)
        assert not await eng.abort("no-such-request")
        # a cancelled caller frees its row
        task = asyncio.create_task(eng.generate(req(prompt(5, 7), greedy(400))))
        await wait_for_tokens(eng, eng.stats()["output_tokens"] + 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if eng.stats()["running"] == 0:
                break
            await asyncio.sleep(0.005)
        assert eng.stats()["running"] == 0
        ok = await eng.generate(req(prompt(5, 8), greedy(3)))
        assert len(ok.output_ids) == 3 and await eng.health()
        await eng.aclose()
        assert not await eng.health()

    run(main())


def test_return_logprob_false_and_close_aborts_inflight() -> None:
    async def main() -> None:
        eng = engine()
        res = await eng.generate(req(prompt(5, 9), greedy(4), return_logprob=False))
        assert res.output_logprobs == [] and len(res.weight_versions) == 4
        task = asyncio.create_task(eng.generate(req(prompt(5, 9), greedy(1000))))
        await wait_for_tokens(eng, 10)
        await eng.aclose()
        res = await task
        assert res.finish_reason == "abort"
        from miles_engine.engines.errors import EngineUnavailable

        with pytest.raises(EngineUnavailable):
            await eng.generate(req(prompt(5, 9), greedy(4)))

    run(main())


def test_sampler_draws_follow_the_filtered_distribution() -> None:
    from miles_engine.engines.embedded.sampler import sample

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(6000, 1)
    params = [RowParams(0.8, 0.9, 4)] * 6000
    gens = [torch.Generator().manual_seed(i) for i in range(6000)]
    tokens, logprobs = sample(logits, params, gens)
    want = filtered_logprobs(logits[:1], params[:1])[0].exp()
    counts = torch.bincount(torch.tensor(tokens), minlength=6).float() / 6000
    assert torch.all(counts[want == 0] == 0)  # filtered-out tokens are never drawn
    assert torch.allclose(counts, want, atol=0.02)
    assert all(abs(lp - want[t].log().item()) < 1e-5 for t, lp in zip(tokens[:50], logprobs[:50]))


def test_churn_of_joins_and_leaves_keeps_every_row_exact() -> None:
    """Many requests of random prompt and output lengths through a small batch: rows join,
    leave, get swapped and the buffer grows; each output must equal its solo run."""
    import random

    async def main() -> None:
        rng = random.Random(0)
        eng = engine(max_batch_size=5, max_prefill_tokens=64)
        reqs = [req(prompt(rng.randint(1, 60), 200 + i), greedy(rng.randint(1, 40))) for i in range(30)]
        together = await asyncio.gather(*(eng.generate(r) for r in reqs))
        solo = engine()
        for r, got in zip(reqs, together):
            want = await solo.generate(req(list(r.input_ids), r.sampling))
            assert got.output_ids == want.output_ids
            assert max(abs(a - b) for a, b in zip(got.output_logprobs, want.output_logprobs)) < 1e-4
        assert eng.stats()["running"] == 0 and eng.stats()["finished"] == 30
        await eng.aclose()
        await solo.aclose()

    run(main())

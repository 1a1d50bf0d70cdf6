"""Speculative decoding at T > 0: the emitted tokens are distributed as plain sampling's, and their
log-probs are the policy's (teacher-forced, filtered), never the proposer's."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from miles_engine.engines.embedded.sampler import RowParams, filtered_logprobs
from miles_engine.engines.embedded.verify import verify
from miles_engine.engines.protocol import SamplingParams

from .helpers import DENSE, engine, greedy, prompt, req, run, teacher_forced

torch.set_num_threads(1)

SMALL = dict(DENSE, vocab_size=12, initializer_range=0.2)  # ~6.5 effective tokens per position at T=1
SMALL_DRAFT = dict(SMALL, num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)


async def echo_prompt(eng, base: list[int], n: int = 12) -> list[int]:
    """``base`` + the policy's greedy continuation, twice: text the policy is likely to repeat
    (n-gram proposals then get accepted, as on terminal output copied from context)."""
    g = await eng.generate(req(base, greedy(n)))
    return (base + g.output_ids) * 2


def chi2_sf(x: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def exact_three_tokens(model, p: list[int], params: RowParams) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under plain sampling ([V, V, V]), from one teacher-forced forward
    over every (t1, t2) continuation with the sampler's own filtering."""
    vocab = model.config.vocab_size
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    ids = torch.cat([torch.tensor(p).expand(len(pairs), -1), pairs], 1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[:, len(p) - 1 :].float()  # [V*V, 3, V]
    lp = filtered_logprobs(logits.reshape(-1, vocab), [params] * logits.shape[0] * 3).reshape(-1, 3, vocab)
    p1 = lp[0, 0].exp()
    p2 = lp[:, 1].exp().reshape(vocab, vocab, vocab)[:, 0, :]  # t2 | t1 (row t1, any t2 gives the same)
    p3 = lp[:, 2].exp().reshape(vocab, vocab, vocab)  # t3 | t1, t2
    return (p1[:, None, None] * p2[:, :, None] * p3).double()


def chi_square_test(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness of fit; cells expected below ``min_expected`` are pooled into one.
    Returns (statistic, degrees of freedom, p-value)."""
    n = counts.sum()
    expected = probs.flatten() * n
    counts = counts.flatten().double()
    big = expected >= min_expected
    exp_cells = torch.cat([expected[big], expected[~big].sum()[None]])
    obs_cells = torch.cat([counts[big], counts[~big].sum()[None]])
    keep = exp_cells > 0
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    df = int(keep.sum()) - 1
    return stat, df, chi2_sf(stat, df)


@pytest.mark.parametrize("method,sp", [
    ("ngram", SamplingParams(temperature=1.0, max_new_tokens=3)),
    ("draft", SamplingParams(temperature=1.0, max_new_tokens=3)),
    ("draft", SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3)),
], ids=["ngram-T1", "draft-T1", "draft-T0.7-top_p0.9"])
def test_first_three_tokens_are_distributed_as_plain_sampling(method: str, sp: SamplingParams) -> None:
    """Goodness of fit of the joint (t1, t2, t3) of N = 3000 seeded requests against the exact
    plain-sampling distribution (teacher-forced, the sampler's filtering; plain sampling follows it,
    see test_generation). t1 comes from the prefill; t2 and t3 from the first verify step (k = 2),
    so they cover acceptance, the residual draw after a rejection and the policy's bonus token.

    Power (computed with a noncentral chi-square, 200k draws): Pearson's statistic over the
    cells expected >= 5 times plus one pooled cell (df = 75 for top-p, 126 at T=1), rejected at
    p < 1e-3 — the false-alarm rate of a correct sampler. With N = 3000 the noncentrality is
    N * w^2 (Cohen's w); the 1e-3 critical values are 119 (df 75) and 181 (df 126), exceeded with
    probability 0.9 at N * w^2 = 70 and 85: any deviation with w >= 0.17 is caught 9 times in 10.
    Since w >= 2 * TV (Cauchy-Schwarz), that is every deviation of total variation >= 0.085 over
    these cells. The naive schemes (emit the proposal unconditionally; re-draw from p after a
    rejection) are off by TV > 0.1 on one token alone: see
    test_verify_rejection_scheme_is_exact_and_the_naive_ones_are_not."""
    n = 3000
    spec = dict(method=method, num_tokens=2, draft_model=SMALL_DRAFT if method == "draft" else None)

    async def main() -> tuple[torch.Tensor, torch.Tensor, dict]:
        eng = engine(SMALL, speculative=spec, max_batch_size=64)
        p = await echo_prompt(eng, [1, 2, 3], 9)
        res = await asyncio.gather(*(eng.generate(req(p, sp.model_copy(update={"seed": 1000 + i})))
                                     for i in range(n)))
        counts = torch.zeros(12, 12, 12)
        for r in res:
            a, b, c = r.output_ids
            counts[a, b, c] += 1
        probs = exact_three_tokens(eng.model, p, RowParams(sp.temperature, sp.top_p, sp.top_k))
        stats = eng.stats()
        await eng.aclose()
        return counts, probs, stats

    counts, probs, stats = run(main(), timeout=120)
    assert stats["spec_proposed_tokens"] > 1000 and 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    stat, df, pvalue = chi_square_test(counts, probs)
    assert df >= 30, df  # enough cells for the power stated above
    assert pvalue > 1e-3, (stat, df, pvalue)


def _naive_variants(logits, proposals, q_logp, params, u):
    """What verify would emit for t1 if it (a) always accepted or (b) re-drew from p on rejection."""
    first = torch.tensor([p[0] for p in proposals])
    always = first
    p0 = filtered_logprobs(logits[:, 0], params)
    redraw = torch.multinomial(p0.exp(), 1, generator=torch.Generator().manual_seed(5)).squeeze(1)
    ratio = (p0.gather(1, first[:, None]).squeeze(1) - q_logp[:, 0].gather(1, first[:, None]).squeeze(1)).exp()
    accept = u[:, 0] < ratio
    return always, torch.where(accept, first, redraw)


def test_verify_rejection_scheme_is_exact_and_the_naive_ones_are_not() -> None:
    """:func:`verify` on 100k rows with one fixed (p, q) pair over 6 tokens: the first emitted
    token's frequencies match p to a total variation of < 0.01 (the sampling noise at this N is
    ~0.003), while always accepting, or re-drawing from p after a rejection, is off by > 0.1."""
    torch.manual_seed(0)
    rows, vocab = 100_000, 6
    target = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    draft = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 0.0])
    params = [RowParams(1.0, 1.0, -1)] * rows
    logits = target.expand(rows, 2, vocab).clone()
    q_logp = torch.log_softmax(draft, -1).expand(rows, 1, vocab).clone()
    g = torch.Generator().manual_seed(1)
    proposals = torch.multinomial(q_logp[:, 0].exp(), 1, generator=g).tolist()
    u = torch.rand(rows, 2, generator=g)
    out = verify(logits, proposals, q_logp, params, u)
    first = torch.tensor([t[0] for t in out.tokens])
    p = torch.softmax(target, -1)
    tv = lambda toks: 0.5 * float((torch.bincount(toks, minlength=vocab) / rows - p).abs().sum())  # noqa: E731
    assert tv(first) < 0.01
    always, redraw = _naive_variants(logits, proposals, q_logp, params, u)
    assert tv(always) > 0.1 and tv(redraw) > 0.1
    # n-gram (point-mass q): accept x with p(x), else draw from p without x
    out = verify(logits, [[2]] * rows, None, params, u)
    assert tv(torch.tensor([t[0] for t in out.tokens])) < 0.01
    # the log-prob of every emitted token is the policy's
    lp = torch.log_softmax(target, -1)
    assert all(abs(lp[t] - v) < 1e-6 for toks, lps in zip(out.tokens[:500], out.logprobs[:500])
               for t, v in zip(toks, lps))


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0, max_new_tokens=32),
                                SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=32)],
                         ids=["T1", "T0.7-top_p-top_k"])
def test_sampled_logprobs_are_the_policys_teacher_forced_ones(method: str, sp: SamplingParams) -> None:
    """On the 12-token model, where proposals (even n-gram ones) are often accepted at T > 0."""
    spec = dict(method=method, num_tokens=4, draft_model=SMALL_DRAFT if method == "draft" else None)

    async def main() -> None:
        eng = engine(SMALL, speculative=spec)
        prompts = [await echo_prompt(eng, prompt(4, s, vocab=12)) for s in range(4)]
        before = eng.stats()["spec_accepted_tokens"]
        res = await asyncio.gather(*(eng.generate(req(p, sp.model_copy(update={"seed": s})))
                                     for s, p in enumerate(prompts)))
        for p, r in zip(prompts, res):
            ref = teacher_forced(eng.model, p, r, sp)
            assert len(r.output_ids) == 32
            assert max(abs(a - b) for a, b in zip(ref, r.output_logprobs)) < 1e-5
            assert all(math.isfinite(x) for x in r.output_logprobs)
        assert eng.stats()["spec_accepted_tokens"] - before >= 4  # accepted proposals' log-probs checked too
        # a seeded request is reproducible with speculation on, alone or in a batch
        again = await eng.generate(req(prompts[2], sp.model_copy(update={"seed": 2})))
        assert again.output_ids == res[2].output_ids
        await eng.aclose()

    run(main())

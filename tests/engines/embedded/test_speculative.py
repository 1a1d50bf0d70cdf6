"""Speculative decoding in the embedded engine: greedy output identical to plain decoding (n-gram,
a different draft, the policy as its own draft; batch 1 and 32; prompt cache and sessions),
stops and lengths, abort, weight updates, R3 routing, true on-policy, and refused options."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from miles_engine.engines.embedded.kv_cache import RaggedKV
from miles_engine.engines.embedded.options import EmbeddedEngineOptions
from miles_engine.engines.embedded.sampler import RowParams, filtered_logprobs
from miles_engine.engines.protocol import SamplingParams
from miles_engine.errors import ConfigError

from .helpers import DENSE, MOE, engine, greedy, prompt, req, run, teacher_forced, wait_for_tokens
from .test_control import perturbed, split_at_switch
from .test_moe import reference_routing

torch.set_num_threads(1)

LOOPY = dict(DENSE, initializer_range=0.6)  # peaked: greedy text repeats itself, n-gram proposals get accepted
OTHER_DRAFT = dict(LOOPY, num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)


SPECS: dict[str, dict[str, Any]] = {
    "ngram": dict(method="ngram", num_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3),
    "draft": dict(method="draft", num_tokens=3),  # draft_model: the noisy_policy fixture
    "self-draft": dict(method="draft", num_tokens=5, draft_model=LOOPY),  # same config and seed: the policy
}


@pytest.fixture(scope="module")
def noisy_policy(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A draft that is neither the policy nor unrelated: its weights plus noise, saved as a
    Hugging Face directory (so the draft is loaded from a path, as in a recipe)."""
    from miles_engine.models.loading import load_model

    model, _ = load_model(LOOPY)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for t in model.parameters():
            t.add_(0.15 * t.std() * torch.randn(t.shape, generator=g))
    path = tmp_path_factory.mktemp("draft")
    model.save_pretrained(path)
    return str(path)


def spec_of(name: str, noisy_policy: str) -> dict[str, Any]:
    return dict(SPECS[name], draft_model=noisy_policy) if name == "draft" else SPECS[name]


def close(a, b, tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) < tol for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_is_plain_decoding(name: str, noisy_policy: str) -> None:
    """Batch 1, then 32 concurrent requests (groups of 4 sharing a prompt: prompt-cache hits),
    the same 32 again (every prompt now cached), and a three-turn session."""
    async def main() -> None:
        plain = engine(LOOPY, max_batch_size=32)
        spec = engine(LOOPY, max_batch_size=32, speculative=spec_of(name, noisy_policy))
        try:
            one = req(prompt(9, 0), greedy(40))
            a, b = await plain.generate(one), await spec.generate(one)
            assert a.output_ids == b.output_ids and close(a.output_logprobs, b.output_logprobs)
            batch = [req(prompt(5 + (i // 4) % 7, i // 4), greedy(10 + 3 * (i % 5))) for i in range(32)]
            for _ in range(2):
                want = await asyncio.gather(*(plain.generate(r) for r in batch))
                got = await asyncio.gather(*(spec.generate(r) for r in batch))
                for x, y in zip(want, got):
                    assert x.output_ids == y.output_ids and close(x.output_logprobs, y.output_logprobs)
                    assert x.finish_reason == y.finish_reason == "length"
            assert spec.stats()["prompt_hits"] >= 32  # the second round: every prompt cached
            rows = {e: prompt(12, 50) for e in ("plain", "spec")}
            for turn in range(3):
                x = await plain.generate(req(rows["plain"], greedy(16), session_id="s"))
                y = await spec.generate(req(rows["spec"], greedy(16), session_id="s"))
                assert x.output_ids == y.output_ids and close(x.output_logprobs, y.output_logprobs)
                assert x.cached_tokens == y.cached_tokens and (turn == 0 or y.info["session_hit"])
                for e, res in (("plain", x), ("spec", y)):
                    rows[e] = rows[e] + res.output_ids + prompt(4, 60 + turn)
            st = spec.stats()
            assert st["spec_verify_steps"] > 0 and st["spec_accepted_tokens"] > 0
            assert st["spec_acceptance_length"] == pytest.approx(
                (st["spec_accepted_tokens"] + st["spec_verify_rows"]) / st["spec_verify_rows"])
            if name == "self-draft":
                assert st["spec_acceptance_rate"] == 1.0
        finally:
            await plain.aclose()
            await spec.aclose()

    run(main(), timeout=120)


def test_stop_ids_and_max_new_tokens_are_exact_inside_accepted_runs() -> None:
    """The policy as its own draft accepts every proposal (5 per step), so each stop lands
    inside an accepted run: nothing past it is emitted."""
    async def main() -> None:
        eng = engine(LOOPY, speculative=SPECS["self-draft"])
        p = prompt(7, 3)
        ref = (await eng.generate(req(p, greedy(30)))).output_ids
        for n in range(1, 13):
            res = await eng.generate(req(p, greedy(n)))
            assert res.output_ids == ref[:n] and res.finish_reason == "length"
        for i in range(1, 12):
            stop = ref[i]
            first = ref.index(stop)
            res = await eng.generate(req(p, greedy(30, stop_token_ids=[stop])))
            assert res.output_ids == ref[: first + 1] and res.finish_reason == "stop"
        await eng.aclose()

    run(main())


def test_abort_mid_speculation_keeps_the_batch_consistent(noisy_policy: str) -> None:
    async def main() -> None:
        eng = engine(LOOPY, max_batch_size=8, speculative=spec_of("draft", noisy_policy))
        p, q = prompt(8, 4), prompt(10, 5)
        ref_p = (await eng.generate(req(p, greedy(300)))).output_ids
        ref_q = (await eng.generate(req(q, greedy(60)))).output_ids
        long = asyncio.create_task(eng.generate(req(p, greedy(300), request_id="long")))
        other = asyncio.create_task(eng.generate(req(q, greedy(60))))
        await wait_for_tokens(eng, 360 + 20)
        assert await eng.abort("long")
        res = await long
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 300
        assert res.output_ids == ref_p[: len(res.output_ids)]
        assert (await other).output_ids == ref_q
        again = await eng.generate(req(q, greedy(60)))  # the draft dropped the aborted row
        assert again.output_ids == ref_q and len(eng._speculator.proposer.rows) <= 1
        await eng.aclose()

    run(main())


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_weight_update_between_speculative_steps(mode: str, noisy_policy: str) -> None:
    async def main() -> None:
        eng = engine(LOOPY, speculative=spec_of("draft", noisy_policy))
        old_model = copy.deepcopy(eng.model)
        p, sp = prompt(10, 0), greedy(150)
        task = asyncio.create_task(eng.generate(req(p, sp)))
        await wait_for_tokens(eng, 10)
        await eng.pause(mode)
        assert await eng.update_weights(perturbed(eng, scale=0.2)) == 1
        await eng.resume()
        res = await task
        assert res.finish_reason == "length" and len(res.output_ids) == 150
        k = split_at_switch(res.weight_versions)
        assert res.weight_versions[0] == 0 and res.weight_versions[-1] == 1 and 10 <= k < 150
        assert close(teacher_forced(old_model, p, res, sp)[:k], res.output_logprobs[:k])
        if mode == "retract":  # re-prefilled on the new weights: the new policy's tokens exactly
            assert close(teacher_forced(eng.model, p, res, sp)[k:], res.output_logprobs[k:])
        # the draft kept its own weights and cache: later requests are the new policy's greedy text
        fresh = await eng.generate(req(prompt(6, 9), greedy(20)))
        assert close(teacher_forced(eng.model, prompt(6, 9), fresh, greedy(20)), fresh.output_logprobs)
        await eng.aclose()

    run(main())


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_routed_experts_are_recorded_for_accepted_tokens_only(name: str) -> None:
    moe = dict(MOE, initializer_range=0.6)
    spec = dict(SPECS[name], draft_model=moe) if name == "draft" else SPECS[name]  # the MoE policy as its draft

    async def main() -> None:
        eng = engine(moe, speculative=spec)
        p = prompt(11, 0)
        first = await eng.generate(req(p, greedy(30), return_routed_experts=True, session_id="m"))
        row = p + first.output_ids + prompt(3, 7)
        second = await eng.generate(req(row, greedy(20), return_routed_experts=True, session_id="m"))
        assert second.info["session_hit"]
        for ids, res in ((p, first), (row, second)):
            ref = reference_routing(eng.model, ids + res.output_ids[:-1])
            n = len(ids)
            assert torch.equal(torch.tensor(res.routed_experts), ref[n - 1 :].to(torch.int32))
            assert torch.equal(torch.tensor(res.info["prompt_routed_experts"]), ref[: n - 1].to(torch.int32))
        assert eng.stats()["spec_accepted_tokens"] > 0
        await eng.aclose()

    run(main())


def test_true_on_policy_with_speculation_is_bit_exact() -> None:
    """Batch-invariant numerics make a verify forward over k + 1 tokens compute every token's
    log-prob exactly as one full teacher-forced forward (the trainer's) does: ``==``, not close."""
    async def main() -> None:
        eng = engine(LOOPY, true_on_policy=True, speculative=SPECS["self-draft"])
        sps = [greedy(24), SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, seed=3)]
        for i, sp in enumerate(sps):
            p = prompt(9, 20 + i)
            res = await eng.generate(req(p, sp))
            ids = torch.tensor([p + res.output_ids[:-1]])
            with torch.inference_mode():
                logits = eng.model(input_ids=ids).logits[0, len(p) - 1 :]
            lp = filtered_logprobs(logits, [RowParams(sp.temperature, sp.top_p, sp.top_k)] * logits.shape[0],
                                   invariant=True)
            assert lp.gather(1, torch.tensor(res.output_ids)[:, None]).squeeze(1).tolist() == res.output_logprobs
        assert eng.stats()["spec_accepted_tokens"] > 10
        await eng.aclose()

    run(main())


def test_kv_rollback_and_compaction_keep_every_rows_tokens() -> None:
    kv = RaggedKV(1, device="cpu", dtype=torch.float32)
    kv.load_prefix([None, None])
    steps = [(3, [2, 3]), (4, [1, 4]), (2, [2, 1])]
    expected: list[list[float]] = [[], []]
    for step, (q, keep) in enumerate(steps):
        valid = torch.ones(2, q, dtype=torch.bool)
        pos = torch.tensor([[len(expected[r]) + j for j in range(q)] for r in range(2)])
        kv.begin_forward(valid, pos)
        values = torch.arange(2 * q, dtype=torch.float32).reshape(2, 1, q, 1) + 100 * step
        kv._write(0, values, values)
        kv.end_forward()
        kv.keep_new(keep, q)
        for r in range(2):
            expected[r] += values[r, 0, : keep[r], 0].tolist()
    assert kv.width > max(len(e) for e in expected)  # holes
    for r in range(2):
        assert kv.row_tokens(r)[0][0][0, :, 0].tolist() == expected[r]
    kv.compact()
    assert kv.width == max(len(e) for e in expected)
    for r in range(2):
        keys, _, pos = kv.row_tokens(r)
        assert keys[0][0, :, 0].tolist() == expected[r] and pos.tolist() == list(range(len(expected[r])))


@pytest.mark.parametrize("bad,match", [
    (dict(method="eagle"), "method"),
    (dict(method="ngram", num_tokens=0), "num_tokens"),
    (dict(method="ngram", num_tokens=17), "num_tokens"),
    (dict(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(method="draft"), "needs draft_model"),
    (dict(method="ngram", draft_model="tiny:qwen3"), "only read by method 'draft'"),
    (dict(method="ngram", lookahead=3), "lookahead"),
])
def test_bad_options_are_refused_with_one_clear_error(bad: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match) as info:
        EmbeddedEngineOptions(speculative=bad)
    assert len(info.value.errors()) == 1


def test_a_draft_on_another_vocabulary_or_missing_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="vocabulary of 256 tokens.*policy's has 512.*tokenizer"):
        engine(speculative=dict(method="draft", draft_model=dict(OTHER_DRAFT, vocab_size=256)))
    with pytest.raises(ConfigError, match="could not be loaded"):
        engine(speculative=dict(method="draft", draft_model="/nonexistent/draft"))


def test_ngram_index_is_the_reference_lookup() -> None:
    from miles_engine.engines.embedded.proposers import NgramIndex, ngram_lookup

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()
    index = NgramIndex(1, 4)
    for length in range(1, 300, 3):  # grows by a few tokens at a time, as a sequence does
        seen = tokens[:length]
        assert index.propose(seen, 5) == ngram_lookup(torch.tensor(seen), 1, 4, 5), length


def test_fp8_kv_cache_greedy_output_is_plain_decoding() -> None:
    """The verify forward stores (and attends) the fed tokens' KV as E4M3 exactly as decode steps do."""
    async def main() -> None:
        plain = engine(LOOPY, kv_cache="fp8")
        spec = engine(LOOPY, kv_cache="fp8", speculative=SPECS["ngram"])
        reqs = [req(prompt(6 + i, 70 + i), greedy(32)) for i in range(4)]
        want = await asyncio.gather(*(plain.generate(r) for r in reqs))
        got = await asyncio.gather(*(spec.generate(r) for r in reqs))
        assert [w.output_ids for w in want] == [g.output_ids for g in got]
        assert all(close(w.output_logprobs, g.output_logprobs) for w, g in zip(want, got))
        assert spec.stats()["spec_accepted_tokens"] > 0
        await plain.aclose()
        await spec.aclose()

    run(main())


def test_a_push_can_update_the_draft_too(noisy_policy: str) -> None:
    """The co-trained draft's engine-side hook: ``draft.*`` tensors in an update go to the draft
    (checked against it; its cache is dropped); the policy's output never changes with them."""
    from miles_engine.errors import WeightUpdateError

    async def main() -> None:
        eng = engine(LOOPY, speculative=spec_of("draft", noisy_policy))
        p = prompt(9, 30)
        before = await eng.generate(req(p, greedy(40)))
        st0 = eng.stats()
        assert st0["spec_acceptance_rate"] < 1.0
        policy = {m.name: eng.model.state_dict()[m.name].clone() for m in eng.weight_metadata()}
        names = {m.name for m in eng.draft_weight_metadata()}
        assert names == {"draft." + n for n in policy}
        # a draft-only push: the draft becomes the policy, the policy and its version stay
        assert await eng.update_weights({"draft." + n: t for n, t in policy.items()}) == 0
        after = await eng.generate(req(p, greedy(40)))
        st1 = eng.stats()
        assert after.output_ids == before.output_ids and st1["spec_draft_updates"] == 1
        assert st1["spec_accepted_tokens"] - st0["spec_accepted_tokens"] == \
            st1["spec_proposed_tokens"] - st0["spec_proposed_tokens"] > 0
        # policy and draft in one push (the version moves); a mismatched draft tensor: nothing changes
        new = perturbed(eng, scale=0.1)
        assert await eng.swap_weights({**new, **{"draft." + n: t for n, t in new.items()}}) == 1
        first = next(iter(new))
        with pytest.raises(WeightUpdateError, match="shape"):
            await eng.update_weights({first: new[first], "draft." + first: new[first][:1]})
        assert eng.weight_version == 1
        await eng.aclose()
        plain = engine(LOOPY, speculative=SPECS["ngram"])
        with pytest.raises(WeightUpdateError, match="no draft model"):
            await plain.update_weights({"draft." + first: new[first]})
        await plain.aclose()

    run(main())


@pytest.mark.parametrize("float_mask", [False, True])
def test_packed_gqa_attention_is_transformers_sdpa(float_mask: bool) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from miles_engine.engines.embedded.attention import packed_gqa_sdpa

    class Module:
        num_key_value_groups = 3

    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 5, 9, 16, generator=g).transpose(1, 2)  # [b, heads, q, d], not contiguous
    key, value = torch.randn(2, 3, 40, 16, generator=g), torch.randn(2, 3, 40, 16, generator=g)
    mask = torch.rand(2, 1, 5, 40, generator=g) > 0.3
    mask[..., -5:] |= torch.eye(5, dtype=torch.bool)
    if float_mask:
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    got, _ = packed_gqa_sdpa(Module(), query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(Module(), query, key, value, mask, scaling=0.25)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)


def test_a_row_whose_proposals_keep_failing_backs_off() -> None:
    from miles_engine.engines.embedded.speculative import Backoff

    b = Backoff()
    allowed = []
    for _ in range(40):
        ok = b.allows()
        allowed.append(ok)
        b.record(4 if ok else 0, 0)  # every proposal rejected
    # two misses, then waits of 1, 2, 4, 8, 16 steps between tries
    assert [i for i, ok in enumerate(allowed) if ok] == [0, 1, 3, 6, 11, 20, 37]
    b.record(4, 2)
    assert b.misses == 0

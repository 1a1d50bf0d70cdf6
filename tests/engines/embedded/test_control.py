"""Pause modes, per-token weight versions, weight updates (tensors, safetensors, refusals)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch

from miles_engine.errors import WeightUpdateError

from .helpers import engine, greedy, prompt, req, run, teacher_forced, wait_for_tokens


def perturbed(eng, scale: float = 0.05, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for meta in eng.weight_metadata():
        t = eng.model.state_dict()[meta.name]
        out[meta.name] = t + scale * torch.randn(t.shape, generator=g, dtype=t.dtype)
    return out


def split_at_switch(versions: list[int]) -> int:
    k = versions.index(versions[-1])
    assert all(v == versions[0] for v in versions[:k]) and all(v == versions[-1] for v in versions[k:])
    return k


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_per_token_versions_across_update(mode: str) -> None:
    async def main() -> None:
        eng = engine()
        old_model = copy.deepcopy(eng.model)
        p = prompt(10, 0)
        sp = greedy(120)
        task = asyncio.create_task(eng.generate(req(p, sp)))
        await wait_for_tokens(eng, 8)
        await eng.pause(mode)
        new = perturbed(eng)
        assert await eng.update_weights(new) == 1
        assert eng.weight_version == 1
        await eng.resume()
        res = await task
        assert res.finish_reason == "length" and len(res.output_ids) == 120
        k = split_at_switch(res.weight_versions)
        assert res.weight_versions[0] == 0 and res.weight_versions[-1] == 1 and 8 <= k < 120
        assert res.info["retractions"] == (1 if mode == "retract" else 0)
        # tokens before the switch: exactly the old model's
        ref_old = teacher_forced(old_model, p, res, sp)
        assert max(abs(a - b) for a, b in zip(ref_old[:k], res.output_logprobs[:k])) < 1e-4
        ref_new = teacher_forced(eng.model, p, res, sp)
        after = [abs(a - b) for a, b in zip(ref_new[k:], res.output_logprobs[k:])]
        if mode == "retract":  # re-prefilled on the new weights: exact under them
            assert max(after) < 1e-4
        else:  # kept old-weight KV: close to, but not exactly, the new model
            assert max(after) > 1e-4
        await eng.aclose()

    run(main())


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_swap_weights_is_pause_update_resume_in_one_step(mode: str) -> None:
    async def main() -> None:
        eng = engine()
        p = prompt(10, 0)
        sp = greedy(120)
        task = asyncio.create_task(eng.generate(req(p, sp)))
        await wait_for_tokens(eng, 8)
        assert await eng.swap_weights(perturbed(eng), version=5, pause_mode=mode) == 5
        assert eng.weight_version == 5 and not eng.stats()["paused"]
        res = await task
        k = split_at_switch(res.weight_versions)
        assert res.weight_versions[0] == 0 and res.weight_versions[-1] == 5 and 8 <= k < 120
        assert res.info["retractions"] == (1 if mode == "retract" else 0)
        after = [abs(a - b) for a, b in zip(teacher_forced(eng.model, p, res, sp)[k:], res.output_logprobs[k:])]
        assert (max(after) < 1e-4) == (mode == "retract")  # retract: re-prefilled, exact under the new weights
        await eng.aclose()

    run(main())


def test_pause_abort_and_queueing_while_paused() -> None:
    async def main() -> None:
        eng = engine()
        running = [asyncio.create_task(eng.generate(req(prompt(6, i), greedy(300)))) for i in range(3)]
        await wait_for_tokens(eng, 10)
        await eng.pause("abort")
        results = await asyncio.gather(*running)
        assert all(r.finish_reason == "abort" for r in results)
        assert all(len(r.output_ids) < 300 for r in results)
        # new requests queue while paused and run after resume
        later = asyncio.create_task(eng.generate(req(prompt(6, 9), greedy(5))))
        await asyncio.sleep(0.05)
        assert not later.done() and eng.stats()["waiting"] == 1
        await eng.resume()
        res = await later
        assert len(res.output_ids) == 5 and res.finish_reason == "length"
        await eng.aclose()

    run(main())


def test_update_without_pause_lands_between_steps() -> None:
    async def main() -> None:
        eng = engine()
        task = asyncio.create_task(eng.generate(req(prompt(6, 1), greedy(150))))
        await wait_for_tokens(eng, 5)
        assert await eng.update_weights(perturbed(eng), version=7) == 7
        res = await task
        k = split_at_switch(res.weight_versions)
        assert res.weight_versions[0] == 0 and res.weight_versions[-1] == 7 and k >= 5
        await eng.aclose()

    run(main())


def test_update_from_tensors_and_safetensors_dir(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    async def main() -> None:
        eng = engine()
        ref_eng = engine(seed=5)  # a differently initialised model: the target weights
        p = prompt(8, 2)
        target = await ref_eng.generate(req(p, greedy(10)))
        before = await eng.generate(req(p, greedy(10)))
        assert before.output_ids != target.output_ids
        state = {k: v.clone() for k, v in ref_eng.model.state_dict().items()}
        names = [m.name for m in eng.weight_metadata()]
        assert set(names) == set(state)
        # a subset first (partial update), then the rest
        half = names[: len(names) // 2]
        assert await eng.update_weights({n: state[n] for n in half}) == 1
        assert await eng.update_weights({n: state[n] for n in names[len(names) // 2 :]}) == 2
        res = await eng.generate(req(p, greedy(10)))
        assert res.output_ids == target.output_ids and res.weight_versions == [2] * 10
        # from a sharded safetensors directory (tied tensors written once)
        other = engine(seed=9)
        tied = other.model.config.tie_word_embeddings
        sd = {k: v.contiguous().clone() for k, v in other.model.state_dict().items()
              if not (tied and k == "lm_head.weight")}
        keys = sorted(sd)
        save_file({k: sd[k] for k in keys[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
        save_file({k: sd[k] for k in keys[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
        assert await eng.update_weights(tmp_path, version=10) == 10
        want = await other.generate(req(p, greedy(10)))
        res = await eng.generate(req(p, greedy(10)))
        assert res.output_ids == want.output_ids and res.weight_versions == [10] * 10
        for e in (eng, ref_eng, other):
            await e.aclose()

    run(main())


def test_mismatched_update_is_refused_and_old_weights_serve(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    async def main() -> None:
        eng = engine()
        p = prompt(8, 3)
        before = await eng.generate(req(p, greedy(10)))
        good = perturbed(eng, seed=1)
        name = next(iter(good))
        bad_cases = [
            ({**good, "model.layers.0.mlp.gate_projj.weight": torch.zeros(2)}, "unknown tensor"),
            ({**good, name: good[name][:-1]}, "shape"),
            ({**good, name: good[name].to(torch.float64)}, "dtype"),
            ({}, "no tensors"),
        ]
        for weights, word in bad_cases:
            with pytest.raises(WeightUpdateError, match=word):
                await eng.update_weights(weights)
        with pytest.raises(WeightUpdateError, match="did you mean"):
            await eng.update_weights({"model.norm.weigth": torch.ones(64)})
        save_file({"model.norm.weight": torch.ones(3)}, str(tmp_path / "bad.safetensors"))
        with pytest.raises(WeightUpdateError, match="shape"):
            await eng.update_weights(tmp_path)
        (tmp_path / "empty").mkdir()
        with pytest.raises(WeightUpdateError, match="no \\*.safetensors"):
            await eng.update_weights(tmp_path / "empty")
        with pytest.raises(WeightUpdateError, match="does not exist"):
            await eng.update_weights(tmp_path / "missing")
        assert eng.weight_version == 0
        after = await eng.generate(req(p, greedy(10)))
        assert after.output_ids == before.output_ids and after.weight_versions == [0] * 10
        assert await eng.health()
        meta = {m.name: m for m in eng.weight_metadata()}
        assert meta["model.norm.weight"].shape == (64,) and meta["model.norm.weight"].dtype == "float32"
        await eng.aclose()

    run(main())


def test_a_failing_forward_fails_its_requests_and_the_engine_keeps_serving() -> None:
    async def main() -> None:
        eng = engine()
        real = eng._runner.decode
        calls = {"n": 0}

        def flaky(tokens, positions):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated device fault")
            return real(tokens, positions)

        eng._runner.decode = flaky
        with pytest.raises(RuntimeError, match="simulated device fault"):
            await eng.generate(req(prompt(5, 0), greedy(10)))
        res = await eng.generate(req(prompt(5, 0), greedy(10)))
        assert len(res.output_ids) == 10 and await eng.health()
        assert eng.stats()["errors"] == 1 and eng.stats()["running"] == 0
        await eng.aclose()

    run(main())


def test_pause_wait_lets_running_requests_finish_on_the_old_weights() -> None:
    async def main() -> None:
        eng = engine()
        running = [asyncio.create_task(eng.generate(req(prompt(6, i), greedy(60)))) for i in range(2)]
        await wait_for_tokens(eng, 4)
        drain = asyncio.create_task(eng.pause("wait"))
        late = asyncio.create_task(eng.generate(req(prompt(6, 7), greedy(5))))  # arrives while draining
        await drain  # returns once the running ones are done
        assert all(t.done() for t in running) and not late.done() and eng.stats()["paused"]
        results = [t.result() for t in running]
        assert all(r.finish_reason == "length" and r.weight_versions == [0] * 60 for r in results)
        assert all(r.info["retractions"] == 0 for r in results)
        await eng.update_weights(perturbed(eng), version=3)
        await eng.resume()
        assert (await late).weight_versions == [3] * 5  # it waited: all of it on the new weights
        # an idle engine pauses at once
        await eng.pause("wait")
        assert eng.stats()["paused"]
        await eng.resume()
        await eng.aclose()

    run(main())


def test_swap_weights_wait_updates_after_the_running_request() -> None:
    async def main() -> None:
        eng = engine()
        task = asyncio.create_task(eng.generate(req(prompt(10, 0), greedy(80))))
        await wait_for_tokens(eng, 8)
        assert await eng.swap_weights(perturbed(eng), version=5, pause_mode="wait") == 5
        res = await task
        assert res.finish_reason == "length" and res.weight_versions == [0] * 80
        assert not eng.stats()["paused"] and eng.weight_version == 5
        after = await eng.generate(req(prompt(10, 1), greedy(4)))
        assert after.weight_versions == [5] * 4
        await eng.aclose()

    run(main())


def test_a_resume_during_a_drain_releases_the_waiting_pause() -> None:
    async def main() -> None:
        eng = engine()
        task = asyncio.create_task(eng.generate(req(prompt(6, 0), greedy(400))))
        await wait_for_tokens(eng, 4)
        drain = asyncio.create_task(eng.pause("wait"))
        await asyncio.sleep(0)
        await eng.resume()
        await asyncio.wait_for(drain, 60)
        assert not eng.stats()["paused"]
        assert eng.weight_version == 0 and len((await task).output_ids) == 400
        await eng.aclose()

    run(main())

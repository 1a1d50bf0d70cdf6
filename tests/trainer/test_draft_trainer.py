"""The co-trained speculative draft (``speculative.train``): trained on what the policy samples, its
acceptance in the engine rises; its tensors travel with a push (colocated and checked, from a
safetensors directory), are read back by the weight check, resume from a checkpoint; groups that
disagree on it are refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_engine.engines.embedded.options import SpeculativeOptions
from miles_engine.engines.protocol import SamplingParams, served_tensors
from miles_engine.errors import ConfigError
from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer.draft import DraftTrainer, draft_to_train
from tests.engines.embedded.helpers import DENSE, engine, prompt, req, run

torch.set_num_threads(1)

POLICY = dict(DENSE, initializer_range=0.3)
DRAFT = dict(POLICY, num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=8, initializer_range=0.02)
SPEC = dict(method="draft", num_tokens=3, draft_model=DRAFT, train=True, train_lr=3e-3, train_epochs=4)


def sampling(n: int, temperature: float) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=temperature)


async def sample_groups(eng: Any, count: int, temperature: float = 1.0) -> list[Group]:
    """``count`` groups of 4 samples of the policy, as the rollout hands them to the trainer."""
    groups = []
    for g in range(count):
        p = prompt(8, g)
        results = await asyncio.gather(*(eng.generate(req(p, sampling(24, temperature))) for _ in range(4)))
        trajectories = [Trajectory(token_ids=p + r.output_ids, loss_mask=[0] * len(p) + [1] * len(r.output_ids),
                                   rollout_logprobs=[0.0] * len(p) + list(r.output_logprobs),
                                   weight_versions=[None] * len(p) + [0] * len(r.output_ids), reward=0.0,
                                   group_id=f"g{g}", index=i) for i, r in enumerate(results)]
        groups.append(Group(group_id=f"g{g}", task_id="t", trajectories=trajectories, submitted_version=0))
    return groups


async def acceptance(eng: Any, count: int) -> float:
    """Mean accepted tokens + 1 per verify step of greedy requests on the first ``count`` prompts."""
    before = eng.stats()
    await asyncio.gather(*(eng.generate(req(prompt(8, g), sampling(24, 0.0))) for g in range(count)))
    after = eng.stats()
    rows = after["spec_verify_rows"] - before["spec_verify_rows"]
    return (after["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / rows + 1


def test_training_on_what_the_policy_emits_raises_acceptance() -> None:
    """Greedy rows, so what the policy emits on these prompts is learnable in a few steps: the
    draft's acceptance goes from chance to most of its proposals. (At T=1 on a random policy a
    small draft learns far slower; the tiny-terminal run shows it on a trained policy.)"""
    async def main() -> None:
        eng = engine(POLICY, max_batch_size=32, speculative=SPEC)
        draft = DraftTrainer(SpeculativeOptions(**SPEC), seed=1)
        await eng.update_weights(draft.named_tensors())  # the run's first push: the trainer's draft
        start = await acceptance(eng, 4)
        history = []
        for _ in range(6):
            history.append(draft.train_step(await sample_groups(eng, 4, temperature=0.0)))
            await eng.update_weights(draft.named_tensors())  # a draft-only push: the policy's version stays
        end = await acceptance(eng, 4)
        assert eng.weight_version == 0 and eng.stats()["spec_draft_updates"] == 7
        assert history[-1]["draft/loss"] < history[0]["draft/loss"] - 1.0, history
        assert history[-1]["draft/top1_agreement"] > 0.8 > history[0]["draft/top1_agreement"], history
        assert start < 1.5 and end > 2.5, (start, end)  # of at most num_tokens + 1 = 4
        await eng.aclose()

    run(main(), timeout=300)


def test_draft_tensors_are_served_names_checked_and_loaded_from_a_directory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from miles_engine.weights.check.errors import WeightCheckError
    from miles_engine.weights.check.transport import CheckedTransport
    from miles_engine.weights.colocated import ColocatedTransport

    async def main() -> None:
        eng = engine(POLICY, speculative=SPEC)
        draft = DraftTrainer(SpeculativeOptions(**SPEC), seed=1)
        names = {m.name for m in eng.weight_metadata()}
        assert set(draft.named_tensors()) <= names and any(not n.startswith("draft.") for n in names)
        policy = {n: t.clone() for n, t in eng.model.state_dict().items() if n != "lm_head.weight"}  # tied
        push = dict(draft.with_policy(policy.items()))  # what the run pushes
        plain = ColocatedTransport([eng])
        assert (await plain.push(draft.with_policy(policy.items()), 1)).tensors == len(push)
        checked = CheckedTransport(ColocatedTransport([eng]), [eng])
        stats = await checked.push(push.items(), 1)
        assert stats.tensors_checked == len(push) and eng.weight_version == 1
        live = served_tensors(eng)
        assert all(torch.equal(live[n], t) for n, t in draft.named_tensors().items())
        bad = dict(push)
        bad["draft.lm_head.weight"] = bad["draft.lm_head.weight"] + 1.0
        with pytest.raises(WeightCheckError, match=r"draft\.lm_head\.weight"):
            await checked.check(bad, 1)
        # a safetensors directory with the draft's tensors (disk pushes, a restarted server)
        draft.train_step(await sample_groups(eng, 2))
        save_file({n: t.contiguous() for n, t in {**policy, **draft.named_tensors()}.items()},
                  str(tmp_path / "model.safetensors"))
        assert await eng.update_weights(tmp_path, version=2) == 2
        live = served_tensors(eng)
        assert all(torch.equal(live[n], t) for n, t in draft.named_tensors().items())
        await checked.close()
        await eng.aclose()

    run(main(), timeout=120)


def test_state_round_trip_resumes_the_same_draft_and_optimizer() -> None:
    async def main() -> None:
        eng = engine(POLICY, speculative=SPEC)
        groups = await sample_groups(eng, 2)
        await eng.aclose()
        return groups

    groups = run(main(), timeout=120)
    a = DraftTrainer(SpeculativeOptions(**SPEC), seed=1)
    a.train_step(groups)
    b = DraftTrainer(SpeculativeOptions(**SPEC), seed=7)
    b.load_state_dict(a.state_dict())
    ma, mb = a.train_step(groups), b.train_step(groups)
    assert ma == mb and a.steps == b.steps == 2 * SPEC["train_epochs"]
    assert all(torch.equal(x, y) for x, y in zip(a.named_tensors().values(), b.named_tensors().values()))


class _Kind:
    def __init__(self, **speculative: Any) -> None:
        self.options = type("Options", (), {"speculative": SpeculativeOptions(**speculative)})()


class _Cfg:
    trainer = type("Trainer", (), {"parallel": type("Parallel", (), {"device": "cpu"})()})()


def test_groups_that_disagree_on_the_draft_are_refused() -> None:
    assert draft_to_train(_Cfg(), [_Kind(), _Kind(method="ngram")], seed=0) is None
    assert isinstance(draft_to_train(_Cfg(), [_Kind(**SPEC), _Kind(**SPEC)], seed=0), DraftTrainer)
    with pytest.raises(ConfigError, match=r"engines\.1 does not set speculative\.train"):
        draft_to_train(_Cfg(), [_Kind(**SPEC), _Kind(**dict(SPEC, train=False))], seed=0)
    with pytest.raises(ConfigError, match=r"engines\.1 has no speculative options"):
        draft_to_train(_Cfg(), [_Kind(**SPEC), object()], seed=0)
    with pytest.raises(ConfigError, match=r"engines\.1 sets other speculative options"):
        draft_to_train(_Cfg(), [_Kind(**dict(SPEC, train_lr=0.1)), _Kind(**SPEC)], seed=0)
    with pytest.raises(ValueError, match="needs method 'draft'"):
        SpeculativeOptions(method="ngram", train=True)

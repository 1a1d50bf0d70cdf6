"""Shared helpers: a tiny Qwen3 config and trajectory / group builders."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from miles_engine.rollout.types import Group, Trajectory  # noqa: E402

TINY = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(TINY, model_type="qwen3_moe", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
           norm_topk_prob=True)
TIMING = ("prepare_time", "update_time", "step_time")


def traj(token_ids: Sequence[int], prompt_len: int, reward: float | None, *, logp: float = -5.5,
         teacher: float | None = None, index: int = 0, gap: tuple[int, int] | None = None) -> Trajectory:
    """A row whose tokens after ``prompt_len`` are sampled (minus an optional env-token ``gap``)."""
    n = len(token_ids)
    mask = [0] * prompt_len + [1] * (n - prompt_len)
    if gap:
        for i in range(*gap):
            mask[i] = 0
    return Trajectory(token_ids=list(token_ids), loss_mask=mask,
                      rollout_logprobs=[logp if m else 0.0 for m in mask],
                      weight_versions=[0 if m else None for m in mask], reward=reward, index=index,
                      teacher_logprobs=None if teacher is None else [teacher if m else 0.0 for m in mask])


def random_groups(n_groups: int, size: int, *, seed: int = 0, min_len: int = 8, prompt_len: int = 4,
                  teacher: float | None = None, gaps: bool = False, routed: bool = False) -> list[Group]:
    """Groups of random rows of varying length with rewards that differ inside each group
    (``routed``: random 2-layer top-2 of 4 routed experts on the sampled tokens, for :data:`MOE`)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(n_groups):
        rows = []
        for j in range(size):
            n = min_len + 3 * j + i
            ids = torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()
            gap = (prompt_len + 2, prompt_len + 4) if gaps and n > prompt_len + 5 else None
            rows.append(traj(ids, prompt_len, float((i + j) % 3), teacher=teacher, index=j, gap=gap))
            if routed:
                first = torch.randint(0, 4, (n, 2), generator=g)
                rows[-1].routed_experts = [[[int(a), (int(a) + 1) % 4] for a in first[k]] if m else None
                                           for k, m in enumerate(rows[-1].loss_mask)]
        groups.append(Group(group_id=f"g{i}", task_id=f"t{i}", trajectories=rows, submitted_version=0))
    return groups


def params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.named_tensors()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def prompt_groups(prompt_lens: Sequence[int], size: int, *, seed: int = 0, new: tuple[int, int] = (3, 12),
                  logp: float = -5.5, gaps: bool = False) -> list[Group]:
    """GRPO-shaped groups: each group's rows are its prompt (``prompt_lens[i]`` random tokens) plus
    ``new`` (min, max) random sampled tokens; rewards differ inside each group (``gaps``: rows of
    8+ new tokens get 2 environment tokens, mask 0, after their first 3 sampled ones)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for i, p in enumerate(prompt_lens):
        prompt = torch.randint(0, TINY["vocab_size"], (p,), generator=g).tolist()
        rows = []
        for j in range(size):
            n = int(torch.randint(new[0], new[1] + 1, (1,), generator=g))
            ids = prompt + torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()
            gap = (p + 3, p + 5) if gaps and n >= 8 else None
            rows.append(traj(ids, p, float((i + j) % 3), logp=logp, index=j, gap=gap))
        groups.append(Group(group_id=f"p{i}", task_id=f"t{i}", trajectories=rows, submitted_version=0))
    return groups


def grads_of_one_step(trainer, groups: Sequence[Group]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``train_step`` metrics and the gradients the (first) optimizer step saw, by parameter name."""
    grads: dict[str, torch.Tensor] = {}
    original = trainer.optimizer_step

    def spy(opt, sched, ps):
        named = {id(p): n for n, p in trainer.root.named_parameters()}
        grads.update({named[id(p)]: p.grad.clone() for p in ps if p.grad is not None and named[id(p)] not in grads})
        return original(opt, sched, ps)

    trainer.optimizer_step = spy
    metrics = trainer.train_step(groups)
    return metrics, grads


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest difference relative to each tensor's largest entry."""
    assert a.keys() == b.keys() and a
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)).item() for k in a)

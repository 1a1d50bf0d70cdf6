"""Torch-free batch plumbing: validating groups, SFT rows, splitting work by token count.

Everything here runs on the driver side too (the multi-rank proxy validates before it
dispatches, so a bad batch never reaches a collective).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles_engine.rollout.types import Group, Trajectory
from miles_engine.trainer.protocol import BatchError


@dataclass
class SFTRow:
    token_ids: list[int]
    loss_mask: list[int]


def _where(traj: Trajectory, group: Group | None = None) -> str:
    gid = group.group_id if group is not None else traj.group_id
    return f"group {gid!r} trajectory #{traj.index} (task {traj.task_id!r})"


def check_row(token_ids: Sequence[int], loss_mask: Sequence[int], where: str, vocab_size: int | None) -> None:
    if len(token_ids) < 2:
        raise BatchError(f"{where}: a row needs at least 2 tokens (got {len(token_ids)})")
    if len(loss_mask) != len(token_ids):
        raise BatchError(f"{where}: loss_mask has {len(loss_mask)} entries for {len(token_ids)} tokens")
    if any(m not in (0, 1) for m in loss_mask):
        raise BatchError(f"{where}: loss_mask entries must be 0 or 1")
    if loss_mask[0]:
        raise BatchError(f"{where}: loss_mask[0] is 1 but the first token has no predicting position")
    if vocab_size is not None:
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise BatchError(f"{where}: token_ids[{bad}] = {token_ids[bad]} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")


def routed_pairs(routed: Sequence[Any], loss_mask: Sequence[int]) -> list[tuple[int, Any]]:
    """``(token position, [layers][top_k] experts)`` from per-token routed experts (``None`` or
    empty off the sampled tokens, as TITO assembles rows) or one entry per sampled token."""
    n = len(loss_mask)
    if len(routed) == n:
        return [(i, routed[i]) for i in range(n) if routed[i] is not None and len(routed[i])]
    sampled = [i for i, m in enumerate(loss_mask) if m]
    if len(routed) == len(sampled):
        return list(zip(sampled, routed))
    raise BatchError(f"routed_experts has {len(routed)} entries; expected one per token ({n}) "
                     f"or per sampled token ({len(sampled)})")


def check_routed(traj: Trajectory, where: str, layers: int, top_k: int, num_experts: int) -> None:
    try:
        pairs = routed_pairs(traj.routed_experts or [], traj.loss_mask)
    except BatchError as exc:
        raise BatchError(f"{where}: {exc}") from None
    for i, row in pairs:
        ok = len(row) == layers and all(len(r) == top_k and all(0 <= int(e) < num_experts for e in r) for r in row)
        if not ok:
            raise BatchError(f"{where}: routed_experts entry for token {i} is not {layers} MoE layers x top-{top_k} "
                             f"expert ids in 0..{num_experts - 1}")


def check_teacher(traj: Trajectory, where: str, candidates: bool, vocab_size: int | None) -> None:
    """Teacher log-probs for every token (finite log-probs on the sampled ones); with
    ``candidates`` also one candidate list per token with one teacher log-prob per id."""
    n = len(traj.token_ids)
    tl = traj.teacher_logprobs
    if tl is None or len(tl) != n:
        raise BatchError(f"{where}: trainer.opd needs teacher_logprobs for every token "
                         f"(got {None if tl is None else len(tl)} for {n}); is a teacher configured (recipe opd:)?")
    for i, (lp, m) in enumerate(zip(tl, traj.loss_mask)):
        if m and not (math.isfinite(lp) and lp <= 1e-4):
            raise BatchError(f"{where}: teacher_logprobs[{i}] = {lp!r} is not a log-probability")
    if not candidates:
        return
    ids, lps = traj.teacher_candidate_ids, traj.teacher_candidate_logprobs
    if ids is None or lps is None or len(ids) != n or len(lps) != n:
        raise BatchError(f"{where}: trainer.opd.candidates needs teacher_candidate_ids and "
                         f"teacher_candidate_logprobs with one entry per token ({n})")
    for i, (cand, lp) in enumerate(zip(ids, lps)):
        if len(cand) != len(lp):
            raise BatchError(f"{where}: token {i} has {len(cand)} candidate ids but {len(lp)} teacher log-probs")
        if len(set(cand)) != len(cand):
            raise BatchError(f"{where}: token {i} lists a candidate id twice")
        if vocab_size is not None and any(not 0 <= int(c) < vocab_size for c in cand):
            raise BatchError(f"{where}: token {i} has a candidate id outside the vocabulary (0..{vocab_size - 1})")
        if any(not (math.isfinite(x) and x <= 1e-4) for x in lp):
            raise BatchError(f"{where}: token {i} has a teacher candidate log-prob that is not a log-probability")


def validate_groups(groups: Sequence[Group], *, vocab_size: int | None = None, need_teacher: bool = False,
                    std_normalization: bool = False, routing: tuple[int, int, int] | None = None,
                    need_candidates: bool = False) -> None:
    """Raise :class:`BatchError` (naming group and trajectory) unless every group can be trained on.
    ``routing`` = (MoE layers, top_k, experts) checks routed experts for replay."""
    if not groups:
        raise BatchError("train_step got no groups")
    for group in groups:
        if not group.trajectories:
            raise BatchError(f"group {group.group_id!r} has no trajectories")
        if std_normalization and len(group.trajectories) < 2:
            raise BatchError(f"group {group.group_id!r} has 1 trajectory but "
                             f"trainer.algorithm.grpo_std_normalization=true needs at least 2")
        for traj in group.trajectories:
            where = _where(traj, group)
            if traj.status != "ok":
                raise BatchError(f"{where}: status {traj.status!r}; only 'ok' trajectories are trained on")
            if traj.reward is None or not math.isfinite(traj.reward):
                raise BatchError(f"{where}: reward is {traj.reward!r}; a finite reward is required")
            check_row(traj.token_ids, traj.loss_mask, where, vocab_size)
            if len(traj.rollout_logprobs) != len(traj.token_ids):
                raise BatchError(f"{where}: rollout_logprobs has {len(traj.rollout_logprobs)} entries "
                                 f"for {len(traj.token_ids)} tokens")
            for i, (lp, m) in enumerate(zip(traj.rollout_logprobs, traj.loss_mask)):
                if m and not (math.isfinite(lp) and lp <= 1e-4):
                    raise BatchError(f"{where}: rollout_logprobs[{i}] = {lp!r} is not a log-probability")
            if routing is not None and traj.routed_experts is not None:
                check_routed(traj, where, *routing)
            if need_teacher or need_candidates:
                check_teacher(traj, where, need_candidates, vocab_size)


def as_sft_rows(batch: Sequence[Any], vocab_size: int | None = None) -> list[SFTRow]:
    """Accept ``(token_ids, loss_mask)`` pairs, dicts, or objects with those attributes."""
    if not batch:
        raise BatchError("sft_step got an empty batch")
    rows: list[SFTRow] = []
    for i, item in enumerate(batch):
        if isinstance(item, SFTRow):
            row = item
        elif isinstance(item, dict):
            row = SFTRow(list(item["token_ids"]), list(item["loss_mask"]))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            row = SFTRow(list(item[0]), list(item[1]))
        elif hasattr(item, "token_ids") and hasattr(item, "loss_mask"):
            row = SFTRow(list(item.token_ids), list(item.loss_mask))
        else:
            raise BatchError(f"sft row {i}: expected (token_ids, loss_mask), got {type(item).__name__}")
        check_row(row.token_ids, row.loss_mask, f"sft row {i}", vocab_size)
        if not any(row.loss_mask):
            raise BatchError(f"sft row {i}: loss_mask has no 1 (nothing to learn)")
        rows.append(row)
    return rows


def balance(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Assign items (by index) to ``parts`` bins, largest first to the lightest bin; each bin
    keeps its items in their original order. Deterministic."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        j = min(range(parts), key=lambda b: (load[b], b))
        bins[j].append(i)
        load[j] += sizes[i]
    return [sorted(b) for b in bins]


def split_groups(groups: Sequence[Group], parts: int) -> list[list[Group]]:
    """Whole groups into ``parts`` token-balanced lists (some may be empty)."""
    return [[groups[i] for i in b] for b in balance([g.num_tokens for g in groups], parts)]


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch so that ``rows * longest`` (padded tokens) stays within
    ``max_tokens``; a row longer than the budget runs alone. Longest rows first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > max_tokens:
            plan.append(cur)
            cur = []
        cur.append(i)
    if cur:
        plan.append(cur)
    return plan

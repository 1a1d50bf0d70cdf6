"""Padded step tensors from groups or SFT rows, and slices of them per micro-batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from miles_engine.rollout.types import Group
from miles_engine.trainer.rows import SFTRow


@dataclass
class StepBatch:
    """One rank's rows of a step, right-padded to the longest row."""

    token_ids: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long
    loss_mask: Tensor  # [B, T] float
    lengths: list[int]
    rollout_logp: Tensor | None = None  # [B, T]
    teacher_logp: Tensor | None = None  # [B, T]
    rewards: Tensor | None = None  # [B]
    group_index: Tensor | None = None  # [B] long (global group number within the step)
    truncated: Tensor | None = None  # [B] 1.0 where the trajectory's last generation hit max_tokens
    minibatch: list[int] = field(default_factory=list)  # minibatch of each row
    # filled by the trainer: per-token tensors [B, T]
    extra: dict[str, Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def slice(self, rows: Sequence[int]) -> MicroBatch:
        idx = torch.tensor(list(rows), dtype=torch.long)
        width = max(self.lengths[i] for i in rows)
        return MicroBatch(self, idx, width)


@dataclass
class MicroBatch:
    batch: StepBatch
    idx: Tensor
    width: int

    def take(self, t: Tensor, device: torch.device | None = None) -> Tensor:
        out = t.index_select(0, self.idx)[:, : self.width]
        return out.to(device) if device is not None else out

    def get(self, name: str, device: torch.device | None = None) -> Tensor:
        src = getattr(self.batch, name, None)
        if src is None:
            src = self.batch.extra[name]
        return self.take(src, device)

    def put(self, name: str, value: Tensor) -> None:
        """Write ``value`` ([rows, width]) into the step-wide tensor ``extra[name]``."""
        full = self.batch.extra.get(name)
        if full is None:
            full = self.batch.extra[name] = torch.zeros(self.batch.token_ids.shape, dtype=torch.float32)
        full[self.idx, : self.width] = value.detach().to("cpu", torch.float32)


def _pad(rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype, fill: float = 0) -> Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
    return out


def from_token_rows(token_rows: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], pad_id: int = 0) -> StepBatch:
    lengths = [len(r) for r in token_rows]
    width = max(lengths) if lengths else 1
    return StepBatch(
        token_ids=_pad(token_rows, width, torch.long, pad_id),
        attention_mask=_pad([[1] * n for n in lengths], width, torch.long),
        loss_mask=_pad(masks, width, torch.float32),
        lengths=lengths)


def from_groups(minibatches: Sequence[Sequence[Group]], *, teacher: bool = False, pad_id: int = 0,
                routing: tuple[int, int] | None = None, candidates: bool = False) -> StepBatch:
    """Flatten ``minibatches`` (lists of groups) into one padded batch; rows remember their
    group (numbered across the step) and minibatch. ``routing`` = (MoE layers, top_k): also
    build ``extra["routed"]`` ([rows, tokens, layers, top_k], -1 = not replayed).
    ``candidates``: also build the OPD candidate tensors (:func:`candidate_tensors`)."""
    trajs, gidx, mbs = [], [], []
    g = 0
    for m, groups in enumerate(minibatches):
        for group in groups:
            for t in group.trajectories:
                trajs.append(t)
                gidx.append(g)
                mbs.append(m)
            g += 1
    batch = from_token_rows([t.token_ids for t in trajs], [t.loss_mask for t in trajs], pad_id)
    width = batch.token_ids.shape[1]
    batch.rollout_logp = _pad([t.rollout_logprobs for t in trajs], width, torch.float32) * batch.loss_mask
    # weight version that sampled each token (-1: none reported): the numerics / staleness split
    batch.extra["versions"] = _pad([[-1 if v is None else int(v) for v in t.weight_versions] for t in trajs],
                                   width, torch.long, -1)
    if teacher:
        batch.teacher_logp = _pad([t.teacher_logprobs or [] for t in trajs], width, torch.float32) * batch.loss_mask
    batch.rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32)
    batch.truncated = torch.tensor([float(t.metrics.get("truncated", 0.0)) for t in trajs], dtype=torch.float32)
    batch.group_index = torch.tensor(gidx, dtype=torch.long)
    batch.minibatch = mbs
    if routing is not None:
        from miles_engine.trainer.replay import replay_rows

        routed = torch.full((*batch.token_ids.shape, *routing), -1, dtype=torch.long)
        for i, t in enumerate(trajs):
            rows = replay_rows(t.routed_experts, t.loss_mask, *routing)
            if rows is not None:
                routed[i, : len(t.token_ids)] = rows
        batch.extra["routed"] = routed
    if candidates:
        batch.extra.update(candidate_tensors(trajs, width))
    return batch


def candidate_tensors(trajs: Sequence[Any], width: int) -> dict[str, Tensor]:
    """``opd_cand_ids`` (long), ``opd_cand_teacher`` and ``opd_cand_mask`` (float), all
    ``[rows, tokens, C]`` with C the largest candidate set of the step (at least 1)."""
    c = max([1, *(len(ids) for t in trajs for ids in (t.teacher_candidate_ids or []))])
    ids = torch.zeros((len(trajs), width, c), dtype=torch.long)
    lps = torch.zeros((len(trajs), width, c), dtype=torch.float32)
    mask = torch.zeros((len(trajs), width, c), dtype=torch.float32)
    for i, t in enumerate(trajs):
        for p, (cand, lp) in enumerate(zip(t.teacher_candidate_ids or [], t.teacher_candidate_logprobs or [])):
            if cand and t.loss_mask[p]:
                ids[i, p, : len(cand)] = torch.tensor(cand, dtype=torch.long)
                lps[i, p, : len(cand)] = torch.tensor(lp, dtype=torch.float32)
                mask[i, p, : len(cand)] = 1.0
    return {"opd_cand_ids": ids, "opd_cand_teacher": lps, "opd_cand_mask": mask}


def from_sft_rows(rows: Sequence[SFTRow], pad_id: int = 0) -> StepBatch:
    return from_token_rows([r.token_ids for r in rows], [r.loss_mask for r in rows], pad_id)

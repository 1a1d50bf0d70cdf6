"""Shared-prefix forward: the rows of a GRPO group share their prompt, so run it once.

Only the positions that predict a loss-mask token need logits. Every row is split at ``S``,
its first such position: the part before (the prompt, minus its last token) is the row's
*prefix*, the rest its *suffix*. Rows with the same prefix tokens share one prefix. The
unique prefixes run once (with grad, filling a KV cache), the cache is expanded to the member
rows (``index_select``, so gradients flow back through it into the prefix computation), and the
suffixes run against it with ``position_ids`` continuing from each row's ``S`` and an
attention mask covering the row's real prefix slots plus its own suffix. Logits, loss and
gradients equal the plain full-row forward up to float rounding.

Layout of the suffix pass (kv index space): ``[prefix slots 0..Sp) | suffix slots 0..Ls)``
with ``Sp`` the longest prefix of the micro-batch; the slots past a row's own prefix are
masked. A prefix of length 0 still attends its slot 0 in the prefix pass (a fully masked
attention row would give NaN there, and NaN times a zero attention weight stays NaN); that
slot is masked in the suffix pass, so it contributes exactly nothing.

Supported: Hugging Face decoders whose :class:`~transformers.DynamicCache` has plain
full-attention layers (no sliding window, no linear attention) and whose forward takes
``position_ids``, a cache and a boolean ``logits_to_keep``. Not used for a forward that must
return hidden states of every position (value head), with routing replay or gradient
checkpointing (decided by the trainer).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

PrefixMode = Literal["auto", "always"]  # auto: only when it saves work; always: every call (FSDP ranks agree)
MIN_SHARED_TOKENS = 16  # auto mode: a prefix shared by >= 2 rows must be at least this long


@dataclass
class PrefixSplit:
    owner: Tensor  # [B] long: row -> its unique prefix
    starts: list[int]  # [B] where each row's suffix begins (= its prefix length)
    prefix_ids: Tensor  # [U, Sp] right-padded
    prefix_attn: Tensor  # [U, Sp] for the prefix pass (slot 0 always on)
    suffix_ids: Tensor  # [B, Ls] right-padded
    suffix_attn: Tensor  # [B, Sp + Ls]: real prefix slots of the row's prefix, then its suffix
    position_ids: Tensor  # [B, Ls] absolute positions of the suffix tokens
    keep: Tensor  # [B, Ls] bool: suffix positions whose logits are wanted


def _cache_kwarg(model: nn.Module) -> str | None:
    params = inspect.signature(model.forward).parameters
    if "position_ids" not in params or "logits_to_keep" not in params:
        return None
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def _new_cache(model: nn.Module) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def supports(model: nn.Module) -> bool:
    """Whether :func:`shared_prefix_logits` can run ``model`` (see the module doc)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or _cache_kwarg(model) is None:
        return False
    try:
        from transformers.cache_utils import DynamicLayer

        cache = _new_cache(model)
    except Exception:  # noqa: BLE001 - an unknown or old transformers cache: use the plain forward
        return False
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def row_prefixes(ids: Tensor, keep: Tensor, lengths: Sequence[int]) -> list[tuple[int, ...]]:
    """Each row's prefix: its tokens before its first kept position (all but the last token
    when nothing is kept)."""
    keep = keep.cpu()
    last = torch.tensor(list(lengths), dtype=torch.long) - 1
    firsts = torch.where(keep.any(dim=1), keep.int().argmax(dim=1), last).tolist()
    return [tuple(r[:s]) for r, s in zip(ids.tolist(), firsts)]


def _choose(unique: int, rows: int, longest: int, longest_prefix: int, longest_suffix: int, shared: bool,
            mode: PrefixMode) -> tuple[bool, int]:
    plain = rows * longest
    two = unique * longest_prefix + rows * longest_suffix
    use = mode == "always" or (shared and two < plain)
    return use, two if use else plain


class Shape:
    """Rows of one micro-batch as the forward sees them: padded tokens of the plain forward
    (rows x longest) vs the shared-prefix one (unique prefixes x longest prefix + rows x longest
    suffix), and which one :func:`plan` picks."""

    def __init__(self) -> None:
        self.members: dict[tuple[int, ...], int] = {}
        self.rows = self.longest = self.longest_suffix = 0
        self.longest_prefix = 1  # the prefix pass has at least one slot
        self.shared = False  # a prefix of >= MIN_SHARED_TOKENS tokens has >= 2 rows

    def _after(self, key: tuple[int, ...], length: int) -> tuple[int, int, int, int, int, bool]:
        count = self.members.get(key, 0) + 1
        return (len(self.members) + (count == 1), self.rows + 1, max(self.longest, length),
                max(self.longest_prefix, len(key)), max(self.longest_suffix, length - len(key)),
                self.shared or (count >= 2 and len(key) >= MIN_SHARED_TOKENS))

    def add(self, key: tuple[int, ...], length: int) -> None:
        _, self.rows, self.longest, self.longest_prefix, self.longest_suffix, self.shared = self._after(key, length)
        self.members[key] = self.members.get(key, 0) + 1

    def choice(self, mode: PrefixMode) -> tuple[bool, int]:
        """(use the shared-prefix forward, the padded tokens it costs)."""
        return _choose(len(self.members), self.rows, self.longest, self.longest_prefix, self.longest_suffix,
                       self.shared, mode)

    def cost_with(self, key: tuple[int, ...], length: int, mode: PrefixMode) -> int:
        """:meth:`choice`'s cost if the row were added."""
        return _choose(*self._after(key, length), mode)[1]


def plan_micro_batches(keys: Sequence[tuple[int, ...]], lengths: Sequence[int], max_tokens: int,
                       mode: PrefixMode) -> list[list[int]]:
    """Row indices per micro-batch, costed as the forward will run them (:meth:`Shape.choice`) and
    kept within ``max_tokens`` (a row over it runs alone). Rows sharing a prefix stay together
    (prefixes with the longest row first, their rows longest first), so a prefix runs once per
    step where the budget allows; without shared prefixes this is the plain planner's order."""
    longest: dict[tuple[int, ...], tuple[int, int]] = {}
    for i, (k, n) in enumerate(zip(keys, lengths)):
        longest[k] = (max(longest[k][0], n), longest[k][1]) if k in longest else (n, i)
    order = sorted(range(len(keys)), key=lambda i: (-longest[keys[i]][0], longest[keys[i]][1], -lengths[i], i))
    plan: list[list[int]] = []
    cur: list[int] = []
    shape = Shape()
    for i in order:
        if cur and shape.cost_with(keys[i], lengths[i], mode) > max_tokens:
            plan.append(cur)
            cur, shape = [], Shape()
        cur.append(i)
        shape.add(keys[i], lengths[i])
    if cur:
        plan.append(cur)
    return plan


def plan(ids: Tensor, attn: Tensor, keep: Tensor, mode: PrefixMode) -> PrefixSplit | None:
    """Split a right-padded micro-batch (see the module doc); ``None`` when ``auto`` finds it not
    worth it (no prefix of >= :data:`MIN_SHARED_TOKENS` tokens shared by >= 2 rows, or no saving
    in padded tokens)."""
    lengths = attn.sum(dim=1).tolist()
    keys = row_prefixes(ids, keep, lengths)
    shape = Shape()
    for k, n in zip(keys, lengths):
        shape.add(k, n)
    if not shape.choice(mode)[0]:
        return None
    index = {k: u for u, k in enumerate(shape.members)}
    return _build(ids, keep, list(shape.members), [index[k] for k in keys], [len(k) for k in keys], lengths,
                  shape.longest_prefix, shape.longest_suffix)


def _build(ids: Tensor, keep: Tensor, prefixes: list[tuple[int, ...]], owner: list[int], starts: list[int],
           lengths: list[int], sp: int, ls: int) -> PrefixSplit:
    dev = ids.device
    b = len(owner)
    prefix_ids = torch.zeros((len(prefixes), sp), dtype=ids.dtype)
    prefix_attn = torch.zeros((len(prefixes), sp), dtype=torch.long)
    for u, p in enumerate(prefixes):
        prefix_ids[u, : len(p)] = torch.tensor(p, dtype=ids.dtype)
        prefix_attn[u, : max(len(p), 1)] = 1
    suffix_ids = torch.zeros((b, ls), dtype=ids.dtype, device=dev)
    suffix_attn = torch.zeros((b, sp + ls), dtype=torch.long)
    suffix_keep = torch.zeros((b, ls), dtype=torch.bool, device=dev)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        suffix_ids[i, : n - s] = ids[i, s:n]
        suffix_keep[i, : n - s] = keep[i, s:n]
        suffix_attn[i, :s] = 1
        suffix_attn[i, sp: sp + n - s] = 1
    position_ids = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(ls)[None, :]
    return PrefixSplit(torch.tensor(owner, dtype=torch.long, device=dev), starts, prefix_ids.to(dev),
                       prefix_attn.to(dev), suffix_ids, suffix_attn.to(dev), position_ids.to(dev), suffix_keep)


def _expand(cache: Any, owner: Tensor) -> None:
    """Each row gets its prefix's keys and values (a differentiable gather)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, owner)
        layer.values = layer.values.index_select(0, owner)


def shared_prefix_logits(model: nn.Module, split: PrefixSplit) -> Tensor:
    """``[kept positions, vocab]`` logits in the order of ``keep.nonzero()`` of the full rows."""
    kwarg = _cache_kwarg(model)
    cache = _new_cache(model)
    # the prefix pass needs no logits; one position keeps the call cheap and its output in the graph
    head = model(input_ids=split.prefix_ids, attention_mask=split.prefix_attn, use_cache=True,
                 logits_to_keep=1, **{kwarg: cache}).logits
    _expand(cache, split.owner)
    out = model(input_ids=split.suffix_ids, attention_mask=split.suffix_attn, position_ids=split.position_ids,
                use_cache=True, logits_to_keep=split.keep, **{kwarg: cache})
    logits = out.logits
    if logits.dim() == 3:  # the model ignored logits_to_keep: select here
        logits = logits[split.keep]
    # the prefix call's output must reach backward too: FSDP2 re-gathers the parameters for backward from
    # hooks on each call's outputs (without this term, backward fails with "setStorage ... out of bounds")
    return logits + head.sum() * 0.0


def dummy_logits(model: nn.Module, device: torch.device) -> Tensor:
    """The two model calls of :func:`shared_prefix_logits` on a 2-token row, for FSDP ranks
    that run zero-weight dummy micro-batches (the collectives must match)."""
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    keep = torch.tensor([[False, True]], device=device)
    split = _build(ids, keep, [(0,)], [0], [1], [2], 1, 1)
    return shared_prefix_logits(model, split)

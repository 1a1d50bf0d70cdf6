"""The trainer's modules: policy, frozen reference, value head or separate critic, and the
forward passes that turn token rows into per-token log-probs, entropies and values."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from miles_engine import batch_invariant
from miles_engine.trainer import prefix as prefix_mod
from miles_engine.trainer.prefix import PrefixMode


def build_causal_lm(source: Any, device: torch.device, seed: int) -> nn.Module:
    """A float32 causal LM: a model instance is used as is (the trainer owns and mutates it);
    anything else goes through the engine's loader (dir, config dict / object, ``tiny:`` spec)."""
    if isinstance(source, nn.Module):
        model = source
    else:
        from miles_engine.models.loading import load_model

        model, _ = load_model(source, dtype="float32", device=str(device), seed=seed)
    model = model.to(device=device, dtype=torch.float32)
    model.eval()  # RL wants no dropout: old log-probs must equal the ones the update starts from
    model.requires_grad_(True)
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


def hidden_size(model: nn.Module) -> int:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.hidden_size)


class ValueHead(nn.Module):
    """``hidden -> scalar``; zero-initialised so the first values are 0."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.proj(hidden).squeeze(-1).float()


class Critic(nn.Module):
    """A separate small critic: a decoder trunk (no LM head) plus a :class:`ValueHead`."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.trunk = lm.get_decoder()
        self.head = ValueHead(hidden_size(lm))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.head(out.last_hidden_state)


def shift_values(values: Tensor) -> Tensor:
    """Value of the state *before* token i is the value at position i - 1 (index 0 gets 0)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


class ForwardOut:
    __slots__ = ("logp", "entropy", "hidden", "cand_logp")

    def __init__(self, logp: Tensor, entropy: Tensor | None, hidden: Tensor | None,
                 cand_logp: Tensor | None = None) -> None:
        self.logp, self.entropy, self.hidden, self.cand_logp = logp, entropy, hidden, cand_logp


def keep_mask(mask: Tensor | None) -> Tensor | None:
    """Positions whose logits predict a masked token: ``keep[:, t] = mask[:, t + 1]``."""
    if mask is None:
        return None
    keep = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    keep[:, :-1] = mask[:, 1:] > 0
    return keep


def _log_softmax(model: nn.Module, logits: Tensor) -> Tensor:
    """The engine's arithmetic when the model is batch-invariant (true on-policy)."""
    if batch_invariant.is_enabled(model):
        return batch_invariant.log_softmax(logits)
    return torch.log_softmax(logits, dim=-1)


def forward_logprobs(model: nn.Module, ids: Tensor, attn: Tensor, *, temperature: float = 1.0,
                     entropy: str = "none", hidden: bool = False, mask: Tensor | None = None,
                     candidates: Tensor | None = None, prefix: PrefixMode | None = None) -> ForwardOut:
    """Per-token log-probs aligned with ``ids`` (index 0 = 0); ``entropy``: ``none``, ``metric``
    (detached) or ``grad``; ``hidden``: also return the last hidden state. With ``mask`` only
    the masked tokens are scored (0 elsewhere): the LM head and the softmax then run only on the
    positions that predict them (``logits_to_keep`` with a boolean mask), a large saving when
    prompts and environment tokens dominate the rows. ``candidates`` (``[rows, tokens, C]`` ids,
    aligned like ``ids``): also return their log-probs as ``cand_logp`` (same shape, with grad).
    ``prefix`` (with ``mask``, without ``hidden``): rows sharing a prompt run it once
    (:mod:`miles_engine.trainer.prefix`; the caller checked :func:`prefix.supports`)."""
    keep = keep_mask(mask)
    split = prefix_mod.plan(ids, attn, keep, prefix) if prefix and keep is not None and not hidden else None
    out = None
    if split is not None:
        logits = prefix_mod.shared_prefix_logits(model, split).float()
    else:
        kwargs: dict[str, Any] = {"logits_to_keep": keep} if keep is not None else {}
        out = model(input_ids=ids, attention_mask=attn, output_hidden_states=hidden, use_cache=False, **kwargs)
        logits = out.logits.float()
        if keep is not None and logits.dim() == 3:  # the model ignored logits_to_keep: select here
            logits = logits[keep]
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = _log_softmax(model, logits)
    if keep is None:
        logp = torch.nn.functional.pad(logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    else:
        rows, cols = keep.nonzero(as_tuple=True)
        vals = logp_all.gather(-1, ids[rows, cols + 1][:, None]).squeeze(-1)
        logp = torch.zeros(ids.shape, dtype=vals.dtype, device=ids.device).index_put((rows, cols + 1), vals)
    ent = None
    if entropy != "none":
        src = logp_all if entropy == "grad" else logp_all.detach()
        h = -(src.exp() * src).sum(-1)
        if keep is None:
            ent = torch.nn.functional.pad(h[:, :-1], (1, 0))
        else:
            ent = torch.zeros(ids.shape, dtype=h.dtype, device=ids.device).index_put((rows, cols + 1), h)
    cand = None
    if candidates is not None:
        if keep is None:
            cand = torch.nn.functional.pad(logp_all[:, :-1].gather(-1, candidates[:, 1:]), (0, 0, 1, 0))
        else:
            vals = logp_all.gather(-1, candidates[rows, cols + 1])
            cand = torch.zeros(candidates.shape, dtype=vals.dtype, device=ids.device).index_put((rows, cols + 1), vals)
    return ForwardOut(logp, ent, out.hidden_states[-1] if hidden and out is not None else None, cand)

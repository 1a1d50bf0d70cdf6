"""Switch a transformers causal LM to batch-invariant arithmetic, in place.

``enable(model)`` rebinds the forward of every module whose arithmetic depends on the batch:
``nn.Linear`` (:func:`ops.linear`), ``*RMSNorm``, the activation of every MLP / experts block
(:func:`ops.elementwise`), the rotary embedding (a cos / sin table of ``max_position_embeddings``
rows computed once at that fixed shape, then indexed by position), the MoE router
(``*TopKRouter``: logits, softmax, top-k and renormalisation per row block) and experts
(``*Experts``: the eager loop over experts with the ops above; each token adds its experts'
outputs in expert order). Attention becomes :mod:`attention` (``attn_implementation``).

Only the families checked here are accepted (Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mistral
layouts); anything else raises, rather than running a model that is only partly invariant.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from miles_engine.batch_invariant import attention, ops

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
_FLAG = "_miles_batch_invariant"
_ADAPTIVE_ROPE = ("dynamic", "longrope")


def is_enabled(model: nn.Module) -> bool:
    return bool(getattr(model, _FLAG, False))


def _text_config(model: nn.Module) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def check_supported(model: nn.Module) -> None:
    """Raise ``ValueError`` naming why ``model`` cannot run batch-invariant."""
    text = _text_config(model)
    kind = getattr(text, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"true_on_policy supports model types {', '.join(SUPPORTED)}; this model is {kind!r}")
    rope = (getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in _ADAPTIVE_ROPE:
        raise ValueError(f"true_on_policy does not support rope_type {rope.get('rope_type')!r} "
                         f"(its frequencies change with the sequence length)")
    if getattr(text, "use_sliding_window", False) and getattr(text, "sliding_window", None):
        raise ValueError("true_on_policy does not support sliding-window attention")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("true_on_policy needs float32 weights on both sides (engine dtype and trainer dtype float32)")


def _linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    return ops.linear(x, self.weight, self.bias)


def _norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    eps = getattr(self, "variance_epsilon", None)
    if eps is None:
        eps = self.eps
    return ops.rms_norm(x, self.weight, eps)


def _act_forward(self: nn.Module, x: Tensor) -> Tensor:
    return ops.elementwise(lambda t: type(self).forward(self, t), x)


def _rotary_forward(self: nn.Module, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    table = getattr(self, "_miles_table", None)
    if table is None or table[0].device != x.device:
        rows = int(self.original_max_seq_len)
        with torch.no_grad():
            pos = torch.arange(rows, device=x.device)[None]
            freqs = pos[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
            emb = torch.cat((freqs, freqs), dim=-1)[0]
            table = (emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling)
        self._miles_table = table
    if int(position_ids.max()) >= table[0].shape[0]:
        raise ValueError(f"position {int(position_ids.max())} is past max_position_embeddings ({table[0].shape[0]})")
    return table[0][position_ids].to(x.dtype), table[1][position_ids].to(x.dtype)


def _router_forward(self: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    flat = hidden.reshape(-1, self.hidden_dim)
    logits = ops.linear(flat, self.weight)
    norm = getattr(self, "norm_topk_prob", True)

    def block(b: Tensor) -> Tensor:
        probs = torch.softmax(b, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.cat([top, idx.to(top.dtype)], dim=-1)

    packed = ops.row_blocks(block, logits)
    scores, idx = packed[:, : self.top_k], packed[:, self.top_k :].long()
    return logits, scores.to(logits.dtype), idx


def replayed_scores(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    """R3's routing weights at forced experts, with the router's own per-row-block arithmetic."""
    norm = getattr(router, "norm_topk_prob", True)
    k = indices.shape[-1]

    def block(b: Tensor) -> Tensor:
        probs = torch.softmax(b[:, :-k], dim=-1, dtype=torch.float).gather(-1, b[:, -k:].long())
        return probs / probs.sum(dim=-1, keepdim=True) if norm else probs

    return ops.row_blocks(block, torch.cat([logits.float(), indices.to(torch.float32)], dim=-1))


def _experts_forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    out = torch.zeros_like(hidden)
    for e in torch.unique(top_k_index).tolist():
        if not 0 <= e < self.num_experts:
            continue
        token, slot = torch.where(top_k_index == e)
        gate, up = ops.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = self.act_fn(gate) * up  # act_fn is batch-invariant too (enable patches every act_fn)
        h = ops.linear(h, self.down_proj[e]) * top_k_weights[token, slot, None]
        out = out.index_add(0, token, h.to(out.dtype))
    return out


def _bind(module: nn.Module, fn: Any) -> None:
    module.forward = types.MethodType(fn, module)
    setattr(module, _FLAG, True)


def enable(model: nn.Module) -> nn.Module:
    """Make ``model`` batch-invariant in place (idempotent); returns it."""
    attention.register()
    if is_enabled(model):
        if getattr(model.config, "_attn_implementation", None) != attention.NAME:
            model.set_attn_implementation(attention.NAME)
        return model
    check_supported(model)
    for name, module in model.named_modules():
        cls = type(module).__name__
        if isinstance(module, nn.Linear):
            _bind(module, _linear_forward)
        elif cls.endswith("RMSNorm"):
            _bind(module, _norm_forward)
        elif cls.endswith("RotaryEmbedding"):
            _bind(module, _rotary_forward)
        elif cls.endswith("TopKRouter"):
            _bind(module, _router_forward)
        elif cls.endswith("Experts") and hasattr(module, "gate_up_proj"):
            _bind(module, _experts_forward)
        elif isinstance(module, nn.Embedding) or not list(module.parameters(recurse=False)):
            pass
        else:
            raise ValueError(f"true_on_policy: module {name} ({cls}) holds weights this mode does not know how to "
                             f"run batch-invariant")
        act = getattr(module, "act_fn", None)
        if isinstance(act, nn.Module) and not is_enabled(act):
            _bind(act, _act_forward)
    model.set_attn_implementation(attention.NAME)
    setattr(model, _FLAG, True)
    return model

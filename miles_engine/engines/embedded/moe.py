"""Routed-expert capture for MoE models: forward hooks on the router (gate) modules.

transformers' MoE routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ...) return
``(router_logits, routing_weights, selected_experts)``; the hook records ``selected_experts``
— the exact top-k indices the experts were run with, ``[tokens, top_k]`` in the order the
block flattened ``[batch, seq]``. A router that returns only logits (older layouts: a plain
``nn.Linear`` gate) is reproduced with the block's own rule ``topk(softmax(logits), top_k)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _top_k_of(config: Any) -> int | None:
    for key in ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _is_router(name: str, module: nn.Module) -> bool:
    cls = type(module).__name__
    if cls.endswith("TopKRouter") or cls.endswith("Router") and hasattr(module, "top_k"):
        return True
    # legacy layout: `<block>.gate` Linear next to `<block>.experts`
    return name.endswith(".gate") and isinstance(module, nn.Linear)


class RouterCapture:
    """Records the top-k expert ids of every MoE layer during a forward.

    ``start()`` before a forward, ``take(batch, q)`` after it -> int tensor ``[batch, q, layers, top_k]``.
    """

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        self.top_k = _top_k_of(config)
        routers: list[nn.Module] = []
        if self.top_k is not None:
            for name, module in model.named_modules():
                if _is_router(name, module):
                    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                    if isinstance(module, nn.Linear) and not hasattr(parent, "experts"):
                        continue
                    routers.append(module)
        self.num_layers = len(routers)
        self._records: list[torch.Tensor | None] = [None] * self.num_layers
        self._active = False
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    @property
    def is_moe(self) -> bool:
        return self.num_layers > 0

    def _hook(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active:
                return
            idx = None
            if isinstance(output, tuple):
                for item in reversed(output):
                    if isinstance(item, torch.Tensor) and not item.is_floating_point() and item.dim() == 2:
                        idx = item
                        break
            if idx is None:  # logits only
                logits = output[0] if isinstance(output, tuple) else output
                probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1, dtype=torch.float)
                idx = torch.topk(probs, self.top_k, dim=-1).indices
            self._records[i] = idx.detach()
        return hook

    def start(self) -> None:
        self._records = [None] * self.num_layers
        self._active = self.is_moe

    def stop(self) -> None:
        self._active = False
        self._records = [None] * self.num_layers

    def take(self, batch: int, q: int) -> torch.Tensor | None:
        self._active = False
        if not self.is_moe:
            return None
        missing = [i for i, r in enumerate(self._records) if r is None]
        if missing:
            raise RuntimeError(f"MoE router capture: layers {missing} did not run")
        stacked = torch.stack([r.reshape(batch, q, -1) for r in self._records], dim=2)
        self._records = [None] * self.num_layers
        return stacked.to(torch.int32).cpu()

    def close(self) -> None:
        for h in self._handles:
            h.remove()

"""R3 (rollout routing replay): route each sampled token through the experts the engine used.

The engine records, for every sampled token ``i``, the top-k experts of each MoE layer at the
forward position that produced its logits (position ``i - 1``). The trainer's forward hooks on
the routers replace the router's own top-k by those indices at the recorded positions (other
positions keep the trainer's routing) and recompute the routing weights from the router's
logits (softmax, gathered at the replayed experts, renormalised like the router does), so the
router still gets gradients. A router whose scores this does not reproduce is refused when
the replay is installed (checked on random inputs), never silently mis-replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from miles_engine import batch_invariant
from miles_engine.trainer.rows import routed_pairs


def _routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _replayed_scores(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
    if getattr(router, "norm_topk_prob", True):
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class RoutingReplay:
    """Forward hooks on every ``*TopKRouter`` of ``model``. ``set(replay)`` with ``[batch, seq,
    layers, top_k]`` ints (-1: keep the router's own choice) before a forward; ``set(None)``
    turns replay off. ``last`` holds the indices each layer used in the latest forward."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = _routers(model)
        if not self.routers:
            raise ValueError("algorithm.routing_replay=true but the model has no MoE routers (*TopKRouter modules)")
        self.top_k = int(getattr(self.routers[0], "top_k", 0))
        self.num_experts = int(getattr(self.routers[0], "num_experts", 0) or self.routers[0].weight.shape[0])
        self._replay: Tensor | None = None
        self.last: list[Tensor | None] = [None] * len(self.routers)
        self._check()
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _check(self) -> None:
        router = self.routers[0]
        dim = int(getattr(router, "hidden_dim", 0) or router.weight.shape[-1])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            out = router(torch.randn(8, dim, device=router.weight.device, dtype=router.weight.dtype))
        ok = isinstance(out, tuple) and len(out) == 3
        if ok:
            logits, scores, idx = out
            ok = torch.allclose(_replayed_scores(router, logits, idx), scores.float(), atol=1e-4)
        if not ok:
            raise ValueError(f"routing replay does not support {type(router).__name__} (its routing weights are "
                             f"not softmax-top-k); set algorithm.routing_replay=false")

    def set(self, replay: Tensor | None) -> None:
        self._replay = replay

    def _hook(self, layer: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            logits, scores, idx = output
            replay = self._replay
            if replay is not None:
                forced = replay[:, :, layer].reshape(-1, replay.shape[-1]).to(idx.device, idx.dtype)
                if forced.shape != idx.shape:
                    raise RuntimeError(f"routing replay: layer {layer} routed {tuple(idx.shape)} but the replay "
                                       f"has {tuple(forced.shape)}")
                use = forced[:, :1] >= 0
                idx = torch.where(use, forced, idx)
                replayed = batch_invariant.replayed_scores(module, logits, idx) if batch_invariant.is_enabled(module) \
                    else _replayed_scores(module, logits, idx)
                scores = torch.where(use, replayed.to(scores.dtype), scores)
            self.last[layer] = idx.detach()
            return logits, scores, idx
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def replay_rows(routed: Sequence[Any] | None, loss_mask: Sequence[int], layers: int, top_k: int) -> Tensor | None:
    """``[tokens, layers, top_k]`` ints for one trajectory (-1 where nothing is replayed); the
    entry of sampled token ``i`` lands on position ``i - 1``. Shapes were checked by
    :func:`miles_engine.trainer.rows.check_routed`."""
    if routed is None:
        return None
    n = len(loss_mask)
    out = torch.full((n, layers, top_k), -1, dtype=torch.long)
    for i, row in routed_pairs(routed, loss_mask):
        if i >= 1:
            out[i - 1] = torch.as_tensor(row, dtype=torch.long)
    return out

"""R3 in Megatron's MoE routers: the experts recorded at rollout replace the router's own
top-k on the replayed tokens (the interface of :class:`miles_engine.trainer.replay.RoutingReplay`).

Each ``TopKRouter`` gets a per-layer hook object in its ``router_replay`` slot (the one
megatron-core's own ``RouterReplay`` uses; its global record/replay switches stay unused): the
router's top-k runs as usual, then rows with a recorded route (``>= 0``) take the recorded
experts, and their weights are the router's scores gathered at those experts (so the
softmax/renormalisation that follows is the router's own). Megatron's tokens are
``[seq, batch]``-major, the replay tensor ``[batch, seq, layers, top_k]``; layers are global
(a pipeline stage's routers are layers ``offset ..``). Under sequence parallelism a TP rank's
router sees its slice of the sequence only, and replays that slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class _LayerReplay:
    def __init__(self, owner: MegatronRoutingReplay, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: Any = None, group_topk: Any = None,
                        default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None
                        ) -> tuple[Tensor, Tensor]:
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        replay = self.owner._replay
        if replay is not None:
            forced = replay[:, :, self.layer].transpose(0, 1)  # [s, b, k]
            parts, rank = self.owner.sequence_split
            if parts > 1:  # sequence parallel: this TP rank routes its slice of the (padded) sequence
                full = -(-forced.shape[0] // parts) * parts
                forced = torch.nn.functional.pad(forced, (0, 0, 0, 0, 0, full - forced.shape[0]), value=-1)
                forced = forced.chunk(parts)[rank]
            s, b = forced.shape[:2]
            forced = forced.reshape(-1, replay.shape[-1]).to(idx.device, idx.dtype)
            if forced.shape != idx.shape:
                raise RuntimeError(f"routing replay: layer {self.layer} routed {tuple(idx.shape)} but the replay "
                                   f"has {tuple(forced.shape)}")
            use = forced[:, :1] >= 0
            idx = torch.where(use, forced, idx)
            probs = scores.gather(1, idx)
            self.owner.last[self.layer] = idx.detach().reshape(s, b, -1).transpose(0, 1)
        else:
            self.owner.last[self.layer] = idx.detach()
        return probs, idx


class MegatronRoutingReplay:
    """``set(replay)`` with ``[batch, seq, layers, top_k]`` ints (-1: the router's own choice) before
    a forward, ``set(None)`` for none; ``last[layer]``: the experts a layer used in the latest
    forward (``[batch, seq, top_k]`` when replaying; the rank's sequence slice under SP)."""

    def __init__(self, model: nn.Module, *, num_layers: int, layer_offset: int = 0,
                 sequence_split: tuple[int, int] = (1, 0)) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError("algorithm.routing_replay=true but the model has no MoE routers")
        cfg = self.routers[0].config
        if cfg.moe_router_score_function != "softmax" or cfg.moe_router_num_groups:
            raise ValueError("routing replay supports softmax top-k routers only; set algorithm.routing_replay=false")
        self.top_k = int(cfg.moe_router_topk)
        self.num_experts = int(cfg.num_moe_experts)
        self._num_layers = num_layers
        self.sequence_split = sequence_split  # (TP size, TP rank) under sequence parallelism
        self._replay: Tensor | None = None
        self.last: list[Tensor | None] = [None] * num_layers
        for i, router in enumerate(self.routers):
            router.router_replay = _LayerReplay(self, layer_offset + i)

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def set(self, replay: Tensor | None) -> None:
        self._replay = replay

    def close(self) -> None:
        for router in self.routers:
            router.router_replay = None

"""Quantisation-aware training on the Megatron backend: the same values as the torch backend's
(:mod:`miles_engine.precision.qat`), so trainer and engines compute with identical weights.

Megatron fuses the Hugging Face linear layers (``q/k/v`` per query group into ``linear_qkv``,
``[gate; up]`` into ``linear_fc1``), and a format's blocks and scales belong to each Hugging Face
weight (FP8's 128x128 tiles, NVFP4's per-tensor scale). So each fused weight is split back into its
Hugging Face parts in the forward, each part fake-quantised under its own name (the exception list
read by those names), and fused again -- differentiable reshapes around the straight-through
quantizer: the gradient reaches the Megatron parameter unchanged.

Under tensor parallelism a rank holds a shard of each weight, whose blocks and scales span the
whole (NVFP4's per-tensor scale, FP8 tiles straddling a shard edge): each rank gathers the
layer's whole weight (an all-gather per linear layer per forward, the size of the weight), fake-
quantises it exactly as with one rank, and computes with its own shard of the result; its
gradient is that shard's (the other ranks' shards are other ranks' outputs), so the step equals
the one-rank step.

Which weights are quantised is the Hugging Face model's answer (:func:`~miles_engine.precision.
targets.quantized_weights`, as in every other stage): on a MoE model the attention layers and the
routed experts -- each expert of the stacked ``gate_up_proj`` / ``down_proj`` is a weight of its
own, and Megatron's expert ``linear_fc1`` is exactly ``gate_up_proj[e]`` -- not the router. Expert
parallelism needs nothing (a rank holds whole experts); expert tensor parallelism gathers like TP.
A weight the other stages quantise that no Megatron linear layer here computes is one error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from miles_engine.errors import ConfigError
from miles_engine.precision.quantizer import fake_quantize
from miles_engine.precision.targets import check_fits
from miles_engine.trainer.megatron import hf_mapping as hm


def apply(gpt: Any, shape: Any, layout: hm.RankLayout, fmt: str, targets: Iterable[str]) -> list[str]:
    """Fake-quantise the forward of this rank's decoder linear layers computing the Hugging Face
    weights ``targets`` (the contract's choice, exceptions applied); returns those quantised here."""
    targets = set(targets)
    quantised: dict[str, tuple[int, ...]] = {}
    plan: list[tuple[Any, Callable[[Tensor], Tensor]]] = []

    def part(t: Tensor, name: str) -> Tensor:
        return fake_quantize(t, fmt, name) if name in targets else t

    shards = Shards(layout.tp, layout.tp_rank, _tp_group() if layout.tp > 1 else None)
    layers = gpt.decoder.layers
    for local, i in enumerate(layout.layers(shape.layers)):
        a, layer = f"model.layers.{i}.", layers[local]
        attn, mlp = layer.self_attention, layer.mlp
        q, k, v, o = (f"{a}self_attn.{p}_proj.weight" for p in "qkvo")
        gate, up, down = (f"{a}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
        qkv_rows = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.kv_heads * shape.head_dim)
        cols = shape.hidden
        layer_parts = [  # each quantises the whole Hugging Face weights of this rank's shard
            (attn.linear_qkv, {q: (qkv_rows[0], cols), k: (qkv_rows[1], cols), v: (qkv_rows[2], cols)},
             shards.rows(lambda w, names=(q, k, v): hm._fuse_qkv(*map(part, hm._split_qkv(w, shape), names), shape))),
            (attn.linear_proj, {o: (cols, qkv_rows[0])}, shards.cols(lambda w, o=o: part(w, o))),
        ]
        if hasattr(mlp, "experts"):
            layer_parts += _experts(mlp.experts, a, shape, layout, part)
        elif hasattr(mlp, "linear_fc1"):  # a dense MLP
            fc1_rows, inner = mlp.linear_fc1.weight.shape[0] // 2 * layout.tp, mlp.linear_fc2.weight.shape[1] * layout.tp
            layer_parts += [
                (mlp.linear_fc1, {gate: (fc1_rows, cols), up: (fc1_rows, cols)},
                 shards.gated(lambda g, u, names=(gate, up): (part(g, names[0]), part(u, names[1])))),
                (mlp.linear_fc2, {down: (cols, inner)}, shards.cols(lambda w, d=down: part(w, d))),
            ]
        for module, shapes, quantise in layer_parts:
            chosen = {n: s for n, s in shapes.items() if n in targets}
            if chosen:
                plan.append((module, quantise))
                quantised.update(chosen)
    mine = {n for n in targets if _layer(n) in layout.layers(shape.layers)}
    if mine - quantised.keys():
        left = sorted(mine - quantised.keys())
        raise ConfigError(f"trainer.weight_format={fmt!r} (precision.train): the other stages quantise "
                          f"{', '.join(left[:5])}{f' and {len(left) - 5} more' if len(left) > 5 else ''}, which no "
                          f"Megatron linear layer computes here; keep them in high precision (precision.exceptions) "
                          f"or use trainer.backend=torch")
    check_fits(quantised, fmt)  # every misfit in one error, before any layer changes
    for module, quantise in plan:
        _wrap(module, quantise)
    return sorted(quantised)


def _wrap(module: Any, quantise: Callable[[Tensor], Tensor]) -> None:
    """The layer's matmul sees ``quantise(weight)``: Megatron's parallel linears compute through
    ``_forward_impl(input, weight, ...)``, which the wrapper hands the quantised weight."""
    impl = module._forward_impl

    def forward_impl(input: Tensor, weight: Tensor, *args: Any, **kwargs: Any) -> Any:
        return impl(input, quantise(weight), *args, **kwargs)

    module._forward_impl = forward_impl


def _experts(experts: Any, a: str, shape: Any, layout: hm.RankLayout,
             part: Callable[[Tensor, str], Tensor]) -> list[tuple[Any, dict[str, tuple[int, ...]], Any]]:
    """This rank's experts of one MoE layer: each expert's ``[gate; up]`` and ``down`` matrices
    quantised whole, as the stacked Hugging Face weights' slices ``[e]`` are."""
    gate_up, down = f"{a}mlp.experts.gate_up_proj", f"{a}mlp.experts.down_proj"
    shards = Shards(layout.etp, layout.etp_rank, _etp_group() if layout.etp > 1 else None)
    out = []
    for expert in experts.local_experts:
        rows, inner = expert.linear_fc1.weight.shape[0] // 2 * layout.etp, expert.linear_fc2.weight.shape[1] * layout.etp
        out += [
            (expert.linear_fc1, {gate_up: (shape.experts, 2 * rows, shape.hidden)},
             shards.gated(lambda g, u: part(torch.cat([g, u]), gate_up).chunk(2))),
            (expert.linear_fc2, {down: (shape.experts, shape.hidden, inner)}, shards.cols(lambda w: part(w, down))),
        ]
    return out


def _etp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_group()


def _layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def _tp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


class _Gather(torch.autograd.Function):
    """The whole weight from every rank's shard along ``dim``; the gradient of this rank's shard is
    its own slice (each rank computes with its own shard of whatever is built from the whole)."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, dim: int, world: int, rank: int, group: Any) -> Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous(), group=group)
        ctx.dim, ctx.rank, ctx.size = dim, rank, shard.shape[dim]
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None, None, None


class Shards:
    """Lifts a whole-weight quantisation to a tensor-parallel rank's shard (identity at TP 1)."""

    def __init__(self, world: int, rank: int, group: Any) -> None:
        self.world, self.rank, self.group = world, rank, group

    def _whole(self, shard: Tensor, dim: int) -> Tensor:
        return shard if self.world == 1 else _Gather.apply(shard, dim, self.world, self.rank, self.group)

    def _mine(self, whole: Tensor, dim: int) -> Tensor:
        return whole if self.world == 1 else whole.chunk(self.world, dim=dim)[self.rank]

    def rows(self, quantise: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """A column-parallel weight (split by rows: ``linear_qkv`` by query groups)."""
        return lambda w: self._mine(quantise(self._whole(w, 0)), 0)

    def cols(self, quantise: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """A row-parallel weight (split by columns: ``linear_proj``, ``linear_fc2``)."""
        return lambda w: self._mine(quantise(self._whole(w, 1)), 1)

    def gated(self, quantise: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> Callable[[Tensor], Tensor]:
        """``linear_fc1``: each rank holds ``[gate shard; up shard]``."""
        def apply(w: Tensor) -> Tensor:
            pieces = [p.chunk(2, dim=0) for p in self._whole(w, 0).chunk(self.world, dim=0)]
            gate, up = quantise(torch.cat([g for g, _ in pieces]), torch.cat([u for _, u in pieces]))
            return torch.cat([self._mine(gate, 0), self._mine(up, 0)], dim=0)
        return apply

"""Quantisation-aware training on the Megatron backend: the same values as the torch backend's
(:mod:`miles_engine.precision.qat`), so trainer and engines compute with identical weights.

Megatron fuses the Hugging Face linear layers (``q/k/v`` per query group into ``linear_qkv``,
``[gate; up]`` into ``linear_fc1``), and a format's blocks and scales belong to each Hugging Face
weight (FP8's 128x128 tiles, NVFP4's per-tensor scale). So each fused weight is split back into its
Hugging Face parts in the forward, each part fake-quantised under its own name (the exception list
read by those names), and fused again -- differentiable reshapes around the straight-through
quantizer: the gradient reaches the Megatron parameter unchanged. Tensor parallelism would hand
each rank a shard of a weight whose blocks and scales span the whole (refused); MoE experts are
not ``nn.Linear`` in the Hugging Face model and stay in high precision there, while the router is
(refused rather than left out of one stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from miles_engine.errors import ConfigError
from miles_engine.precision.quantizer import fake_quantize
from miles_engine.precision.targets import check_fits, is_exception
from miles_engine.trainer.megatron import hf_mapping as hm


def apply(gpt: Any, shape: Any, layout: hm.RankLayout, fmt: str, exceptions: Iterable[str] = ()) -> list[str]:
    """Fake-quantise the forward of this rank's decoder linear layers; returns the Hugging Face
    names of the weights quantised."""
    if layout.tp > 1 or layout.etp > 1:
        raise ConfigError(f"trainer.weight_format={fmt!r} (precision.train) with megatron.tensor_parallel="
                          f"{layout.tp}: each rank would quantise a shard of weights whose {fmt} blocks and scales "
                          f"span the whole weight; use tensor_parallel=1 (data and pipeline parallel are fine)")
    if shape.moe:
        raise ConfigError(f"trainer.weight_format={fmt!r} (precision.train) on a MoE model with the megatron "
                          f"backend: its router is quantised by the other stages but computed by Megatron outside a "
                          f"linear layer; use trainer.backend=torch")
    exceptions = tuple(exceptions)
    quantised: dict[str, tuple[int, ...]] = {}
    plan: list[tuple[Any, Callable[[Tensor], Tensor]]] = []

    def part(t: Tensor, name: str) -> Tensor:
        return t if is_exception(name, exceptions) else fake_quantize(t, fmt, name)

    layers = gpt.decoder.layers
    for local, i in enumerate(layout.layers(shape.layers)):
        a, layer = f"model.layers.{i}.", layers[local]
        attn, mlp = layer.self_attention, layer.mlp
        q, k, v, o = (f"{a}self_attn.{p}_proj.weight" for p in "qkvo")
        gate, up, down = (f"{a}mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
        qkv_rows = (shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.kv_heads * shape.head_dim)
        fc1_rows, cols = mlp.linear_fc1.weight.shape[0] // 2, shape.hidden
        layer_parts = [
            (attn.linear_qkv, {q: (qkv_rows[0], cols), k: (qkv_rows[1], cols), v: (qkv_rows[2], cols)},
             lambda w, names=(q, k, v): hm._fuse_qkv(*map(part, hm._split_qkv(w, shape), names), shape)),
            (attn.linear_proj, {o: tuple(attn.linear_proj.weight.shape)}, lambda w, o=o: part(w, o)),
            (mlp.linear_fc1, {gate: (fc1_rows, cols), up: (fc1_rows, cols)},
             lambda w, names=(gate, up): torch.cat(list(map(part, w.chunk(2, dim=0), names)), dim=0)),
            (mlp.linear_fc2, {down: tuple(mlp.linear_fc2.weight.shape)}, lambda w, d=down: part(w, d)),
        ]
        for module, shapes, quantise in layer_parts:
            chosen = {n: s for n, s in shapes.items() if not is_exception(n, exceptions)}
            if chosen:
                plan.append((module, quantise))
                quantised.update(chosen)
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

"""Micro-batches on Megatron ranks, through the pipeline stages when PP > 1.

Every rank of a data-parallel replica (its TP and PP peers) holds the same rows and plans the
same micro-batches, and gradients are averaged after the last one (not by collectives inside
the backward, as FSDP does), so no rank runs the zero-weight dummy micro-batches the FSDP
backend needs (except with EP > 1, see :func:`run_micro_batches`). With PP > 1 each micro-batch
goes forward stage by stage (hidden states ``[tokens, rows, hidden]`` sent to the next stage), the
last stage runs the loss function - the torch backend's, on its logits - and the backward returns
stage by stage; one micro-batch
at a time (the GPipe order without overlap: exact, not yet pipelined for speed). Metrics are the
last stage's, broadcast to the other stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from miles_engine.trainer.batch import MicroBatch, StepBatch
    from miles_engine.trainer.megatron.trainer import MegatronTrainer


def _stage_micro_batch(tr: MegatronTrainer, mb: MicroBatch, fn: Callable, grad: bool
                       ) -> tuple[Tensor | None, dict[str, Tensor]]:
    from megatron.core import parallel_state as ps

    ids = mb.get("token_ids", tr.device)
    shape = (ids.shape[1], ids.shape[0], tr.shape.hidden)
    grad = grad and torch.is_grad_enabled()
    inp = None
    if not tr.policy.pre_process:
        inp = torch.empty(shape, dtype=torch.float32, device=tr.device)
        dist.recv(inp, src=ps.get_pipeline_model_parallel_prev_rank())
        inp.requires_grad_(grad)
    tr.policy.set_stage_input(inp)
    loss, metrics = None, {}
    try:
        if tr.policy.post_process:
            loss, metrics = fn(mb)
            if grad:
                (loss * tr.comm.world_size).backward()
        else:
            tr.set_routing(mb)
            with tr.autocast():
                out = tr.policy(input_ids=ids).hidden_states[0].float()
            dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            if grad:
                g = torch.empty_like(out)
                dist.recv(g, src=ps.get_pipeline_model_parallel_next_rank())
                out.backward(g)
        if inp is not None and grad:
            dist.send(inp.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    finally:
        tr.policy.set_stage_input(None)
    return loss, metrics


def run_micro_batches(tr: MegatronTrainer, batch: StepBatch, plan: list[list[int]], fn: Callable,
                      dummy: Callable[[], Tensor], *, grad: bool = True, keys: Sequence[str] = ()
                      ) -> dict[str, Tensor]:
    """``fn`` on each micro-batch of ``plan`` (then backward when ``grad``). With EP > 1 every rank
    runs as many micro-batches as the rank with most (``dummy``: zero-weight ones), since each MoE
    forward and backward is a collective over the expert-parallel group."""
    sums = {k: torch.zeros((), dtype=torch.float64) for k in keys}
    n = tr.n_micro(plan) if tr.layout.ep > 1 else len(plan)
    for i in range(n):
        if i >= len(plan):
            loss, metrics = dummy(), {}
            if grad:
                loss.backward()
        elif tr.layout.pp == 1:
            loss, metrics = fn(batch.slice(plan[i]))
            if grad:
                (loss * tr.comm.world_size).backward()
        else:
            loss, metrics = _stage_micro_batch(tr, batch.slice(plan[i]), fn, grad)
        if metrics.keys() - sums.keys():
            raise RuntimeError(f"metrics {sorted(metrics.keys() - sums.keys())} are not declared in keys")
        for k, v in metrics.items():
            sums[k] = sums[k] + v.detach().double().cpu()
    tr.set_routing(None)
    return sums


def last_stage_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The last stage's metrics on every stage of the pipeline (PP > 1; a collective)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]


def reduce_tied_embedding_grads(tr: MegatronTrainer) -> None:
    """Tied embeddings over PP: the first stage's embedding and the last stage's output-layer
    copy are one HF tensor, so their gradients are summed (megatron-core's embedding group)."""
    from megatron.core import parallel_state as ps

    if not tr.shape.tied or tr.layout.pp == 1:
        return
    gpt = tr.policy.gpt
    weight = gpt.embedding.word_embeddings.weight if tr.policy.pre_process else gpt.output_layer.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())

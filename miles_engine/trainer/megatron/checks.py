"""Self-checks run on a Megatron rank (``trainer.call(fn, ...)``): the weight mapping against a
real ``GPTModel`` and the HF model, and the routes a replayed MoE forward takes. Used by the
tests and ``scripts/gpu_check.sh``; they need a one-stage rank (pipeline_parallel=1)."""

from __future__ import annotations

from typing import Any

import torch

from miles_engine.trainer.megatron.gpt import HFCausalLM, build_gpt, shape_of
from miles_engine.trainer.models import build_causal_lm


def round_trip(tr: Any, source: Any, ids: list[list[int]]) -> dict[str, Any]:
    """HF ``source`` -> this rank's Megatron shards (loaded into a new GPTModel) -> HF again:
    the names whose tensors are not bit-identical, and the largest logit difference between the
    Megatron model and the HF model on ``ids``."""
    hf = build_causal_lm(source, torch.device("cpu"), tr.config.seed).eval()
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    shape = shape_of(hf.config)
    m = tr.config.megatron
    gpt = build_gpt(hf.config, tp=m.tensor_parallel, pp=m.pipeline_parallel, ep=m.expert_parallel,
                    sp=m.sequence_parallel)
    tr._load_params(gpt, hf_state, shape)
    back = tr._gathered({k: v.detach() for k, v in gpt.named_parameters()}, shape)
    lm = HFCausalLM(gpt, hf.config).eval()
    x = torch.tensor(ids)
    with torch.no_grad():
        diff = float((lm(input_ids=x).logits - hf(input_ids=x).logits).abs().max())
    if not back:  # not rank 0
        return {}
    return {"names": list(back) == list(hf_state), "mismatched": [k for k in hf_state if not torch.equal(back[k],
                                                                                                      hf_state[k])],
            "logits_max_diff": diff}


def replayed_forward(tr: Any, ids: list[list[int]], routes: torch.Tensor) -> dict[str, Any]:
    """The policy's forward on ``ids`` with ``routes`` (``[rows, tokens, layers, top_k]``, -1: the
    router's choice) replayed: logits and the experts each MoE layer used."""
    tr.replay.set(routes)
    try:
        with torch.no_grad():
            logits = tr.policy(input_ids=torch.tensor(ids, device=tr.device)).logits.cpu()
    finally:
        tr.replay.set(None)
    return {"logits": logits, "experts": [t.cpu() if t is not None else None for t in tr.replay.last]}


def step_shapes(tr: Any) -> dict[str, Any]:
    """Where this rank sits (rank 0's answer): for tests and the GPU check."""
    mem = torch.cuda.max_memory_allocated() / 2**30 if tr.device.type == "cuda" else 0.0
    return {"layout": tr.layout, "dp": tr.comm.world_size, "params": sum(p.numel() for p in tr.policy.parameters()),
            "max_memory_gib": mem}

"""Expert parallelism (EP > 1): the MoE token dispatch with a different number of tokens on each
expert-parallel rank.

megatron-core's ``allgather`` dispatcher gathers every rank's tokens over the TP x EP group with
``all_gather_into_tensor``, which needs the same token count on every rank. EP ranks are
data-parallel ranks holding *different* rows (their own micro-batches, their own lengths), so
:class:`PaddedAllGatherDispatcher` first agrees on the largest count in the group (one all-reduce
of a scalar), pads its tokens to it with rows routed to no expert (probability 0), and cuts the
padding off after the combine. Padding rows reach no expert, so the real tokens' outputs and
gradients are exactly the unpadded ones. (The ``alltoall`` dispatcher takes uneven counts but is
built on CUDA streams; gloo runs all_gather / reduce_scatter, which is all this one needs.)

Every rank of an EP group must also run the *same number* of MoE forwards (and backwards): the
micro-batch loop pads the plan with zero-weight dummy micro-batches (:mod:`.pipeline`), as the
FSDP backend does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _dispatcher_class() -> type:
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class PaddedAllGatherDispatcher(MoEAllGatherTokenDispatcher):
        def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor
                                ) -> tuple[Tensor, Tensor]:
            hidden, probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
            self.local_tokens = n = hidden.shape[0]
            most = torch.tensor([n], dtype=torch.long, device=hidden.device)  # NCCL on GPUs: a device tensor
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.tp_ep_group)
            pad = int(most.item()) - n
            if pad:
                hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
                probs = torch.cat([probs, probs.new_zeros(pad, probs.shape[1])])
                routed = self.routing_map
                self.routing_map = torch.cat([routed, routed.new_zeros(pad, routed.shape[1])])
            return hidden, probs

        def combine_postprocess(self, hidden_states: Tensor) -> Tensor:
            return hidden_states[: self.local_tokens].view(self.hidden_shape)

    return PaddedAllGatherDispatcher


def pad_token_dispatch(model: nn.Module) -> int:
    """Give every MoE layer of ``model`` the padded dispatcher (their state is the allgather
    dispatcher's; only two methods differ). Returns the number of layers changed."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    cls = _dispatcher_class()
    n = 0
    for module in model.modules():
        dispatcher: Any = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, MoEAllGatherTokenDispatcher):
            dispatcher.__class__ = cls
            n += 1
    return n

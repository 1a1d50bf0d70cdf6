"""How the trainer talks to its peers: nothing (one process) or FSDP2 over a device mesh.

:class:`Local` is the identity; :class:`FSDP2` shards modules with ``fully_shard`` (one
group per decoder layer plus the root), reduces metrics with all-reduce and gathers full
state dicts on rank 0. The trainer code is the same for both.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn


class Local:
    rank = 0
    world_size = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_min(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def shard(self, module: nn.Module) -> nn.Module:
        return module

    def model_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in module.state_dict().items()}

    def full_state(self, root: nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[dict, list[dict]]:
        """Full (unsharded, CPU) model and optimizer state dicts, keyed by parameter names
        (portable between backends); on ranks other than 0 they may be empty."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(root, options=opts),
                [get_optimizer_state_dict(root, opt, options=opts) for opt in optimizers])

    def load_full_state(self, root: nn.Module, model_sd: dict,
                        optimizers: list[tuple[torch.optim.Optimizer, dict]], strict: bool = True) -> None:
        """Inverse of :meth:`full_state` (multi-rank: rank 0's dicts are broadcast); ``strict=False``:
        ``model_sd`` may hold a subset (LoRA checkpoints: the adapters only)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world_size > 1, strict=strict)
        set_model_state_dict(root, model_sd, options=opts)
        for opt, osd in optimizers:
            set_optimizer_state_dict(root, opt, osd, options=opts)

    def close(self) -> None:
        pass


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one (``_no_split_modules`` classes of HF models)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not layers:
        for m in model.modules():
            if isinstance(m, nn.ModuleList) and len(m) > 1:
                return list(m)
    return layers


class FSDP2(Local):
    """FSDP2 (``fully_shard``) on a 1-D mesh over the default process group."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("FSDP2 needs an initialised process group (torch.distributed.init_process_group)")
        self.dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device
        self.mesh = init_device_mesh(device.type, (self.world_size,))
        # HF models and the value head return views; nothing here modifies outputs in place
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    def _reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        buf = t.detach().clone().to(self.device)
        self.dist.all_reduce(buf, op=op)
        return buf.to(t.device)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, self.dist.ReduceOp.SUM)

    def all_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, self.dist.ReduceOp.MAX)

    def all_min(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, self.dist.ReduceOp.MIN)

    def shard(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(module):
            fully_shard(layer, mesh=self.mesh)
        fully_shard(module, mesh=self.mesh)
        return module

    def model_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

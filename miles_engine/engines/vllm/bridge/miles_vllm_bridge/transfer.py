"""The ``miles`` weight-transfer backend of vLLM (``--weight-transfer-config '{"backend": "miles"}'``).

The trainer's broadcast transport builds one process group for all its engines: rank 0 in the
trainer (a ``TCPStore`` it owns), engine i as rank i + 1, the group constructed directly over a
``PrefixStore("miles/<group name>")`` (never ``init_process_group``: vLLM's workers already own the
default group). This backend joins that group from each vLLM worker (``/init_weight_transfer_engine``)
and, per bucket (``/update_weights``), receives the tensors rank 0 broadcasts -- one by one, or as one
flat ``uint8`` buffer (``flat``) -- and loads them with the model's own ``load_weights`` (which packs
``q/k/v`` into ``qkv_proj`` and so on), between vLLM's layerwise-reload start and finish. An FP8
weight arrives as its codes and scales and loads under the checkpoint's names (``fp8.py``).

Kept in step by hand with ``miles_engine/weights/dist.py`` (the group) and ``weights/tensors.py``
(the flat layout): vLLM's environment has no miles_engine to import.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "miles"


@dataclass
class MilesInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"  # the process group's: gloo (CPU) or nccl (GPU)
    timeout_s: float = 600.0


@dataclass
class MilesUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    flat: bool = False  # the bucket comes as one uint8 buffer, each tensor at an aligned offset

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)) or not self.names:
            raise ValueError(f"names, dtype_names and shapes must be non-empty lists of one length (got "
                             f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})")


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def join_group(info: MilesInitInfo, rank: int) -> Any:
    """Join the trainer's group with the key layout of SGLang's custom groups (``<group>`` /
    ``<group>/`` / ``<first device of the backend>/``), as ``miles_engine/weights/dist.py`` builds it."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    if info.backend not in ("gloo", "nccl"):
        raise ValueError(f"process-group backend {info.backend!r} is not one of: gloo, nccl")
    timeout = datetime.timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(info.master_address, info.master_port, info.world_size, is_master=False, timeout=timeout)
    device = next(iter(BackendConfig(Backend(info.backend)).get_device_backend_map()))
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{info.group_name}/",
                                                               dist.PrefixStore(info.group_name, store)))
    if info.backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if _loopback(info.master_address)
                         else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(prefixed, rank, info.world_size, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, info.world_size, opts)


def _quantized(vllm_config: Any) -> bool:
    return getattr(vllm_config, "quant_config", None) is not None


def start_reload(model: torch.nn.Module, vllm_config: Any) -> None:
    """A quantized model reprocesses each layer once all its checkpoint tensors are in (vLLM's layerwise
    reload); an unquantized one takes ``load_weights`` in place, a part of the tensors at a time."""
    if _quantized(vllm_config):
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(model)


def finish_reload(model: torch.nn.Module, vllm_config: Any) -> None:
    if _quantized(vllm_config):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(model, vllm_config.model_config)


ALIGN = 64  # weights/tensors.py: each tensor of a flat bucket starts at a multiple of this


def flat_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> tuple[list[tuple[int, int]], int]:
    """(offset, nbytes) of each tensor in a flat bucket and the bucket's size (weights/tensors.layout)."""
    spans, off = [], 0
    for dtype, shape in zip(dtypes, shapes):
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        spans.append((off, size))
        off += -(-size // ALIGN) * ALIGN
    return spans, off


class MilesWeightTransferEngine(WeightTransferEngine[MilesInitInfo, MilesUpdateInfo]):
    init_info_cls = MilesInitInfo
    update_info_cls = MilesUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self.comm_device = torch.device("cpu")
        self._held: dict[str, Any] | None = None  # the model's FP8 weights, found before the first reload

    def init_transfer_engine(self, init_info: MilesInitInfo) -> None:
        self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank
        self.comm_device = (torch.device("cuda", torch.cuda.current_device()) if init_info.backend == "nccl"
                            else torch.device("cpu"))
        self.group = join_group(init_info, rank)

    def start_weight_update(self) -> None:
        if self._held is None:
            from miles_vllm_bridge.fp8 import held_fp8

            self._held = held_fp8(self.model)
        start_reload(self.model, self.vllm_config)

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from miles_vllm_bridge.fp8 import to_checkpoint_names

        self.model.load_weights(to_checkpoint_names(named, self._held or {}))

    def finish_weight_update(self) -> None:
        finish_reload(self.model, self.vllm_config)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream().synchronize()

    def receive_weights(self, update_info: MilesUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("the miles weight transfer has no group: call /init_weight_transfer_engine first")
        dtypes = [getattr(torch, d.removeprefix("torch.")) for d in update_info.dtype_names]
        if update_info.flat:
            spans, total = flat_layout(dtypes, update_info.shapes)
            buf = torch.empty(total, dtype=torch.uint8, device=self.comm_device)
            self._broadcast(buf)
            self._load([(name, buf[off:off + size].view(dtype).reshape(shape))
                        for name, dtype, shape, (off, size) in zip(update_info.names, dtypes, update_info.shapes, spans)])
            return
        for name, dtype, shape in zip(update_info.names, dtypes, update_info.shapes):
            weight = torch.empty(shape, dtype=dtype, device=self.comm_device)
            self._broadcast(weight)
            self._load([(name, weight)])

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            abort = getattr(group, "abort", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # noqa: BLE001 - best effort: the group may be dead already
                    pass


def register() -> None:
    """Make ``miles`` a weight-transfer backend in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, MilesWeightTransferEngine)

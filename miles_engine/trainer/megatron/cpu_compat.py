"""megatron-core on a machine without a GPU: the CUDA-only assumptions it makes, handled.

megatron-core 0.16.1 assumes CUDA in a few places that a CPU run (gloo ranks) reaches:

1. ``tensor_parallel.random.CudaRNGStatesTracker`` stores and forks *CUDA* generator states
   (``torch.cuda.get_rng_state`` / ``manual_seed``) around weight init and dropout. Here the
   tracker keeps CPU generator states and forks with ``torch.random.fork_rng(devices=[])``.
2. Buffers and scratch tensors are allocated on ``torch.cuda.current_device()`` (the global
   memory buffer used by the attention and the TP all-gathers, rotary frequencies, the MoE
   router's weights and token counters, the TP mappings' all-gather outputs). Here
   ``torch.cuda.current_device`` answers the CPU device. This is process-wide, which is why
   :func:`enable` runs only in processes without a GPU (the trainer's rank processes).
3. Without Transformer Engine, ``moe_utils.te_general_gemm`` is never defined, so the MoE
   router's gating raises ``NameError``: it is defined as ``None`` (the plain matmul path).
   This one is not about CUDA and is applied on GPUs too (:func:`fix_missing_te`).
4. ``transformer.utils.get_default_causal_mask`` builds the causal mask with ``device="cuda"``
   (the local attention's softmax asks for it): here it is built on the CPU (and cached per length).

5. ``LanguageModule.setup_embeddings_and_output_layer`` (tied embeddings over pipeline stages)
   moves the shared weight with ``weight.data.cuda()`` before its all-reduce: during that call
   only, ``Tensor.cuda`` leaves CPU tensors where they are.

Nothing changes when a GPU is present: :func:`enable` returns ``False`` without touching anything.

6. Without Apex (here, and on GPUs without it) the local spec's norms are ``WrappedTorchNorm``,
   which refuses ``sequence_parallel`` only because plain torch norms do not tag their weights for
   megatron-core's sequence-parallel gradient all-reduce. The backend sums those gradients over TP
   itself (``MegatronTrainer._reduce_grads``), so :func:`torch_norm_with_sequence_parallel` builds
   them from a copy of the config with the flag off (a norm acts per token: nothing else changes).

7. ``dist_checkpointing``'s ``torch_dist`` writer copies tensors to the host with
   ``non_blocking=True`` and then calls ``torch.cuda.synchronize()`` (``preload_tensors``):
   here the copy is blocking (a CPU tensor's ``.to("cpu")`` is itself), so no CUDA call is made.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

_enabled = False


def needed() -> bool:
    return not torch.cuda.is_available()


class CPURNGStatesTracker:
    """``CudaRNGStatesTracker`` with CPU generator states (same methods Megatron calls)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()


def _cpu_device() -> torch.device:
    return torch.device("cpu")


@functools.lru_cache(maxsize=64)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_setup_embeddings(original: Any) -> Any:
    @functools.wraps(original)
    def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    return setup


def torch_norm_with_sequence_parallel() -> None:
    """Item 6 (idempotent): ``WrappedTorchNorm`` accepts a sequence-parallel config."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if getattr(WrappedTorchNorm.__new__, "_miles_sp", False):
        return
    original = WrappedTorchNorm.__new__

    def new(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        if config.sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        return original(cls, config, *args, **kwargs)

    new._miles_sp = True  # type: ignore[attr-defined]
    WrappedTorchNorm.__new__ = new  # type: ignore[method-assign]


def _blocking_preload(original: Any) -> Any:
    @functools.wraps(original)
    def preload(write_buckets: Any, non_blocking: bool = True) -> Any:
        return original(write_buckets, non_blocking=False)
    return staticmethod(preload)


def fix_missing_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def enable() -> bool:
    """Patch megatron-core for this CPU-only process (idempotent); ``False`` when a GPU is
    present (nothing patched). Call before building any Megatron module."""
    global _enabled
    fix_missing_te()
    if not needed():
        return False
    if _enabled:
        return True
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    tp_random.CudaRNGStatesTracker = CPURNGStatesTracker  # type: ignore[misc]
    tp_random.initialize_rng_tracker(force_reset=True)
    utils.get_default_causal_mask = _causal_mask
    fused_softmax.get_default_causal_mask = _causal_mask
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _cpu_setup_embeddings(
        LanguageModule.setup_embeddings_and_output_layer)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    FileSystemWriterAsync.preload_tensors = _blocking_preload(FileSystemWriterAsync.preload_tensors)
    assert isinstance(tensor_parallel.get_cuda_rng_tracker(), CPURNGStatesTracker)
    _enabled = True
    return True

"""megatron-core's ``torch_dist`` checkpoint writer, writing in the rank process itself.

``FileSystemWriterAsync`` (used by ``TorchDistSaveShardedStrategy``, GPU or not) collects its
results through a ``multiprocessing.Manager`` and writes each bucket in a forked child. Our
trainer ranks are *daemonic* processes (they die with the driver: no orphans), and daemonic
processes may not have children, so that save fails with "daemonic processes are not allowed to
have children". :class:`InProcessWriter` writes the same buckets (same files, same fsync) one
after the other in the calling thread, through megatron's own per-bucket function; :func:`enable`
makes the strategy use it. Applied in every rank process of this backend (GPU too: the ranks are
daemonic there as well); the files are byte-for-byte megatron's format.
"""

from __future__ import annotations

import queue
from typing import Any


def _writer_class() -> type:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    class InProcessWriter(FileSystemWriterAsync):
        @staticmethod
        def write_preloaded_data_multiproc(transform_list: Any, use_msc: bool, rank: int, write_buckets: Any,
                                           global_results_queue: Any) -> None:
            results: dict[int, Any] = {}
            for i, bucket in enumerate(write_buckets):
                local: queue.Queue = queue.Queue()
                count: queue.Queue = queue.Queue()
                count.put(i)
                kwargs = {"use_msc": use_msc} if use_msc else {}
                FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, **kwargs)
                idx, out = local.get_nowait()
                if isinstance(out, Exception):
                    global_results_queue.put(out)
                    return
                results[idx] = out
            global_results_queue.put(results)

    return InProcessWriter


_ENABLED = False


def enable() -> None:
    """Make megatron-core's ``torch_dist`` save strategy write in-process (idempotent)."""
    global _ENABLED
    if _ENABLED:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    filesystem_async._results_queue = queue.Queue()  # its results queue, not a Manager process's
    torch_strategy.FileSystemWriterAsync = _writer_class()
    _ENABLED = True

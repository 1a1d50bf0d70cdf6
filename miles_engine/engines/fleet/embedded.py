"""``embedded``: engines in the driver process (PyTorch, CPU or GPU)."""

from __future__ import annotations

import asyncio
import copy
import sys
from contextlib import AsyncExitStack
from typing import Any

from miles_engine.engines.fleet.config import EmbeddedKindOptions, EngineGroupConfig
from miles_engine.engines.fleet.kinds import FleetContext


class EmbeddedKind:
    in_process = True
    transports = ("colocated", "disk_delta")

    def __init__(self, options: EmbeddedKindOptions) -> None:
        self.options = options

    @staticmethod
    def precision_refusal(weight_format: str, kv_cache: str, group: EngineGroupConfig) -> str | None:
        return None  # our engines hold every format and the FP8 KV cache

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext, stack: AsyncExitStack) -> list[Any]:
        from miles_engine.engines.embedded import EmbeddedEngine

        o = self.options
        engines = []
        for i in range(group.replicas):
            source = ctx.model if isinstance(ctx.model, str) else copy.deepcopy(ctx.model)
            engine = await asyncio.to_thread(
                EmbeddedEngine.from_model, source, dtype=group.dtype, device=group.replica_device(i),
                max_batch_size=o.max_batch_size, num_threads=o.threads, seed=ctx.seed + i,
                prompt_cache_tokens=o.prompt_cache_tokens, true_on_policy=ctx.true_on_policy,
                weight_format=ctx.weight_format, weight_exceptions=ctx.weight_exceptions, kv_cache=ctx.kv_cache,
                speculative=o.speculative)
            engine.name = name if group.replicas == 1 else f"{name}-{i}"
            stack.push_async_callback(engine.aclose)
            engines.append(engine)
        if o.gil_switch_interval_ms is not None:
            previous = sys.getswitchinterval()
            sys.setswitchinterval(o.gil_switch_interval_ms / 1000)
            stack.callback(sys.setswitchinterval, previous)
        return engines

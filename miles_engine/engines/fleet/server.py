"""``server``: our engine server (``python -m miles_engine.run.engine_server``) as processes the
run launches on loopback and supervises: a process that dies or hangs is restarted with the
trainer's current weights and version, and the requests it held are re-sent."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

from miles_engine.engines.fleet.config import EngineGroupConfig, ServerKindOptions
from miles_engine.engines.fleet.kinds import FleetContext


class ServerKind:
    in_process = False
    placeable = True
    transports = ("broadcast", "disk_delta", "p2p")

    def __init__(self, options: ServerKindOptions) -> None:
        self.options = options

    @staticmethod
    def precision_refusal(weight_format: str, kv_cache: str, group: EngineGroupConfig) -> str | None:
        return None  # our engines hold every format and the FP8 KV cache

    def command(self, group: EngineGroupConfig, ctx: FleetContext, index: int) -> list[str]:
        from miles_engine.engines.launch import server_command

        o = self.options
        device = ctx.launcher.device(group, index) if ctx.launcher is not None else group.replica_device(index)
        engine_options = {"device": device, "max_batch_size": o.max_batch_size,
                          "prompt_cache_tokens": o.prompt_cache_tokens, "seed": ctx.seed + index,
                          "true_on_policy": ctx.true_on_policy, "weight_format": ctx.weight_format,
                          "weight_exceptions": list(ctx.weight_exceptions), "kv_cache": ctx.kv_cache}
        if o.speculative.enabled:
            engine_options["speculative"] = o.speculative.model_dump()
        return server_command(ctx.model_path(), engine_factory=o.engine_factory, dtype=group.dtype,
                              threads=o.threads, extra=["--engine-options", json.dumps(engine_options),
                                                           "--exit-with-parent"])

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext, stack: AsyncExitStack) -> list[Any]:
        import asyncio

        from miles_engine.engines.supervisor import SupervisedEngine

        o = self.options
        engines = []
        for i in range(group.replicas):
            ename = f"{name}-{i}"
            engines.append(SupervisedEngine(
                self.command(group, ctx, i), name=ename, state_dir=ctx.state_dir / ename, env=ctx.env,
                start_timeout_s=o.start_timeout_s, max_restarts=o.max_restarts,
                health_interval_s=o.health_interval_s, max_request_retries=o.max_request_retries,
                restore=ctx.restore,
                process_factory=None if ctx.launcher is None else ctx.launcher.process_factory(name, i)))
        for engine in engines:
            stack.push_async_callback(engine.aclose)  # registered first: a failed start still stops the others
        await asyncio.gather(*(e.start() for e in engines))
        return engines

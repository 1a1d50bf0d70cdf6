"""``sglang``: SGLang servers launched by the run (GPU machines; the ``sglang`` extra)."""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack
from typing import Any

from miles_engine.engines.fleet.config import EngineGroupConfig, SGLangKindOptions
from miles_engine.engines.fleet.kinds import SGLANG_PAUSE_REFUSED, FleetContext
from miles_engine.errors import ConfigError


class SGLangKind:
    in_process = False
    transports = ("broadcast",)  # SGLang's /update_weights_from_distributed; it has no disk-delta route
    pause_modes_refused = SGLANG_PAUSE_REFUSED

    def __init__(self, options: SGLangKindOptions) -> None:
        self.options = options

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext, stack: AsyncExitStack) -> list[Any]:
        from miles_engine.engines.sglang import SGLangLaunchConfig, SGLangServer

        o = self.options
        model = o.model_path or (ctx.model if isinstance(ctx.model, str) else None)
        if model is None:
            raise ConfigError(f"engine group '{name}' (kind sglang) needs a model directory: set model.path or "
                              f"engines.N.options.model_path (SGLang loads Hugging Face directories)")
        if o.speculative is not None and o.speculative.algorithm == "NGRAM" and not group.device.startswith("cuda"):
            raise ConfigError(f"engine group '{name}' (kind sglang): speculative algorithm NGRAM runs on CUDA only "
                              f"in SGLang; this group's device is {group.device}")
        servers = []
        for i in range(group.replicas):
            env = dict(ctx.env or os.environ)
            if group.device.startswith("cuda"):  # each replica its own tp x dp devices (expert parallelism shares them)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, group.replica_cuda_devices(i, o.tp_size * o.dp_size)))
            cfg = SGLangLaunchConfig(model_path=model, tp_size=o.tp_size, dp_size=o.dp_size, ep_size=o.ep_size,
                                     dtype=group.dtype, mem_fraction_static=o.mem_fraction_static,
                                     speculative=o.speculative,
                                     extra_args=o.extra_args, env=env, start_timeout_s=o.start_timeout_s,
                                     log_path=ctx.state_dir / f"{name}-{i}.log")
            server = SGLangServer(cfg, name=f"{name}-{i}", moe_shape=ctx.routed_experts_shape())
            stack.push_async_callback(server.stop)
            servers.append(server)
        return list(await asyncio.gather(*(s.start() for s in servers)))

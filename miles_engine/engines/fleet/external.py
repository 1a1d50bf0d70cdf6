"""``external``: servers someone else runs, spoken to in their API (``options.api``: ``sglang`` --
SGLang or our own engine server, which speaks it -- or ``vllm``). Health-checked at start (a URL
that does not answer is one error naming it), quarantined by the router while down and
re-admitted when healthy; never launched, restarted or killed by the run."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

from miles_engine.engines.fleet.config import EngineGroupConfig, ExternalKindOptions
from miles_engine.engines.fleet.kinds import SGLANG_PAUSE_REFUSED, VLLM_PAUSE_REFUSED, FleetContext
from miles_engine.errors import ConfigError


class ExternalKind:
    in_process = False

    def __init__(self, options: ExternalKindOptions) -> None:
        self.options = options
        # vLLM servers take weights through its weight-transfer API only (the bridge's backend)
        self.transports = ("broadcast",) if options.api == "vllm" else ("broadcast", "disk_delta")
        self.pause_modes_refused = {"vllm": VLLM_PAUSE_REFUSED, "sglang": SGLANG_PAUSE_REFUSED}.get(options.api, {})

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext, stack: AsyncExitStack) -> list[Any]:
        from miles_engine.engines.http.client import HttpEngine
        from miles_engine.engines.vllm.client import VllmEngine

        urls = self.options.urls
        if group.replicas != len(urls):
            raise ConfigError(f"engine group '{name}': replicas is {group.replicas} but options.urls lists "
                              f"{len(urls)} URL(s); an external group has one engine per URL")
        client = VllmEngine if self.options.api == "vllm" else HttpEngine
        moe_shape = None if self.options.api == "vllm" else ctx.routed_experts_shape()
        engines = [client(url, name=f"{name}-{i}", connect_timeout=self.options.connect_timeout_s, moe_shape=moe_shape)
                   for i, url in enumerate(urls)]
        for engine in engines:
            stack.push_async_callback(engine.aclose)  # closes our client only; the server is not ours
        results = await asyncio.gather(*(self._connect(e) for e in engines), return_exceptions=True)
        down = [f"{e.base_url} ({type(r).__name__}: {str(r).splitlines()[0] if str(r) else 'no answer'})"
                for e, r in zip(engines, results) if isinstance(r, BaseException)]
        if down:
            raise ConfigError(f"engine group '{name}' (kind external): not reachable at start: " + "; ".join(down)
                              + ". Start those servers first, or remove them from options.urls")
        return engines

    async def _connect(self, engine: Any) -> None:
        await asyncio.wait_for(engine.connect(), self.options.connect_timeout_s + 5)
        if not await engine.health():
            raise ConnectionError("/health did not answer 200")

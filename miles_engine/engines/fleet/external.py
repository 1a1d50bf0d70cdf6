"""``external``: SGLang-compatible servers someone else runs. Health-checked at start (a URL
that does not answer is one error naming it), quarantined by the router while down and
re-admitted when healthy; never launched, restarted or killed by the run."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

from miles_engine.engines.fleet.config import EngineGroupConfig, ExternalKindOptions
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.errors import ConfigError


class ExternalKind:
    in_process = False
    transports = ("broadcast", "disk_delta")

    def __init__(self, options: ExternalKindOptions) -> None:
        self.options = options

    async def start(self, group: EngineGroupConfig, name: str, ctx: FleetContext, stack: AsyncExitStack) -> list[Any]:
        from miles_engine.engines.http.client import HttpEngine

        urls = self.options.urls
        if group.replicas != len(urls):
            raise ConfigError(f"engine group '{name}': replicas is {group.replicas} but options.urls lists "
                              f"{len(urls)} URL(s); an external group has one engine per URL")
        engines = [HttpEngine(url, name=f"{name}-{i}", connect_timeout=self.options.connect_timeout_s)
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

"""A policy to evaluate, served: engines of any kind (``eval.engine``; default one embedded
engine) behind their own router and TITO session server.

Used by the ``dedicated`` eval mode (built from the training model, then fed weight snapshots)
and by ``miles eval --checkpoint`` (built from a recipe, then loaded with a checkpoint's
weights). The codec and model are built exactly as the training stack builds them, so a
checkpoint's token ids mean what they meant in training (checked against its tokenizer digest).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_engine.engines.fleet.build import eval_engine_group, eval_transport, start_fleet
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.tito.serve import start_session_server
from miles_engine.weights import create_transport


@dataclass
class ServedPolicy:
    """A group of engines (any kind the ``engines`` section can build) behind a router and its own
    TITO session server, fed weights by a transport; :meth:`aclose` stops them all."""

    engine: Any  # the router over the group
    server: Any
    transport: Any
    stack: AsyncExitStack
    kind: str = "embedded"
    _last: tuple[dict[str, Any], int] | None = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    @classmethod
    async def start(cls, model: Any, codec: Any, cfg: Any, *, hub: Any, state_dir: Path,
                    restore: Any = None) -> ServedPolicy:
        """``restore`` (async, ``-> (tensors, version)``): what a supervised engine restarted before the
        first :meth:`load` serves (afterwards: the last loaded snapshot)."""
        group = eval_engine_group(cfg)
        kind = hub.create("engine", group.kind, group.options, where="eval.engine.options")
        transport_name = eval_transport(group, kind)
        stack = AsyncExitStack()
        served: ServedPolicy | None = None

        async def current() -> tuple[Any, int]:
            if served is not None and served._last is not None:
                return served._last
            if restore is None:
                raise RuntimeError("no weights loaded into the eval engine yet")
            return await restore()

        try:
            ctx = FleetContext(model=model, state_dir=state_dir, seed=cfg.seed, restore=current,
                               true_on_policy=cfg.trainer.true_on_policy)
            router = await start_fleet([group], [kind], ctx, stack, cfg.fleet)
            server = await start_session_server(router, codec, config=cfg.session_server)
            stack.push_async_callback(server.stop)
            options = {"group_name": "miles_eval_weight_sync"} if transport_name == "broadcast" else {}
            transport = create_transport(transport_name, router, **options)
            stack.push_async_callback(transport.close)
        except BaseException:
            await stack.aclose()
            raise
        served = cls(router, server, transport, stack, kind=group.kind)
        return served

    @property
    def url(self) -> str:
        return str(self.server.url)

    async def load(self, tensors: dict[str, Any], version: int) -> None:
        await self.transport.push(list(tensors.items()), version)
        self._last = (tensors, version)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.stack.aclose()

"""``colocated``: the engines live in the trainer's process (embedded engines, or a router of
them); a push is ``engine.update_weights(dict of tensors, version=...)`` between a pause and a
resume. Tensors are cast to the engine's dtype (floating point only) and copied by the engine
(``copy_`` into its own parameters), so later optimizer steps never leak into the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from miles_engine.weights.protocol import PushStats, WeightPushError, engine_name, engines_of, verify_versions, TransportBase

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class ColocatedTransport(TransportBase):
    name = "colocated"

    def __init__(self, engines: Any, *, pause_mode: str = "retract") -> None:
        self.targets = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        if not self.targets:
            raise ValueError("the colocated transport needs at least one engine")
        self.pause_mode = pause_mode
        self._warned_missing = False

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        from miles_engine.weights.tensors import conform, weights_of

        started = time.perf_counter()
        engines = engines_of(self.targets)
        meta = engines[0].weight_metadata() if engines else []
        named = dict(conform(named_tensors, meta, "colocated push"))
        if not named:
            raise WeightPushError(f"push of version {version} carries no tensors")
        stats = PushStats(version=version, tensors=len(named), buckets=1, engines=len(engines),
                          bytes=sum(t.numel() * t.element_size() for t in named.values()))
        # a quantised weight travels as its parts, an adapted one as its adapter's
        stats.missing = len({m.name for m in meta} - weights_of(named))
        if stats.missing and not self._warned_missing:
            self._warned_missing = True
            log.warning("colocated push: %d engine tensors are not pushed (fine for tied weights)", stats.missing)
        paused = time.perf_counter()
        if len(self.targets) == 1 and hasattr(self.targets[0], "swap_weights"):
            await self._swap(self.targets[0], named, version)
        else:
            await self._pause_update_resume(named, version)
        stats.pause_s = time.perf_counter() - paused
        await verify_versions(engines, version)
        stats.push_s = time.perf_counter() - started
        return stats

    async def _swap(self, target: Any, named: dict[str, torch.Tensor], version: int) -> None:
        """One engine: pause, load and resume in one step of its thread."""
        try:
            await target.swap_weights(named, version=version, pause_mode=self.pause_mode)
        except Exception as exc:
            raise WeightPushError(f"push of version {version} to {engine_name(target, 0)} failed: {exc}") from exc

    async def _pause_update_resume(self, named: dict[str, torch.Tensor], version: int) -> None:
        """Several engines (or a router): all pause, each loads, all resume, so none serves
        the new version while another still serves the old one."""
        await asyncio.gather(*(t.pause(self.pause_mode) for t in self.targets))
        try:
            for i, target in enumerate(self.targets):
                # a router keeps the last weights to re-push on readmission: give it a snapshot
                payload = {k: v.clone() for k, v in named.items()} if hasattr(target, "slots") else named
                try:
                    await target.update_weights(payload, version=version)
                except Exception as exc:
                    raise WeightPushError(f"push of version {version} to {engine_name(target, i)} failed: "
                                          f"{exc}") from exc
        finally:
            await asyncio.gather(*(t.resume() for t in self.targets))

    async def close(self) -> None:
        """Nothing to release: the engines belong to the caller."""

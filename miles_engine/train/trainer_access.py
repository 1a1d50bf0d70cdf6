"""The trainer as the run's components see it: one call at a time, off the event loop.

The driver trains and pushes in turn, but an engine restarted mid-step asks for the current
weights at any moment; a trainer whose ranks sit behind pipes (FSDP2) must not see two calls
interleaved, so every call holds one lock and runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from miles_engine.config.recipe import RecipeConfig


class TrainerAccess:
    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._pushed: tuple[dict[str, Any], int] | None = None

    @classmethod
    def create(cls, policy: Any, cfg: RecipeConfig, ranks: Any = None) -> TrainerAccess:
        """``trainer.backend`` picks the backend, ``placement.trainer`` where it runs (the megatron
        backend always runs in rank processes), ``trainer.parallel.world_size`` how many ranks;
        ``ranks``: rank processes placed elsewhere (Ray actors)."""
        from miles_engine.trainer.factory import create_trainer

        return cls(create_trainer(policy, cfg.trainer, subprocess=cfg.placement.trainer == "subprocess", ranks=ranks))

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.to_thread(self._locked, fn, *args)

    @property
    def weight_version(self) -> int:
        return int(self.backend.weight_version)

    async def train_step(self, groups: Sequence[Any]) -> dict[str, float]:
        return await self._call(self.backend.train_step, groups)

    async def sft_step(self, batch: Sequence[Any]) -> dict[str, float]:
        return await self._call(self.backend.sft_step, batch)

    async def named_tensors(self) -> list[tuple[str, Any]]:
        return await self._call(lambda: list(self.backend.named_tensors()))

    def record_push(self, tensors: list[tuple[str, Any]], version: int) -> None:
        """The weights every engine now serves (kept until the next push: the export already made them)."""
        self._pushed = (dict(tensors), int(version))

    async def last_pushed(self) -> tuple[dict[str, Any], int]:
        """The weights and version an engine restarted now must serve: the last pushed ones (the
        trainer may be a step ahead; a delta transport applies its next version on top of these)."""
        if self._pushed is not None:
            return self._pushed
        return await self._call(lambda: (dict(self.backend.named_tensors()), int(self.backend.weight_version)))

    async def state_dict(self) -> dict[str, Any]:
        return await self._call(self.backend.state_dict)

    @property
    def checkpoint_shards(self) -> str | None:
        """Set when the backend's ranks write their own checkpoint shards (see ``save_shards``)."""
        return getattr(self.backend, "checkpoint_shards", None)

    async def save_shards(self, directory: Any) -> dict[str, Any]:
        return await self._call(self.backend.save_shards, directory)

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        await self._call(self.backend.load_state_dict, state)

    def close(self) -> None:
        self._locked(self.backend.close)

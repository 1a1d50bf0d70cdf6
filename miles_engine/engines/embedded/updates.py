"""The embedded engine's weight updates (a mixin of
:class:`~miles_engine.engines.embedded.engine.EmbeddedEngine`): named tensors or a safetensors
directory, quantised parts, adapter parts and co-trained draft tensors, all checked before anything
changes, applied between two forward passes on the engine thread -- alone or as one pause / update /
resume command (:meth:`WeightUpdates.swap_weights`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from miles_engine.engines.embedded import weights as W
from miles_engine.engines.embedded.adapter_bases import AdapterBases, Update
from miles_engine.engines.embedded.draft import DraftWeights
from miles_engine.engines.embedded.held_format import HeldFormat
from miles_engine.engines.embedded.options import EmbeddedEngineOptions
from miles_engine.engines.embedded.scheduler import Scheduler
from miles_engine.engines.protocol import PAUSE_MODES, PauseMode
from miles_engine.errors import EngineRequestError


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise EngineRequestError(f"unknown pause mode {mode!r}; allowed: {', '.join(PAUSE_MODES)}")


class WeightUpdates:
    options: EmbeddedEngineOptions
    _sched: Scheduler
    _tensors: dict[str, Any]
    _held: HeldFormat
    _adapters: AdapterBases
    _draft: DraftWeights
    _speculator: Any

    async def _call(self, fn: Callable[[], Any]) -> Any: ...  # noqa: E704 - the engine's
    def served_tensors(self) -> dict[str, torch.Tensor]: ...  # noqa: E704
    async def pause(self, mode: PauseMode = "retract") -> None: ...  # noqa: E704
    async def resume(self) -> None: ...  # noqa: E704

    async def update_weights(self, weights: Mapping[str, Any] | Path | str, *, version: int | None = None) -> int:
        """Load named tensors (a subset of :meth:`weight_metadata` names is fine) or every
        ``*.safetensors`` file of a directory. Names, shapes and dtypes are all checked first;
        a mismatch raises :class:`WeightUpdateError` and nothing changes. Tensors are copied in
        between two forward passes; the version becomes ``version`` or the old one + 1, and the
        session prefix cache is dropped. Returns the new version."""
        if isinstance(weights, (str, Path)):
            updatable = self.served_tensors() if self.options.speculative.train else self._tensors
            loaded = await asyncio.to_thread(W.from_safetensors, Path(weights), updatable)
            tensors, draft = self._draft.split(loaded)
        else:
            tensors, draft = self._incoming(weights)
        return await self._call(lambda: self._apply_update(tensors, draft, version))

    def _incoming(self, weights: Mapping[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        """An update's policy tensors (adapter parts merged, quantised parts joined) and draft tensors."""
        weights, draft = self._draft.split(weights)
        if not weights and draft:
            return {}, draft
        plain, parts = self._adapters.join(weights, self._tensors, self._held.names)
        return Update(self._held.incoming(plain, self._tensors), plain, parts), draft

    def _apply_update(self, tensors: Any, draft: dict[str, torch.Tensor], version: int | None) -> int:
        """On the engine thread. Only draft tensors: the policy and its version stay as they are."""
        if isinstance(tensors, Update):
            new = self._apply_update(tensors.tensors, draft, version)
            self._adapters.applied(tensors.plain, tensors.parts)
            return new
        if draft:
            self._draft.apply(draft)
            self._speculator.proposer.reset()  # type: ignore[union-attr]
        if not tensors:
            return self._sched.version
        return self._sched.update_weights(tensors, version)

    async def swap_weights(self, weights: Mapping[str, Any], *, version: int | None = None,
                           pause_mode: PauseMode = "retract") -> int:
        """:meth:`pause` (``pause_mode``), :meth:`update_weights`, :meth:`resume` as one command
        of the engine thread: one stop between two forward passes instead of three round trips
        (each waits for the current forward). An engine paused before stays paused."""
        check_pause_mode(pause_mode)
        tensors, draft = self._incoming(weights)
        sched = self._sched
        if pause_mode == "wait":  # the running requests finish on the old weights first
            was_paused = sched.paused
            await self.pause("wait")
            try:
                return await self._call(lambda: self._apply_update(tensors, draft, version))
            finally:
                if not was_paused:
                    await self.resume()

        def swap() -> int:
            was_paused = sched.paused
            sched.pause(pause_mode)
            try:
                return self._apply_update(tensors, draft, version)
            finally:
                if not was_paused:
                    sched.resume()

        return await self._call(swap)

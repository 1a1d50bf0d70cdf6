"""The trainer's side of the check: what it exported, wherever those tensors are.

The check needs, per engine, the trainer's digests as the engine must hold the tensors (cast to
its dtype), the names / dtypes / shapes for the random fill, and the tensors themselves only to
diagnose a tensor whose digest differs. :class:`LocalExport` answers from tensors this process
holds; :class:`~miles_engine.cluster.weight_sender.Rank0Export` (a broadcast from trainer rank
0) has rank 0 compute the digests, so a passing check moves no tensor to the driver.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class LocalExport:
    fetched_bytes = 0

    def __init__(self, named: Iterable[tuple[str, Any]]) -> None:
        from miles_engine.weights.tensors import dtype_name

        self.pushable = named if isinstance(named, list) else list(named)  # what the wrapped transport is given
        self.named = dict(self.pushable)
        effective = getattr(named, "effective", None)
        if effective is not None:  # adapters: the weights they merge into on the engines are checked too
            self.named.update(effective())
        self.specs = [(n, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
                      for n, t in self.named.items()]
        self._digests: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.named)

    async def digests(self, dtypes: Mapping[str, str]) -> dict[str, str]:
        key = tuple(sorted(dtypes.items()))
        if key not in self._digests:
            self._digests[key] = await asyncio.to_thread(_digests, self.named, dtypes)
        return self._digests[key]

    async def fetch(self, names: Sequence[str] | None = None) -> dict[str, Any]:
        return dict(self.named) if names is None else {n: self.named[n] for n in names if n in self.named}


def _digests(named: Mapping[str, Any], dtypes: Mapping[str, str]) -> dict[str, str]:
    from miles_engine.weights.check.compare import as_held
    from miles_engine.weights.tensors import digest

    return {n: digest(as_held(t, dtypes[n], n) if n in dtypes else t) for n, t in named.items()}


def as_export(named: Any) -> Any:
    """``named`` as the check reads it: a rank-0 export as it is, tensors as a :class:`LocalExport`."""
    if hasattr(named, "digests") and hasattr(named, "pushable"):
        return named
    return LocalExport(list(named.items()) if isinstance(named, Mapping) else named)


def engine_dtypes(specs: Sequence[tuple[str, str, Any, int]], meta: Mapping[str, Any]) -> dict[str, str]:
    """Each exported tensor's form as the engine holds it: floating point cast to the engine's
    dtype, and ``+format`` where the engine holds the quantizer's values (``float32+fp8``)."""
    import torch

    from miles_engine.weights.check.compare import held_form

    out = {}
    for name, dtype, _, _ in specs:
        m = meta.get(name)
        mine, theirs = getattr(torch, dtype), getattr(torch, m.dtype) if m is not None else None
        out[name] = held_form(m) if theirs is not None and mine.is_floating_point and theirs.is_floating_point else dtype
    return out

"""Deliberately broken transports for the check-weight-update-equal tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class SkipOne:
    """A transport that forgets one tensor on every push (the bug the check must catch)."""

    def __init__(self, inner: Any, skip: str) -> None:
        self.inner, self.skip, self.name = inner, skip, inner.name
        if hasattr(inner, "preflight"):
            self.preflight = inner.preflight

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> Any:
        return await self.inner.push([(n, t) for n, t in named if n != self.skip], version)

    async def close(self) -> None:
        await self.inner.close()


class Alter:
    """A transport that changes tensors on the way (a lossy load path)."""

    def __init__(self, inner: Any, change: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        self.inner, self.change, self.name = inner, change, inner.name
        if hasattr(inner, "preflight"):
            self.preflight = inner.preflight

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> Any:
        return await self.inner.push([(n, self.change(n, t.detach())) for n, t in named], version)

    async def close(self) -> None:
        await self.inner.close()


def truncate_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """Round toward zero to bfloat16 (a lossy cast: relative error < 2**-7, unlike round-to-nearest)."""
    bits = t.to(torch.float32).contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).reshape(t.shape).to(torch.bfloat16)

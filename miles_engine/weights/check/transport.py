"""``CheckedTransport``: any weight transport, with check-weight-update-equal around its pushes.

First push: pause the engines, overwrite every tensor the trainer exports with random data (same
dtype and shape, never equal to the trainer's bytes), keep the fill's digests, then let the
transport push (it resumes the engines). The version does not move during the fill and nothing
samples the noise: a push that fails after the fill leaves the engines paused. Tensors the
trainer does not export are left alone: nothing would overwrite them (filling them could only
break the engine; tied aliases share storage with an exported tensor and are covered by it). After every push: read each
engine's tensors back (:mod:`.readback`) and compare them with the trainer's copies
(:mod:`.compare`); one :class:`WeightCheckError` lists every engine's bad tensors. Every push is
checked, not only the first: a delta transport's later versions carry other tensors.

The trainer's tensors are held (by reference) until the check ends, so a generator of freshly
gathered tensors costs one model copy more while checking. Given trainer rank 0's export (a
broadcast from rank 0, :mod:`.exported`) the trainer's digests are computed on rank 0 and only
the tensors of a failed comparison come to this process, to name what differs and by how much.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from miles_engine.engines.protocol import engine_version
from miles_engine.models.adapters import split_name
from miles_engine.weights.check.compare import Mismatch, as_held, compare, form_dtype, held_form, random_fill_as
from miles_engine.weights.check.errors import WeightCheckError
from miles_engine.weights.check.exported import as_export, engine_dtypes
from miles_engine.weights.check.options import CheckOptions
from miles_engine.weights.check.readback import EngineReader, reader_for
from miles_engine.weights.protocol import PushStats, WeightPushError, engines_of
from miles_engine.weights.tensors import digest

if TYPE_CHECKING:
    import torch

    from miles_engine.engines.protocol import TensorMeta

log = logging.getLogger(__name__)


class CheckedTransport:
    def __init__(self, inner: Any, engines: Any, options: CheckOptions | None = None) -> None:
        self.inner = inner
        self.targets = engines
        self.options = options or CheckOptions()
        self.name = inner.name
        self.filled = False
        self._fills: dict[int, dict[str, str]] = {}  # id(engine) -> name -> digest of its random fill
        self._preflighted = False

    def __getattr__(self, attr: str) -> Any:  # the wrapped transport's own attributes (flatten, appliers, ...)
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    async def preflight(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        inner = getattr(self.inner, "preflight", None)  # a wrapped transport may predate the no-op default
        if inner is not None:
            await inner(named_tensors)
        self._preflighted = True

    async def rewind(self, version: int) -> list[int]:
        inner = getattr(self.inner, "rewind", None)
        return await inner(version) if inner is not None else []

    # ------------------------------------------------------------------ fill
    def _exact(self, named: Mapping[str, torch.Tensor], meta: Mapping[str, TensorMeta]) -> dict[str, torch.Tensor]:
        out = {}
        for n, t in named.items():
            m = meta.get(n)
            out[n] = as_held(t, held_form(m), n) if m is not None else t.detach().to("cpu")
        return out

    async def _fill(self, engine: Any, export: Any) -> None:
        import torch

        meta = {m.name: m for m in engine.weight_metadata()}
        dtypes = engine_dtypes(export.specs, meta)
        avoid = await export.digests(dtypes)  # a fill never equals the trainer's bytes
        seed = secrets.randbits(63)  # never a seed the trainer's own init could share
        gen = torch.Generator().manual_seed(seed)
        version = await engine_version(engine)
        fills: dict[str, str] = {}
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for name, _, shape, _ in export.specs:
            if name not in meta and meta:
                continue  # the transport itself refuses an unknown name, naming it
            fill = await asyncio.to_thread(random_fill_as, form_dtype(dtypes[name]), shape, gen, avoid[name])
            fills[name] = await asyncio.to_thread(lambda: digest(as_held(fill, dtypes[name], name)))  # as held
            chunk[name] = fill
            size += fill.numel() * fill.element_size()
            if size >= self.options.fill_chunk_bytes:
                await engine.update_weights(chunk, version=version)
                chunk, size = {}, 0
        if chunk:
            await engine.update_weights(chunk, version=version)
        self._fills[id(engine)] = fills
        log.info("check_update_equal: filled %d tensors of %s with random data (seed %d)", len(fills),
                 getattr(engine, "name", type(engine).__name__), seed)

    # ------------------------------------------------------------------ push
    async def _pause(self, engines: list[Any], *, quiet: bool = False) -> None:
        """Pause with the transport's pause mode; ``quiet`` (on a failure path) never masks the error."""
        mode = getattr(self.inner, "pause_mode", None) or getattr(getattr(self.inner, "options", None),
                                                                  "pause_mode", "retract")
        await asyncio.gather(*(e.pause(mode) for e in engines), return_exceptions=quiet)

    async def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushStats:
        export = as_export(named_tensors)
        t0 = time.perf_counter()
        fill_s = 0.0
        if not self.filled:
            if not self._preflighted:
                # disk_delta's default baseline is the engine's initial weights: open it before the fill
                await self.preflight(export.pushable)
            engines = engines_of(self.targets)
            await self._pause(engines)
            try:
                for engine in engines:
                    await self._fill(engine, export)
                self.filled = True
                fill_s = time.perf_counter() - t0
                stats = await self.inner.push(export.pushable, version)
            except Exception as exc:
                await self._pause(engines, quiet=True)  # they may hold noise under their old version: nothing samples it
                raise WeightPushError(f"{exc} — weights.check_update_equal had filled the engines with random data "
                                      f"before this push, so they are left paused (holding noise, not the "
                                      f"trainer's weights) until a push succeeds") from exc
            await asyncio.gather(*(e.resume() for e in engines))  # a transport that never pauses leaves them paused
        else:
            stats = await self.inner.push(export.pushable, version)
        t1 = time.perf_counter()
        try:
            stats.tensors_checked = await self.check(export, version)
        except WeightCheckError:
            await self._pause(engines_of(self.targets), quiet=True)
            raise
        stats.check_s = fill_s + time.perf_counter() - t1
        if stats.driver_bytes is not None:  # a failed comparison's tensors came here to be described
            stats.driver_bytes += export.fetched_bytes
        return stats

    # ------------------------------------------------------------------ check
    async def _check_engine(self, reader: EngineReader, export: Any) -> list[str]:
        meta = {m.name: m for m in reader.engine.weight_metadata()}
        names = export.names
        if meta and getattr(self.inner, "partial_layouts", False):  # p2p: an engine holds what it declares
            names = [n for n in names if _served(n, meta)]
        sums = await reader.digests(names)
        if sums is not None:
            want = await export.digests(engine_dtypes(export.specs, meta))
            suspects = [n for n in names if sums.get(n) != want[n]]
        else:
            suspects = names
        problems: list[Mismatch] = [Mismatch(n, "is missing on the engine") for n in suspects
                                    if meta and not _served(n, meta)]
        present = [n for n in suspects if not meta or _served(n, meta)]
        if not meta:  # a server that publishes no metadata (real SGLang): the trainer's shapes and dtypes
            from miles_engine.engines.protocol import TensorMeta

            meta = {n: TensorMeta(n, dtype, tuple(shape)) for n, dtype, shape, _ in export.specs}
        named = await export.fetch(present) if present else {}
        exact = await asyncio.to_thread(self._exact, named, meta)
        values = await reader.tensors(present, meta)
        fills = self._fills.get(id(reader.engine), {})
        tol = self.options.tolerance

        def run() -> list[Mismatch]:
            found = []
            for n in present:
                if n not in values:
                    why = reader.unreadable.get(n)
                    found.append(Mismatch(n, f"could not be read back ({why})" if why else "is missing on the engine"))
                    continue
                bad = compare(n, values[n], named[n], exact[n], tol, fills.get(n))
                if bad is not None:
                    found.append(bad)
            return found

        problems += await asyncio.to_thread(run)
        return [p.describe() for p in problems]

    async def check(self, named: Any, version: int) -> int:
        """Compare every exported tensor (a mapping, or rank 0's export) on every engine; raise
        :class:`WeightCheckError` naming each one that differs. Returns how many (engine, tensor)
        pairs were checked."""
        export = as_export(named)
        named = export.names
        engines = engines_of(self.targets)
        readers = [reader_for(e, i) for i, e in enumerate(engines)]
        found = await asyncio.gather(*(self._check_engine(r, export) for r in readers))
        bad = [(r, p) for r, p in zip(readers, found) if p]
        if bad:
            show = self.options.show or max(len(p) for _, p in bad)
            mode = ("exact: bit for bit in the engine's dtype" if self.options.tolerance is None
                    else f"within {self.options.tolerance.describe()}")
            parts = [f"on {r.name} ({r.kind}), {len(p)} of {len(named)} tensors: " + "; ".join(p[:show])
                     + (f"; and {len(p) - show} more" if len(p) > show else "") for r, p in bad]
            raise WeightCheckError(f"weights.check_update_equal: after the {self.name} push of weight version "
                                   f"{version}, engine tensors are not the trainer's ({mode}) " + " | ".join(parts)
                                   + ". The engines are left paused: they do not hold the trainer's weights")
        return len(named) * len(readers)

    async def close(self) -> None:
        await self.inner.close()


def _served(name: str, meta: Mapping[str, Any]) -> bool:
    """In the engine's metadata, or an adapter part of a weight that is (the engine serves the parts it merged)."""
    lora = split_name(name)
    return name in meta or (lora is not None and lora[0] in meta)

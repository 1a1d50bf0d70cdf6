"""Engine side of ``disk_delta`` inside our engine server: the engine pulls from the shared
publish root itself.

``POST /update_weights_from_disk_delta`` (ours; SGLang has no such route — its
``/update_weights_from_disk`` takes ``{model_path, load_format, abort_all_requests,
weight_version?}`` and reloads a whole checkpoint). Body (unknown fields refused)::

    {"publish_root": "/shared/run/weights",  # as mounted on this engine host
     "version": 7,                           # bring this engine to weight version 7
     "engine": "engine-0",                   # this engine's lease name (ROOT/leases/<engine>.json)
     "local_dir": "/local/miles/engine-0",   # optional: persist the local full copy here
     "snapshot_every": 1, "pause_mode": "retract", "pull_timeout_s": 60}

The first call attaches: the engine (which must still serve version 0) loads its persisted
local copy if ``local_dir`` holds a usable one (:mod:`.local_copy`), else the baseline. Then it
pulls every version it lacks, patches and verifies them in a worker thread while generating,
pauses only for the load, bumps its weight version and resumes; the lease file is written by
this process. Answer: ``{"success": true, "message", "weight_version", "stats": {versions,
tensors, wire_bytes, pull_s, apply_s, pause_s, sync_s, persist_s}, "snapshot_version" (the
persisted copy's version), "attached_from": {"source": "baseline"|"local_copy", "version"}}``.

Imported by the engine server only (FastAPI); numpy and torch load on the first sync.

Refusals leave the engine serving its old weights under its old version: 409 with
``{"success": false, "message", "error": {"message", "type"}}`` where ``type`` is the
:mod:`.errors` class (``LineageError``, ``TornVersionError``, ``ChecksumError``,
``CorruptDeltaError``, ``DiskDeltaError``); 400 for a malformed body; 500 for anything else.
An engine attached to one publish root refuses another (a restarted engine can join it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, ValidationError

from miles_engine.components import Section
from miles_engine.engines.http.wire import error_body
from miles_engine.engines.protocol import engine_version
from miles_engine.weights.disk_delta.errors import DiskDeltaError, LineageError
from miles_engine.weights.disk_delta.layout import read_index
from miles_engine.weights.disk_delta.options import DiskDeltaOptions
from miles_engine.weights.disk_delta.retention import write_lease

log = logging.getLogger(__name__)

ROUTE = "/update_weights_from_disk_delta"


class DeltaSyncRequest(Section):
    publish_root: str = Field(min_length=1)
    version: int = Field(ge=0)
    engine: str = Field(min_length=1, description="lease name of this engine")
    local_dir: str | None = None
    snapshot_every: int = Field(1, ge=1)
    pause_mode: Literal["abort", "retract", "in_place", "wait"] = "retract"
    pull_timeout_s: float = Field(60.0, gt=0)
    resync: bool = Field(False, description="the engine may have restarted or loaded other weights: if its copy "
                         "does not match what it serves, rebuild the copy and load the version in full")


def _engine_applier_class() -> type:
    """Defined lazily: the applier imports numpy, the server must start without it."""
    from miles_engine.weights.disk_delta import baseline as baseline_mod
    from miles_engine.weights.disk_delta.applier import ApplyStats, DeltaApplier
    from miles_engine.weights.disk_delta.local_copy import LocalCopyStore

    class EngineDeltaApplier(DeltaApplier):
        """A :class:`DeltaApplier` running next to its engine: loads under the server's weights
        lock, persists the local copy, and leases the version it could restart from."""

        def __init__(self, engine: Any, root: Path, options: Any, *, name: str, update_lock: asyncio.Lock,
                     store: LocalCopyStore | None, snapshot_every: int) -> None:
            super().__init__(engine, root, options, name=name)
            self.update_lock, self.store, self.snapshot_every = update_lock, store, snapshot_every
            self.persist_s = 0.0
            self.attached_from: dict[str, Any] = {"source": "baseline", "version": 0}

        async def attach(self) -> None:
            import torch

            restored = None
            if self.store is not None:
                current = await engine_version(self.engine)
                if current != 0:
                    raise LineageError(f"engine {self.name} serves weight version {current}; a disk_delta engine "
                                       f"starts from the baseline or its local copy, at version 0")
                self.baseline = read_index(self.root, 0)
                restored = await asyncio.to_thread(self.store.load, self.root, self.baseline)
            if restored is None:
                await super().attach()
                return
            self.attached_from = {"source": "local_copy", "version": restored.version}
            self.state = restored.state
            self._dtypes = {n: getattr(torch, e.dtype) for n, e in self.baseline.tensors.items()}
            await self._activate(list(self.state), self.state, restored.version)
            self.held = restored.version
            write_lease(self.root, self.name, restored.version)
            log.info("disk_delta: engine %s resumed from its local copy of version %d (%.2fs)", self.name,
                     restored.version, restored.load_s)

        async def attach_for_resync(self) -> None:
            """Rebuild the copy (local copy, else baseline) without loading it: the engine serves
            something else (a restarted process, restored weights); the next sync loads in full."""
            import torch

            self.baseline = read_index(self.root, 0)
            restored = None if self.store is None else await asyncio.to_thread(self.store.load, self.root,
                                                                               self.baseline)
            if restored is not None:
                self.state, self.held = restored.state, restored.version
                self.attached_from = {"source": "local_copy", "version": restored.version}
            else:
                self.state, self.held = await asyncio.to_thread(baseline_mod.load, self.root, self.baseline), 0
                self.attached_from = {"source": "baseline", "version": 0}
            self._dtypes = {n: getattr(torch, e.dtype) for n, e in self.baseline.tensors.items()}
            self.reload = True
            log.info("disk_delta: engine %s re-attached from its %s (version %d) to resync", self.name,
                     self.attached_from["source"], self.held)

        async def _activate(self, names: list[str], source: dict[str, Any], version: int) -> float:
            async with self.update_lock:  # no other weight update or read-back interleaves with the load
                return await super()._activate(names, source, version)

        async def sync(self, target: int) -> ApplyStats:
            self.persist_s = 0.0
            try:
                stats = await super().sync(target)
            except DiskDeltaError as exc:
                if self.store is not None and self.store.rejected and self.held == 0:
                    raise type(exc)(f"{exc} ({self.store.rejected})") from None
                raise
            stats.persist_s = self.persist_s
            return stats

        async def _loaded(self, version: int) -> None:
            store = self.store
            if store is not None and version - (store.version or 0) >= self.snapshot_every:
                try:
                    self.persist_s = await asyncio.to_thread(store.save, self.root, self.baseline, version,
                                                             dict(self.state))
                except Exception:  # the engine serves the new version: only a restart would lose out
                    log.exception("disk_delta: engine %s could not persist its copy of version %d in %s (the "
                                  "lease keeps protecting version %s)", self.name, version, store.directory,
                                  store.version)
            # the lease protects what this engine would need after a restart
            durable = version if store is None else min(version, store.version or 0)
            write_lease(self.root, self.name, durable)

        def close(self) -> None:  # the lease stays: a restarted engine within lease_ttl_s still catches up
            if self.store is not None:
                self.store.close()

    return EngineDeltaApplier


class DiskDeltaHost:
    """The engine server's disk-delta state: at most one attached publish root."""

    def __init__(self, engine: Any, update_lock: asyncio.Lock) -> None:
        self.engine, self.update_lock = engine, update_lock
        self.applier: Any = None
        self.attached: DeltaSyncRequest | None = None
        self._lock = asyncio.Lock()

    async def _attach(self, req: DeltaSyncRequest) -> None:
        from miles_engine.weights.disk_delta.local_copy import LocalCopyStore

        root = Path(req.publish_root).expanduser()
        if not root.is_dir():
            raise DiskDeltaError(f"publish_root {root} is not a directory on this engine host (mount the shared "
                                 f"publish root here, or set weights.disk_delta.engine_root to where it is mounted)")
        options = DiskDeltaOptions(root=str(root), pause_mode=req.pause_mode, pull_timeout_s=req.pull_timeout_s)
        store = LocalCopyStore(Path(req.local_dir)) if req.local_dir else None
        applier = _engine_applier_class()(self.engine, root, options, name=req.engine, update_lock=self.update_lock,
                                          store=store, snapshot_every=req.snapshot_every)
        try:
            await (applier.attach_for_resync() if req.resync else applier.attach())
        except BaseException:
            applier.close()
            raise
        self.applier, self.attached = applier, req

    async def sync(self, req: DeltaSyncRequest) -> dict[str, Any]:
        async with self._lock:
            if self.applier is not None and req.resync and self.applier.held != await engine_version(self.engine):
                log.warning("disk_delta: engine serves version %s, its copy holds %s: resyncing",
                            self.engine.weight_version, self.applier.held)
                self.applier.close()
                self.applier = None
            if self.applier is None:
                await self._attach(req)
            else:
                a = self.attached
                assert a is not None
                mine = (Path(a.publish_root).expanduser(), a.engine, a.local_dir)
                asked = (Path(req.publish_root).expanduser(), req.engine, req.local_dir)
                if mine != asked:
                    raise DiskDeltaError(f"this engine is attached to publish root {mine[0]} as {mine[1]!r} (local "
                                         f"copy in {mine[2]}); asked for {asked[0]} as {asked[1]!r} (local copy in "
                                         f"{asked[2]}): restart the engine to join another publish root")
                self.applier.options = self.applier.options.model_copy(
                    update={"pause_mode": req.pause_mode, "pull_timeout_s": req.pull_timeout_s})
                self.applier.snapshot_every = req.snapshot_every
            stats = await self.applier.sync(req.version)
            store = self.applier.store
            return {"success": True, "weight_version": str(self.applier.held),
                    "message": f"Succeeded to update model weights. Weight version updated to {self.applier.held}.",
                    "stats": asdict(stats), "snapshot_version": None if store is None else store.version,
                    "attached_from": self.applier.attached_from}

    def close(self) -> None:
        if self.applier is not None:
            self.applier.close()


def add_disk_delta_routes(app: Any, engine: Any, *, update_lock: asyncio.Lock,
                          parse: Callable[[Any], Awaitable[dict[str, Any]]]) -> DiskDeltaHost:
    """Add ``POST /update_weights_from_disk_delta`` to the engine server's FastAPI ``app``."""
    host = DiskDeltaHost(engine, update_lock)

    def refused(status: int, msg: str, type_: str) -> JSONResponse:
        held = host.applier.held if host.applier is not None else None
        return JSONResponse({"success": False, "message": msg, "weight_version": None if held is None else str(held),
                             **error_body(msg, type_)}, status_code=status)

    @app.post(ROUTE)
    async def update_weights_from_disk_delta(request: Request) -> JSONResponse:
        body = await parse(request)
        try:
            req = DeltaSyncRequest.model_validate(body)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
            return refused(400, f"{ROUTE.lstrip('/')}: {problems}", "BadRequestError")
        try:
            return JSONResponse(await host.sync(req))
        except DiskDeltaError as exc:
            log.warning("disk_delta sync to version %d refused: %s", req.version, exc)
            return refused(409, str(exc), type(exc).__name__)
        except Exception as exc:
            log.exception("disk_delta sync to version %d failed", req.version)
            return refused(500, f"disk_delta sync to version {req.version} failed: {type(exc).__name__}: {exc}",
                           "InternalServerError")

    return host

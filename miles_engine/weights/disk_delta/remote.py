"""Trainer side of ``apply_on=engine``: after publishing, tell each engine server "sync to
version N"; the engine pulls the chain from the shared publish root itself
(:mod:`.engine_server`) and answers with its stats."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from miles_engine.engines.errors import EngineRefusedUpdate
from miles_engine.errors import ConfigError
from miles_engine.weights.disk_delta.applier import ApplyStats
from miles_engine.weights.disk_delta.errors import remote_sync_error
from miles_engine.weights.disk_delta.options import DiskDeltaOptions
from miles_engine.weights.disk_delta.retention import _SAFE


def pulls_itself(engine: Any, options: DiskDeltaOptions, name: str) -> bool:
    """Whether ``engine`` applies deltas in its own process (see ``apply_on``)."""
    capable = hasattr(engine, "update_weights_from_disk_delta")
    if options.apply_on == "engine":
        if not capable:
            raise ConfigError(f"weights.disk_delta.apply_on=engine, but {name} ({type(engine).__name__}) is not an "
                              f"HTTP engine; in-process engines need apply_on=trainer or auto")
        return True
    return options.apply_on == "auto" and capable and bool(getattr(engine, "is_miles_server", False))


class RemoteDeltaSync:
    """Stands where a :class:`DeltaApplier` stands for an in-process engine."""

    def __init__(self, engine: Any, root: Path, options: DiskDeltaOptions, *, name: str) -> None:
        self.engine, self.options, self.name = engine, options, name
        self.publish_root = options.engine_root or str(Path(root).resolve())
        self.local_dir = (options.engine_local_dir.replace("{engine}", _SAFE.sub("_", name))
                          if options.engine_local_dir else None)
        self.held: int | None = None
        self.snapshot_version: int | None = None
        self.attached_from: dict[str, Any] | None = None  # what the engine started from: baseline or its copy

    async def attach(self) -> None:
        """Nothing here: the engine attaches (baseline or its local copy) on its first sync."""

    async def sync(self, target: int) -> ApplyStats:
        o = self.options
        try:
            answer = await self.engine.update_weights_from_disk_delta(
                self.publish_root, target, engine=self.name, local_dir=self.local_dir, snapshot_every=o.snapshot_every,
                pause_mode=o.pause_mode, pull_timeout_s=o.pull_timeout_s,
                # after the first sync the engine may have been restarted (its copy is gone) or loaded
                # restored weights: it checks its copy against what it serves and resyncs in full
                resync=self.held is not None)
        except EngineRefusedUpdate as exc:  # the engine server's error type picks the class
            raise remote_sync_error(exc.url, exc.status, exc.body, exc.message, exc.version) from None
        known = {f.name for f in dataclasses.fields(ApplyStats)}
        stats = ApplyStats(**{k: v for k, v in dict(answer.get("stats") or {}).items() if k in known})
        self.held, self.snapshot_version = int(answer["weight_version"]), answer.get("snapshot_version")
        self.attached_from = answer.get("attached_from")
        return stats

    def close(self) -> None:
        """The lease is the engine server's: it outlives this trainer so a restart can catch up."""

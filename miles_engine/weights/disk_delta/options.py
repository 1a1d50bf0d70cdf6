"""Typed options of the ``disk_delta`` weight transport (no torch, no numpy: the recipe config
imports this model)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from miles_engine.components import Section

Encoding = Literal["xor", "overwrite"]
ChecksumFormat = Literal["xxh3_128", "blake2b_128", "sha256"]


class DiskDeltaOptions(Section):
    root: str | None = Field(None, description="publish root holding weight_vNNNNNN/ directories "
                             "(default in a training run: RUN_DIR/weights)")
    baseline: str | None = Field(
        None, description="canonical safetensors checkpoint (file or directory) the trainer and every engine "
        "start from; becomes version 0. Default: the in-process engine's initial weights are written as it")
    encoding: Encoding = Field("overwrite", description="xor: new XOR old over the whole tensor; overwrite: "
                               "changed byte ranges + their new bytes")
    compression_level: int = Field(3, ge=1, le=22, description="zstandard level")
    checksum: ChecksumFormat = Field("xxh3_128", description="checksum of each tensor's final bytes")
    shard_bytes: int = Field(256 << 20, ge=1 << 10, description="a shard file is closed past this many bytes")
    merge_gap: int = Field(0, ge=0, description="overwrite: changed ranges this close (in bytes) are merged; "
                           "a range costs ~2-4 index bytes, so re-sending a few unchanged bytes is cheaper")
    retain: int | None = Field(
        None, ge=1, description="keep the newest N delta versions (plus the baseline and every version a live "
        "engine still needs); None keeps all. A fresh engine or trainer replays the chain from the baseline, "
        "so a run that must restart engines from scratch needs the whole chain; an engine server with "
        "engine_local_dir resumes from its persisted copy and needs only the versions after it (its lease "
        "protects them for lease_ttl_s while it is down)")
    lease_ttl_s: float = Field(600.0, gt=0, description="an engine lease older than this is dead: it no longer "
                               "protects versions from garbage collection")
    pause_mode: Literal["abort", "retract", "in_place", "wait"] = "retract"  # rollout.on_update sets it
    pull_timeout_s: float = Field(60.0, gt=0, description="how long an engine waits for a version's index")
    apply_on: Literal["auto", "trainer", "engine"] = Field(
        "auto", description="where deltas are pulled and patched. engine: each engine server pulls from the "
        "publish root itself (POST /update_weights_from_disk_delta; our engine server only); trainer: in the "
        "trainer's process, then loaded through the engine's update_weights; auto: engine for our HTTP engine "
        "servers, trainer for in-process engines")
    engine_root: str | None = Field(None, description="apply_on=engine: the publish root as mounted on the engine "
                                    "hosts (default: root, the same path everywhere)")
    engine_local_dir: str | None = Field(
        None, description="apply_on=engine: a directory on each engine host where the engine persists its local "
        "full copy (safetensors + version, atomically), so a restarted engine resumes from it instead of replaying "
        "the chain from the baseline; '{engine}' is replaced by the engine's name. None: no persistence")
    snapshot_every: int = Field(1, ge=1, description="engine_local_dir: persist the copy every N versions (each "
                                "write is a full-model write on the engine host, after generation resumed)")

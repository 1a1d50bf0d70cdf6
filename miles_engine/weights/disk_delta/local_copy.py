"""An engine's local full copy, persisted on the engine host so a restarted engine resumes from
it instead of replaying the chain from the baseline (which retention may have removed).

Chosen over periodic full versions in the publish root: a checkpoint version would write the
whole model to shared storage for every engine's benefit, while the copy costs one local write
per engine (``snapshot_every`` bounds how often) and needs no change to the publish layout.

    DIR/.lock                   flock: one engine process per directory
    DIR/copy-v000012.safetensors   the canonical bytes of version 12, in the baseline's dtypes
    DIR/copy.json               version, file, lineage, per-tensor checksums (written last, atomically)

``copy.json`` is the commit point: the safetensors file is written under a temp name, fsynced
and renamed first, so a crash leaves either the previous copy or the new one, never half of one.

A copy is used only if it belongs to the publish root it is asked to catch up with: the
baseline's index must be byte-identical to the one the copy was made from, the copy's version
must not be newer than the root's newest version, and when the root still holds the copy's
version its index must be byte-identical too. Every tensor is checked against its checksum on
load. A copy that fails any of this is not used (the reason is logged and reported if the
chain from the baseline cannot be replayed either).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles_engine.weights.disk_delta import codec
from miles_engine.weights.disk_delta.errors import DiskDeltaError
from miles_engine.weights.disk_delta.layout import (
    INDEX,
    VersionIndex,
    fsync_dir,
    scan,
    version_dir,
    write_json,
)

log = logging.getLogger(__name__)

META = "copy.json"
LOCK = ".lock"


def index_digest(root: Path, version: int) -> str | None:
    """sha256 of a version's index file, or None when the root does not hold it."""
    try:
        return hashlib.sha256((version_dir(root, version) / INDEX).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def copy_file(version: int) -> str:
    return f"copy-v{version:06d}.safetensors"


@dataclass
class Restored:
    version: int
    state: dict[str, np.ndarray]
    load_s: float


class LocalCopyStore:
    """The persisted copy of one engine in ``directory`` (held under an exclusive lock)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskDeltaError(f"engine-local copy directory {self.directory}: cannot create it: {exc}") from None
        self._lock = open(self.directory / LOCK, "a+")  # noqa: SIM115 - held open for the flock
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DiskDeltaError(f"engine-local copy directory {self.directory} is in use by another engine process; "
                                 f"give each engine its own (weights.disk_delta.engine_local_dir with '{{engine}}')"
                                 ) from None
        self.version: int | None = None  # the version persisted (None: nothing yet)
        self.rejected: str | None = None  # why an existing copy was not used

    def close(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            self._lock.close()

    # ------------------------------------------------------------------ read
    def _reject(self, why: str) -> None:
        self.rejected = f"the local copy in {self.directory} was not used: {why}"
        log.warning("disk_delta: %s", self.rejected)

    def load(self, root: Path, baseline: VersionIndex) -> Restored | None:
        """The persisted copy, verified, or None (nothing there, or not usable here: see ``rejected``)."""
        from safetensors import safe_open

        started = time.perf_counter()
        meta_path = self.directory / META
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            version, file, checksums = int(meta["version"]), str(meta["file"]), dict(meta["checksums"])
            fmt, lineage, own_index = str(meta["checksum"]), str(meta["baseline_index"]), meta.get("index")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._reject(f"{meta_path} is unreadable ({type(exc).__name__}: {exc})")
            return None
        if lineage != index_digest(root, 0):
            self._reject(f"it was made from another baseline than {version_dir(root, 0)}")
            return None
        complete, _ = scan(root)
        if version > complete[-1]:
            self._reject(f"it holds version {version}, newer than anything in {root} (newest {complete[-1]}): "
                         f"another run's copy")
            return None
        if version in complete and own_index != index_digest(root, version):
            self._reject(f"version {version} in {root} is not the version {version} it was made from")
            return None
        if sorted(checksums) != sorted(baseline.tensors):
            self._reject("its tensors are not the baseline's tensors")
            return None
        state: dict[str, np.ndarray] = {}
        try:
            with safe_open(str(self.directory / file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    data = codec.canonical(handle.get_tensor(name))
                    entry = baseline.tensors.get(name)
                    if entry is None or data.size != entry.nbytes:
                        raise DiskDeltaError(f"tensor {name!r} is not the baseline's (size {data.size})")
                    codec.verify(fmt, data, checksums[name], name, version)
                    state[name] = data
        except Exception as exc:  # noqa: BLE001 - any defect: the copy is not used
            self._reject(f"{self.directory / file}: {type(exc).__name__}: {exc}")
            return None
        if state.keys() != checksums.keys():
            self._reject(f"{self.directory / file} lacks {len(checksums.keys() - state.keys())} tensors")
            return None
        self.version = version
        return Restored(version, state, time.perf_counter() - started)

    # ------------------------------------------------------------------ write
    def save(self, root: Path, baseline: VersionIndex, version: int, state: dict[str, np.ndarray]) -> float:
        """Persist ``state`` as ``version`` (file first, then copy.json); returns seconds spent."""
        import torch
        from safetensors.torch import save_file

        started = time.perf_counter()
        file = copy_file(version)
        tmp = self.directory / f".{file}.tmp"
        tensors = {n: codec.as_tensor(state[n], getattr(torch, e.dtype), e.shape) for n, e in baseline.tensors.items()}
        try:
            save_file(tensors, str(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / file)
            fsync_dir(self.directory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        write_json(self.directory / META, {
            "version": version, "file": file, "checksum": baseline.checksum,
            "baseline_index": index_digest(root, 0), "index": index_digest(root, version),
            "checksums": {n: codec.checksum(baseline.checksum, state[n]) for n in baseline.tensors}})
        for old in self.directory.glob("copy-v*.safetensors"):
            if old.name != file:
                old.unlink(missing_ok=True)
        self.version = version
        return time.perf_counter() - started

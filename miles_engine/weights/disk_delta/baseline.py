"""Version 0: the canonical safetensors checkpoint every trainer and engine host starts from.

``materialise`` copies a given checkpoint (or saves given tensors) into ``weight_v000000/``
with an index of every tensor's dtype, shape, byte size and checksum; the first update thus
publishes nothing. ``check_exported`` compares what the trainer exports against it and fails
before training, naming every tensor that does not match.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from miles_engine.engines.http.tensors import untied_cpu
from miles_engine.weights.disk_delta import codec
from miles_engine.weights.disk_delta.errors import BaselineMismatchError, DiskDeltaError
from miles_engine.weights.disk_delta.layout import TensorEntry, VersionIndex, fsync_dir, version_dir, write_index

BASELINE_FILE = "model.safetensors"


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise DiskDeltaError(f"baseline {path}: no safetensors checkpoint there (a .safetensors file or a "
                             f"directory of them; set weights.disk_delta.baseline)")
    return files


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Every tensor of a safetensors checkpoint (a file or a directory of them)."""
    from safetensors.torch import load_file

    return {n: t for f in _files(path) for n, t in load_file(str(f)).items()}


def materialise(root: Path, checksum_fmt: str, *, source: Path | None = None,
                tensors: Mapping[str, Any] | None = None) -> VersionIndex:
    """Write version 0 from a checkpoint path or from tensors; index written last."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    d = version_dir(root, 0)
    if d.exists():  # torn: an earlier attempt died before its index
        shutil.rmtree(d)
    d.mkdir(parents=True)
    if source is not None:
        names = []
        for f in _files(Path(source)):
            shutil.copyfile(f, d / f.name)
            names.append(f.name)
    else:
        if not tensors:
            raise DiskDeltaError("a baseline needs a checkpoint path or tensors")
        # safetensors refuses shared storage (tied weights): save each under its own copy
        save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()}, str(d / BASELINE_FILE))
        names = [BASELINE_FILE]
    entries: dict[str, TensorEntry] = {}
    for name in names:
        with open(d / name, "rb+") as f:
            os.fsync(f.fileno())
        with safe_open(str(d / name), framework="pt") as handle:
            for key in handle.keys():
                if key in entries:
                    raise DiskDeltaError(f"baseline: tensor {key!r} appears in two safetensors files")
                t = handle.get_tensor(key)
                data = codec.canonical(t)
                entries[key] = TensorEntry(dtype=_dtype_name(t.dtype), shape=list(t.shape), nbytes=data.size,
                                           shard=name, offset=0, length=data.size, raw_length=data.size,
                                           changed_bytes=data.size, checksum=codec.checksum(checksum_fmt, data))
    fsync_dir(d)
    total = sum(e.nbytes for e in entries.values())
    index = VersionIndex(version=0, base_version=None, kind="baseline", encoding="full", compression="none",
                         checksum=checksum_fmt, total_tensors=len(entries), total_bytes=total, changed_bytes=total,
                         wire_bytes=total, tensors=entries)
    write_index(root, index)
    return index


def load(root: Path, index: VersionIndex) -> dict[str, np.ndarray]:
    """Every baseline tensor's canonical bytes, each verified against its checksum."""
    from safetensors import safe_open

    d = version_dir(root, 0)
    state: dict[str, np.ndarray] = {}
    for shard in sorted({e.shard for e in index.tensors.values()}):
        with safe_open(str(d / shard), framework="pt") as handle:
            for key in handle.keys():
                entry = index.tensors.get(key)
                if entry is None:
                    raise DiskDeltaError(f"baseline {d / shard}: tensor {key!r} is not in its index")
                data = codec.canonical(handle.get_tensor(key))
                codec.verify(index.checksum, data, entry.checksum, key, 0)
                state[key] = data
    missing = sorted(index.tensors.keys() - state.keys())
    if missing:
        raise DiskDeltaError(f"baseline {d}: tensors in the index but in no file: {', '.join(missing)}")
    return state


def check_exported(named: Iterable[tuple[str, Any]], index: VersionIndex) -> list[tuple[str, Any]]:
    """Cast floating tensors to the baseline's dtype; raise one error naming every tensor whose
    name, dtype, shape or byte size does not match the baseline."""
    import torch

    out, problems = [], []
    for name, tensor in named:
        t = tensor.detach()
        entry = index.tensors.get(name)
        if entry is None:
            problems.append(f"{name!r}: not in the baseline")
            continue
        target = getattr(torch, entry.dtype)
        if t.dtype != target:
            if not (t.dtype.is_floating_point and target.is_floating_point):
                problems.append(f"{name!r}: dtype {_dtype_name(t.dtype)}, baseline {entry.dtype} (only floating "
                                f"point is cast)")
                continue
            t = t.to(target)
        if list(t.shape) != entry.shape:
            problems.append(f"{name!r}: shape {list(t.shape)}, baseline {entry.shape}")
            continue
        size = t.numel() * t.element_size()
        if size != entry.nbytes:
            problems.append(f"{name!r}: {size} bytes, baseline {entry.nbytes}")
            continue
        out.append((name, t))
    if problems:
        raise BaselineMismatchError(f"{len(problems)} exported tensors do not match the baseline "
                                    f"(weight_v000000): " + "; ".join(problems))
    return out


def write_baseline(tensors: list[tuple[str, Any]], path: Path) -> str:
    """The policy's weights as the trainer exports them, for a run whose engines are other processes
    (they start from these weights: version 0 is exactly this file). Written once under a
    temporary name and renamed; a resumed run keeps the file its versions were published against."""
    from safetensors.torch import save_file

    if not path.is_file():
        tmp = path.with_name(path.name + ".tmp")
        save_file(untied_cpu(dict(tensors)), str(tmp))
        tmp.rename(path)
    return str(path)

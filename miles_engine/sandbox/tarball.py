"""Tar payloads moved in and out of sandboxes (local and remote backends share these)."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path


def pack_files(files: Mapping[str, bytes | str]) -> bytes:
    """A tar of regular files (mode 0644) at the given absolute or relative targets."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for target, content in files.items():
            data = content.encode() if isinstance(content, str) else bytes(content)
            info = tarfile.TarInfo(target.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), 0o644, now
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pack_dir(local: Path) -> bytes:
    """A tar of the contents of ``local`` (not the dir itself), owners stripped."""

    def owner_free(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for entry in sorted(local.iterdir()):
            tar.add(entry, arcname=entry.name, filter=owner_free)
    return buf.getvalue()


def safe_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "data" filter (no absolute paths, no links leaving ``dest``, no devices,
    no setuid bits); a member it rejects is skipped rather than failing the download."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None


def unpack_into(payload: bytes, local: Path) -> None:
    """Unpack through :func:`safe_member` into a temp dir beside ``local``, then move the result
    in (merging into existing dirs), so a failure leaves nothing half-extracted at ``local``."""
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".miles-download-", dir=local.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(payload), mode="r") as tar:
            tar.extractall(tmp, filter=safe_member)
        local.mkdir(parents=True, exist_ok=True)
        _merge(tmp, local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _merge(src: Path, dest: Path) -> None:
    for entry in src.iterdir():
        target = dest / entry.name
        if target.is_dir() and not target.is_symlink() and entry.is_dir():
            _merge(entry, target)
        else:
            os.replace(entry, target)

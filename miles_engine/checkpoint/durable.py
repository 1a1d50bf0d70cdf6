"""Durable file writes: data fsynced, then the directory entry that names it."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def replace_text(path: Path, text: str) -> None:
    """Replace ``path`` atomically: a temporary sibling, fsynced, renamed, directory fsynced."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write_bytes(tmp, text.encode("utf-8"))
    os.replace(tmp, path)
    fsync_dir(path.parent)

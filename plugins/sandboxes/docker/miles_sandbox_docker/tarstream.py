"""Tar streams for ``docker cp``: what goes in (file entries only, so existing directories
keep their modes; the engine creates missing parents) and what comes out (one member for a
file, a tree under the source's base name for a directory)."""

from __future__ import annotations

import io
import posixpath
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path

from miles_engine.errors import SandboxError

SLACK = 64 << 10  # tar headers and padding around the payload


def absolute(path: str, workdir: str) -> str:
    """A sandbox path made absolute against the spec's workdir, normalised."""
    if not path:
        raise SandboxError("a sandbox path must not be empty")
    full = posixpath.normpath(posixpath.join(workdir or "/", path))
    if full == "/":
        raise SandboxError(f"'{path}' resolves to /, which cannot be a file")
    return full


def _owner_free(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def pack_files(files: Mapping[str, tuple[bytes, int]]) -> bytes:
    """A tar (to extract at ``/``) of absolute path -> (data, mode); no directory entries."""
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, (data, mode) in files.items():
            info = _owner_free(tarfile.TarInfo(path.lstrip("/")))
            info.size, info.mode, info.mtime = len(data), mode & 0o7777, now
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pack_dir(local: Path, remote: str) -> bytes:
    """A tar (to extract at ``/``) holding the contents of ``local`` under ``remote``; the
    ``remote`` directory itself gets no entry (an existing one keeps its mode)."""
    buf = io.BytesIO()
    prefix = remote.lstrip("/")
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(local.iterdir()):
            tar.add(entry, arcname=f"{prefix}/{entry.name}", filter=_owner_free)
    return buf.getvalue()


def top_paths(tar: bytes, dest: str) -> list[str]:
    """The absolute paths of the outermost entries of ``tar`` once extracted at ``dest``."""
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r") as t:
        names = [posixpath.normpath(posixpath.join(dest, m.name)) for m in t.getmembers()]
    return sorted(n for n in set(names) if not any(n.startswith(o + "/") for o in names if o != n))


def single_file(stream: bytes, max_bytes: int, *, path: str, sandbox_id: str) -> tuple[bytes, bool]:
    """The first ``max_bytes`` of the one file in a ``docker cp SRC -`` stream (which may
    itself be cut short past that point) and whether the file was longer."""
    try:
        with tarfile.open(fileobj=io.BytesIO(stream), mode="r|") as tar:
            member = tar.next()
            if member is None:
                raise SandboxError(f"read_file '{path}' in sandbox {sandbox_id}: docker returned an empty archive")
            if member.isdir():
                raise IsADirectoryError(f"is a directory in sandbox {sandbox_id}: {path}")
            if not member.isfile():
                raise SandboxError(f"read_file '{path}' in sandbox {sandbox_id}: not a regular file")
            f = tar.extractfile(member)
            assert f is not None
            data = f.read(max_bytes)
            return data, member.size > max_bytes
    except tarfile.TarError as exc:
        raise SandboxError(f"read_file '{path}' in sandbox {sandbox_id}: unreadable archive from docker cp ({exc})") from exc


def _data_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "data" policy (no absolute paths, links leaving ``dest``, devices, setuid);
    a member it rejects is skipped."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
        return None


def unpack_dir(stream: bytes, local: Path, *, remote: str, sandbox_id: str) -> None:
    """Extract the tree of a ``docker cp DIR -`` stream (rooted at DIR's base name) into
    ``local`` (created; existing files are overwritten)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(stream), mode="r") as tar:
            members = tar.getmembers()
            if not members:
                raise SandboxError(f"download_dir '{remote}' from sandbox {sandbox_id}: docker returned an empty archive")
            root = members[0]
            if not root.isdir():
                raise NotADirectoryError(f"not a directory in sandbox {sandbox_id}: {remote}")
            strip = root.name.rstrip("/") + "/"
            inner = []
            for m in members[1:]:
                if not m.name.startswith(strip):
                    continue
                m.name = m.name[len(strip) :]
                if m.islnk():
                    m.linkname = m.linkname[len(strip) :] if m.linkname.startswith(strip) else "/invalid"
                inner.append(m)
            local.mkdir(parents=True, exist_ok=True)
            for m in inner:
                kept = _data_filter(m, str(local))
                if kept is not None:
                    tar.extract(kept, local, filter="fully_trusted")
    except tarfile.TarError as exc:
        raise SandboxError(
            f"download_dir '{remote}' from sandbox {sandbox_id}: unreadable archive from docker cp ({exc})"
        ) from exc

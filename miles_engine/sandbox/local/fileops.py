"""File operations, done by commands *inside* the sandbox (as its user, in its view).

Going through the sandbox rather than touching scratch dirs from the host means a
symlink planted by sandboxed code (``/app/x -> /etc/shadow``) cannot make the host read
or overwrite its own files.
"""

from __future__ import annotations

import asyncio
import os
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from miles_engine.errors import SandboxError
from miles_engine.sandbox.tarball import pack_dir, pack_files, safe_member

if TYPE_CHECKING:
    from miles_engine.sandbox.local.sandbox import LocalSandbox

FILEOP_TIMEOUT_S = 300.0
_WRITE = 'set -e; mkdir -p -- "$(dirname -- "$1")"; cat > "$1"; chmod "$2" -- "$1"'
_READ = 'if [ -d "$1" ]; then echo "is a directory" >&2; exit 4; fi; [ -e "$1" ] || exit 3; exec head -c "$2" -- "$1"'
_UNTAR = 'set -e; for d in "$@"; do mkdir -p -- "$d"; done; exec tar -x --no-same-owner -f - -C /'
_UNTAR_AT = 'set -e; mkdir -p -- "$1"; exec tar -x --no-same-owner -f - -C "$1"'
_TAR = 'if [ ! -d "$1" ]; then [ -e "$1" ] && exit 4; exit 3; fi; exec tar -c -f - -C "$1" .'


def _fail(sb: LocalSandbox, what: str, path: str, raw) -> SandboxError:
    msg = raw.stderr.decode(errors="replace").strip() or f"exit {raw.exit_code}"
    if raw.timed_out:
        msg = f"timed out after {FILEOP_TIMEOUT_S:.0f}s"
    return SandboxError(f"{what} '{path}' in sandbox {sb.id} failed: {msg}")


async def write_file(sb: LocalSandbox, path: str, data: bytes | str, mode: int = 0o644) -> None:
    payload = data.encode() if isinstance(data, str) else bytes(data)
    target = sb.resolve(path)
    raw = await sb.run_raw(
        ["/bin/sh", "-c", _WRITE, "sh", target, format(mode & 0o7777, "o")],
        cwd="/",
        stdin=payload,
        timeout_s=FILEOP_TIMEOUT_S,
        max_output=64 << 10,
    )
    if raw.exit_code != 0:
        raise _fail(sb, "write_file", path, raw)


async def read_file(sb: LocalSandbox, path: str, max_bytes: int | None = None) -> bytes:
    """At most ``max_bytes`` of the file; without it, the whole file up to the backend's
    transfer cap (a bigger file is an error, never silently cut)."""
    cap = sb.opts.max_transfer_mb << 20
    want = cap + 1 if max_bytes is None else max(0, max_bytes)
    raw = await sb.run_raw(
        ["/bin/sh", "-c", _READ, "sh", sb.resolve(path), str(want)],
        cwd="/",
        timeout_s=FILEOP_TIMEOUT_S,
        max_output=want,
    )
    if raw.exit_code == 3:
        raise FileNotFoundError(f"no such file in sandbox {sb.id}: {path}")
    if raw.exit_code == 4:
        raise IsADirectoryError(f"is a directory in sandbox {sb.id}: {path}")
    if raw.exit_code != 0:
        raise _fail(sb, "read_file", path, raw)
    if max_bytes is None and len(raw.stdout) > cap:
        raise SandboxError(f"read_file '{path}': larger than max_transfer_mb={sb.opts.max_transfer_mb}; pass max_bytes")
    return raw.stdout


async def put_files(sb: LocalSandbox, files: Mapping[str, bytes], *, mkdirs: Sequence[str] = ()) -> None:
    """Write many files (the spec's initial files) with one command."""
    resolved = {sb.resolve(p): content for p, content in files.items()}
    payload = await asyncio.to_thread(pack_files, resolved)
    dirs = sorted({os.path.dirname(t) for t in resolved} | {sb.resolve(d) for d in mkdirs})
    raw = await sb.run_raw(
        ["/bin/sh", "-c", _UNTAR, "sh", *dirs], cwd="/", stdin=payload, timeout_s=FILEOP_TIMEOUT_S, max_output=64 << 10
    )
    if raw.exit_code != 0:
        raise _fail(sb, "writing initial files under", ", ".join(dirs), raw)


async def upload_dir(sb: LocalSandbox, local: Path | str, remote: str) -> None:
    """Copy the contents of host dir ``local`` into sandbox dir ``remote`` (created)."""
    local = Path(local)
    if not local.is_dir():
        raise NotADirectoryError(f"upload_dir: '{local}' is not a directory")
    payload = await asyncio.to_thread(pack_dir, local)
    raw = await sb.run_raw(
        ["/bin/sh", "-c", _UNTAR_AT, "sh", sb.resolve(remote)],
        cwd="/",
        stdin=payload,
        timeout_s=FILEOP_TIMEOUT_S,
        max_output=64 << 10,
    )
    if raw.exit_code != 0:
        raise _fail(sb, "upload_dir to", remote, raw)


def _inside(dest: str, path: str) -> bool:
    real = os.path.realpath(os.path.join(dest, path))
    return real == dest or real.startswith(dest + os.sep)


def _safe_members_compat(tar: tarfile.TarFile, dest: str) -> list[tarfile.TarInfo]:
    """The same policy for Pythons without extraction filters (< 3.11.4)."""
    dest = os.path.realpath(dest)
    keep = []
    for m in tar.getmembers():
        if (
            os.path.isabs(m.name)
            or not _inside(dest, m.name)
            or not (m.isfile() or m.isdir() or m.issym() or m.islnk())
        ):
            continue
        if m.issym() and (
            os.path.isabs(m.linkname) or not _inside(dest, os.path.join(os.path.dirname(m.name), m.linkname))
        ):
            continue
        if m.islnk() and (os.path.isabs(m.linkname) or not _inside(dest, m.linkname)):
            continue
        m.mode &= 0o755 if m.isdir() or m.mode & 0o100 else 0o644
        m.uid = m.gid = os.geteuid()
        m.uname = m.gname = ""
        keep.append(m)
    return keep


def _unpack(tar_path: str, local: Path) -> None:
    local.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path, "r") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(local, filter=safe_member)
        else:
            tar.extractall(local, members=_safe_members_compat(tar, str(local)))  # noqa: S202 - filtered above


async def download_dir(sb: LocalSandbox, remote: str, local: Path | str) -> None:
    """Copy the contents of sandbox dir ``remote`` into host dir ``local`` (created)."""
    local = Path(local)
    cap = sb.opts.max_transfer_mb << 20
    fd, tar_path = tempfile.mkstemp(prefix="miles-download-", suffix=".tar")
    try:
        with os.fdopen(fd, "wb") as sink:
            raw = await sb.run_raw(
                ["/bin/sh", "-c", _TAR, "sh", sb.resolve(remote)],
                cwd="/",
                timeout_s=FILEOP_TIMEOUT_S,
                max_output=cap,
                stdout_sink=sink.write,
            )
        if raw.exit_code == 3:
            raise FileNotFoundError(f"no such directory in sandbox {sb.id}: {remote}")
        if raw.exit_code == 4:
            raise NotADirectoryError(f"not a directory in sandbox {sb.id}: {remote}")
        if raw.exit_code not in (0, 1) or raw.timed_out:  # tar exits 1 when a file changed while read
            raise _fail(sb, "download_dir from", remote, raw)
        if raw.truncated:
            raise SandboxError(f"download_dir '{remote}': more than max_transfer_mb={sb.opts.max_transfer_mb}")
        await asyncio.to_thread(_unpack, tar_path, local)
    finally:
        os.unlink(tar_path)

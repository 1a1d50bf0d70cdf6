"""Harbor's ``artifacts``: files the trial copies out of the container when the agent is done.

miles keeps no per-episode directory on the host, so the artifacts travel on the episode
result: :func:`gather_artifacts` reads ``/logs/artifacts`` (Harbor's convention directory) and
each declared path out of the sandbox and returns ``{name: text}`` — a file under its source
path (or the entry's ``destination``), a directory expanded to one entry per file (``exclude``
globs, matched against the path inside the directory, leave files out). A declared path that
does not exist is logged and listed as missing, never fatal; past :data:`MAX_ARTIFACT_BYTES` in
all, the remaining files are listed as skipped instead of read.
"""

from __future__ import annotations

import fnmatch
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_engine.sandbox.protocol import Sandbox

from miles_env_harbor.config import Artifact, ArtifactEntry
from miles_env_harbor.verifier import ARTIFACTS_DIR, copy_out

log = logging.getLogger(__name__)

MAX_ARTIFACT_BYTES = 4 << 20


@dataclass
class GatheredArtifacts:
    files: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"files": self.files}
        for key in ("missing", "skipped", "errors"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        return out


def _entry(artifact: Artifact) -> ArtifactEntry:
    return artifact if isinstance(artifact, ArtifactEntry) else ArtifactEntry(source=artifact)


def _read(local: Path, name: str, out: GatheredArtifacts, budget: list[int]) -> None:
    size = local.stat().st_size
    if size > budget[0]:
        out.skipped.append(f"{name} ({size} bytes; over the {MAX_ARTIFACT_BYTES}-byte artifact budget)")
        return
    budget[0] -= size
    out.files[name] = local.read_bytes().decode("utf-8", errors="replace")


async def gather_artifacts(sandbox: Sandbox, artifacts: list[Artifact], *, where: str,
                           prefix: str = "") -> GatheredArtifacts:
    """Copy ``/logs/artifacts`` and ``artifacts`` out of ``sandbox``; ``prefix`` goes before each
    name (a step's artifacts: ``steps/<name>/`` + the path without its leading ``/``)."""
    out = GatheredArtifacts()
    entries = [ArtifactEntry(source=ARTIFACTS_DIR), *(_entry(a) for a in artifacts)]
    entries = list({e.source: e for e in entries}.values())
    budget = [MAX_ARTIFACT_BYTES]
    with tempfile.TemporaryDirectory(prefix="miles-harbor-artifacts-") as tmp:
        root = Path(tmp)
        for index, entry in enumerate(entries):
            local = root / f"{index}"
            try:
                kind = await copy_out(sandbox, entry.source, local)
            except Exception as exc:  # one unreadable artifact must not lose the others (or the verdict)
                out.errors.append(f"{entry.source}: {type(exc).__name__}: {exc}")
                log.warning("%s: cannot copy artifact %s out of the sandbox: %s", where, entry.source, exc)
                continue
            if kind is None:
                if entry.source != ARTIFACTS_DIR:
                    out.missing.append(entry.source)
                    log.warning("%s: artifact %s does not exist in the sandbox; not collected", where, entry.source)
                continue
            name = entry.destination or entry.source
            name = prefix + name.lstrip("/") if prefix else name
            if kind == "file":
                _read(local, name, out, budget)
                continue
            for file in sorted(p for p in local.rglob("*") if p.is_file()):
                inner = file.relative_to(local).as_posix()
                if not any(fnmatch.fnmatch(inner, pattern) for pattern in entry.exclude):
                    _read(file, f"{name.rstrip('/')}/{inner}", out, budget)
    return out

"""E2B runs sandboxes from prebuilt *templates*: a spec's image, Dockerfile or resources
become one template, built once and reused (the name is a hash of what defines it)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import SandboxSpec


def needs_template(spec: SandboxSpec) -> bool:
    r = spec.resources
    return bool(spec.image or spec.build or r.cpus or r.memory_mb)


def _context_digest(context_dir: Path, dockerfile: str) -> tuple[str, str]:
    """The Dockerfile's text and a digest of it plus every file of the build context."""
    path = context_dir / dockerfile
    if not path.is_file():
        raise SandboxError(f"e2b: Dockerfile not found: {path}")
    text = path.read_text()
    h = hashlib.sha256(text.encode())
    for f in sorted(p for p in context_dir.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(context_dir)).encode() + b"\0" + f.read_bytes())
    return text, h.hexdigest()


def template_request(spec: SandboxSpec, prefix: str) -> tuple[str, dict[str, Any]]:
    """The template name for ``spec`` and the parts of its build (kind, source, cpu, memory)."""
    r = spec.resources
    cpu = max(1, math.ceil(r.cpus)) if r.cpus else None
    memory = r.memory_mb or None
    if spec.build is not None:
        text, digest = _context_digest(spec.build.context_dir, spec.build.dockerfile)
        parts: dict[str, Any] = {"kind": "dockerfile", "source": text, "context": spec.build.context_dir, "digest": digest}
    elif spec.image:
        parts = {"kind": "image", "source": spec.image, "digest": spec.image}
    else:
        parts = {"kind": "base", "source": None, "digest": "base"}
    key = f"{parts['kind']}|{parts['digest']}|{cpu}|{memory}"
    name = f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    return name, {**parts, "cpu": cpu, "memory_mb": memory}


async def ensure_template(sdk: Any, name: str, parts: dict[str, Any], *, api_key: str) -> str:
    """Build template ``name`` unless it exists; return the name. Idempotent (by name)."""
    if await sdk.AsyncTemplate.exists(name, api_key=api_key):
        return name
    if parts["kind"] == "dockerfile":
        builder = sdk.AsyncTemplate(file_context_path=str(parts["context"])).from_dockerfile(parts["source"])
    elif parts["kind"] == "image":
        builder = sdk.AsyncTemplate().from_image(parts["source"])
    else:
        builder = sdk.AsyncTemplate().from_base_image()
    # Tasks expect Docker's defaults: root, started in /.
    builder = builder.set_user("root").set_workdir("/")
    await sdk.AsyncTemplate.build(builder, name, cpu_count=parts["cpu"], memory_mb=parts["memory_mb"], api_key=api_key)
    return name

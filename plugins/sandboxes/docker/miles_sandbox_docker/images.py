"""Getting the image a spec asks for: a registry reference (pulled per the pull policy) or
a Dockerfile build context (built once per content hash and tagged ``miles-build:<hash>``)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import RUN_LABEL, BuildContext
from miles_engine.sandbox.remote import RetryPolicy, retry_idempotent

from miles_sandbox_docker.cli import DockerCli, EngineUnreachable, classify

BUILD_REPO = "miles-build"


async def image_present(cli: DockerCli, ref: str) -> bool:
    res = await cli.run(["image", "inspect", "--format", "{{.Id}}", ref], what=f"inspect image '{ref}'", check=False)
    if res.rc == 0:
        return True
    low = res.err.lower()
    if "no such image" in low or "no such object" in low or "not found" in low:
        return False
    raise classify(f"inspect image '{ref}'", res.err)


async def ensure_image(cli: DockerCli, ref: str, *, pull: str, timeout_s: float, retry: RetryPolicy) -> None:
    """Make ``ref`` available locally, or raise one error naming the image."""
    if pull != "always" and await image_present(cli, ref):
        return
    if pull == "never":
        raise SandboxError(f"docker sandbox: image '{ref}' is not present on the engine and pull='never'")

    async def do_pull() -> None:
        await cli.run(["pull", "--quiet", ref], what=f"pull image '{ref}'", timeout_s=timeout_s)

    try:
        await retry_idempotent(do_pull, what=f"pull image '{ref}'", policy=retry)
    except EngineUnreachable:
        raise
    except SandboxError as exc:
        raise SandboxError(f"docker sandbox: cannot get image '{ref}': {exc}") from exc


def context_hash(build: BuildContext) -> str:
    """A hash of the build context's files (names, modes, contents) and Dockerfile name."""
    root = Path(build.context_dir)
    h = hashlib.sha256(build.dockerfile.encode() + b"\0")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            full = Path(dirpath, name)
            rel = full.relative_to(root).as_posix()
            h.update(rel.encode() + b"\0" + oct(full.lstat().st_mode).encode() + b"\0")
            if full.is_symlink():
                h.update(os.readlink(full).encode())
            else:
                with open(full, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
            h.update(b"\0")
    return h.hexdigest()[:20]


async def ensure_build(cli: DockerCli, build: BuildContext, *, run_id: str, timeout_s: float, retry: RetryPolicy) -> str:
    """Build the context (unless an image of the same content exists) and return its tag."""
    ctx = Path(build.context_dir)
    dockerfile = ctx / build.dockerfile
    if not ctx.is_dir():
        raise SandboxError(f"docker sandbox: build context '{ctx}' is not a directory")
    if not dockerfile.is_file():
        raise SandboxError(f"docker sandbox: no Dockerfile at '{dockerfile}' (spec.build.dockerfile)")
    tag = f"{BUILD_REPO}:{context_hash(build)}"
    if await image_present(cli, tag):
        return tag

    async def do_build() -> None:
        await cli.run(
            ["build", "--quiet", "--tag", tag, "--file", str(dockerfile), "--label", f"{RUN_LABEL}={run_id}", str(ctx)],
            what=f"build '{dockerfile}'",
            timeout_s=timeout_s,
        )

    try:
        await retry_idempotent(do_build, what=f"build '{dockerfile}'", policy=retry)
    except EngineUnreachable:
        raise
    except SandboxError as exc:
        tail = "\n".join(str(exc).splitlines()[-6:])
        raise SandboxError(f"docker sandbox: building '{dockerfile}' failed: {tail}") from exc
    return tag

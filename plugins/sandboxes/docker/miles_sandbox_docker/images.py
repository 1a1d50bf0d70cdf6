"""Getting the image a spec asks for: a registry reference (pulled per the pull policy) or
a Dockerfile build context (built once per content hash and tagged ``miles-build:<hash>``).

The image map (``ubuntu:24.04`` -> a local or mirror image) applies to spec images and to the
Dockerfile's ``FROM`` lines: a mapped Dockerfile is written next to the context (outside it)
and passed with ``--file``, so the task directory is never modified and the engine's own
``ubuntu:24.04`` (if any) is never retagged."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import RUN_LABEL, BuildContext
from miles_engine.sandbox.remote import QuotaError, RetryPolicy, TransientError, retry_idempotent

from miles_sandbox_docker.cli import DockerCli, EngineUnreachable, classify

BUILD_REPO = "miles-build"
_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
# docker's classic builder, BuildKit, podman (buildah): a RUN step failed
_STEP_FAILED = ("returned a non-zero code", "did not complete successfully", "error: building at step")
_CLASSIC_STEP = re.compile(r"^Step (\d+/\d+) ?: (.*)$", re.IGNORECASE)  # podman: "STEP 3/3: RUN ..."
_BUILDKIT_STEP = re.compile(r"^#\d+ \[(?:[\w.-]+ )?(\d+/\d+)\] (.*)$")


def map_image(ref: str, image_map: Mapping[str, str]) -> str:
    """``ref`` through the image map (also matched without a ``docker.io/[library/]`` prefix)."""
    if ref in image_map:
        return image_map[ref]
    short = ref.removeprefix("docker.io/").removeprefix("library/")
    return image_map.get(short, ref)


def map_dockerfile(text: str, image_map: Mapping[str, str]) -> str:
    """The Dockerfile with every ``FROM`` reference passed through the image map."""
    if not image_map:
        return text
    out = []
    for line in text.splitlines(keepends=True):
        m = _FROM.match(line.rstrip("\r\n"))
        if m:
            end = line[len(line.rstrip("\r\n")):]
            line = m.group(1) + m.group(2) + map_image(m.group(3), image_map) + m.group(4) + end
        out.append(line)
    return "".join(out)


def from_refs(text: str) -> list[str]:
    """The image references of a Dockerfile's FROM lines: not ``scratch``, not an earlier
    stage's name, not one built from an ARG (``$``)."""
    stages: set[str] = set()
    refs: list[str] = []
    for line in text.splitlines():
        m = _FROM.match(line)
        if not m:
            continue
        ref = m.group(3)
        if ref.lower() != "scratch" and ref.lower() not in stages and "$" not in ref and ref not in refs:
            refs.append(ref)
        stage = re.match(r"\s+AS\s+(\S+)", m.group(4), re.IGNORECASE)
        if stage:
            stages.add(stage.group(1).lower())
    return refs


def failed_step(output: str) -> str | None:
    """The build step that was running when a build failed, from the builder's output."""
    step = None
    for line in output.splitlines():
        line = line.strip()
        m = _CLASSIC_STEP.match(line) or _BUILDKIT_STEP.match(line)
        if m:
            step = f"step {m.group(1)}: {m.group(2)}"
    if step is None:
        m = re.search(r"The command '(.+?)' returned a non-zero code", output) or re.search(
            r'process "(.+?)" did not complete successfully', output
        )
        if m:
            step = f"RUN {m.group(1).removeprefix('/bin/sh -c ')}"
    return step


async def image_present(cli: DockerCli, ref: str) -> bool:
    res = await cli.run(["image", "inspect", "--format", "{{.Id}}", ref], what=f"inspect image '{ref}'", check=False)
    if res.rc == 0:
        return True
    low = res.err.lower()
    if any(s in low for s in ("no such image", "no such object", "not found", "image not known")):  # podman: not known
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


def context_hash(build: BuildContext, dockerfile_text: str | None = None) -> str:
    """A hash of the build context's files (names, modes, contents), the Dockerfile's name and
    the (mapped) Dockerfile text."""
    root = Path(build.context_dir)
    h = hashlib.sha256(build.dockerfile.encode() + b"\0" + (dockerfile_text or "").encode() + b"\0")
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


async def ensure_build(
    cli: DockerCli,
    build: BuildContext,
    *,
    run_id: str,
    timeout_s: float,
    retry: RetryPolicy,
    image_map: Mapping[str, str] | None = None,
    network: str = "default",
    stats: dict[str, int] | None = None,
    resolve_from: Callable[[str], Awaitable[str]] | None = None,
    builds_in_flight: dict[str, asyncio.Lock] | None = None,
) -> str:
    """Build the context (unless an image of the same content exists) and return its tag.
    ``stats`` counts ``build_cache_hits`` / ``builds``. ``resolve_from`` (the backend's stand-in
    look-up, which applies the image map itself) gives the image for each FROM reference;
    without it the FROM lines go through ``image_map``. ``builds_in_flight`` (one dict per backend):
    concurrent calls for the same content wait for one build instead of each building it."""
    ctx = Path(build.context_dir)
    dockerfile = ctx / build.dockerfile
    if not ctx.is_dir():
        raise SandboxError(f"docker sandbox: build context '{ctx}' is not a directory")
    if not dockerfile.is_file():
        raise SandboxError(f"docker sandbox: no Dockerfile at '{dockerfile}' (spec.build.dockerfile)")
    original = dockerfile.read_text(encoding="utf-8", errors="replace")
    if resolve_from is not None:
        mapped = map_dockerfile(original, {ref: await resolve_from(ref) for ref in from_refs(original)})
    else:
        mapped = map_dockerfile(original, image_map or {})
    tag = f"{BUILD_REPO}:{context_hash(build, mapped)}"
    stats = stats if stats is not None else {}
    lock = builds_in_flight.setdefault(tag, asyncio.Lock()) if builds_in_flight is not None else None
    async with lock or contextlib.nullcontext():
        if await image_present(cli, tag):
            stats["build_cache_hits"] = stats.get("build_cache_hits", 0) + 1
            return tag
        stats["builds"] = stats.get("builds", 0) + 1
        with tempfile.TemporaryDirectory(prefix="miles-dockerfile-") as tmp:
            file_arg = dockerfile
            if mapped != original:
                file_arg = Path(tmp, "Dockerfile")
                file_arg.write_text(mapped, encoding="utf-8")
            args = ["build", "--force-rm", "--tag", tag, "--file", str(file_arg), "--label", f"{RUN_LABEL}={run_id}"]
            if network != "default":
                args += ["--network", network]
            what = f"build '{dockerfile}'"

            async def do_build() -> None:
                res = await cli.run([*args, str(ctx)], what=what, timeout_s=timeout_s, check=False, max_stdout=4 << 20)
                if res.rc == 0:
                    return
                output = res.stdout.decode(errors="replace") + "\n" + res.err
                step_failed = any(m in output.lower() for m in _STEP_FAILED)  # a RUN step failed: deterministic
                err = classify(what, res.err or output[-2000:])
                if not step_failed and isinstance(err, (EngineUnreachable, TransientError, QuotaError)):
                    raise err
                step = failed_step(output)
                tail = "\n".join(line for line in output.splitlines()[-8:] if line.strip())
                hint = ""
                if network == "none":
                    hint = " (builds run with build_network='none': a step that needs the network cannot succeed)"
                raise SandboxError(
                    f"docker sandbox: building '{dockerfile}' failed"
                    + (f" at {step}" if step else "")
                    + f"{hint}:\n{tail}"
                )

            try:
                await retry_idempotent(do_build, what=what, policy=retry)
            except EngineUnreachable:
                raise
            except SandboxError as exc:
                if str(exc).startswith("docker sandbox: building"):
                    raise
                raise SandboxError(f"docker sandbox: building '{dockerfile}' failed: {exc}") from exc
        return tag

"""Stand-in images: what the backend uses for a public image it cannot get (no registry, or
``pull: never`` and not present). Image-name patterns map to a *family*; each family is a small
Dockerfile FROM the stand-in base (``miles-base:bookworm``, Debian minbase built by
``scripts/container_engine.sh``) that installs from the Debian mirror what the original image
carries. A family image is built once per content (its Dockerfile and the base's image id) and
tagged ``miles-standin-<family>:<hash>``; later uses find it on the engine.

A stand-in is only used where the real image cannot be had: a present image, or one the pull
policy lets the engine pull, always wins. Which refs were stood in is logged once per ref, counted
in ``sandbox/images_stood_in`` and listed by ``backend.describe()``."""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from miles_engine.errors import SandboxError

from miles_sandbox_docker import images
from miles_sandbox_docker.cli import EngineUnreachable, classify

if TYPE_CHECKING:
    from miles_sandbox_docker.backend import DockerSandboxBackend

log = logging.getLogger(__name__)

STANDIN_REPO = "miles-standin"
STANDIN_LABEL = "miles.standin"
_APT = ("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends {pkgs} "
        "&& rm -rf /var/lib/apt/lists/*")
_BUILD_TOOLS = ("build-essential", "git", "curl", "wget", "ca-certificates", "gnupg", "openssh-client", "unzip",
                "xz-utils", "bzip2", "pkg-config", "procps")
_PYTHON = ("python3", "python3-pip", "python3-venv", "python3-dev", "python-is-python3", "ca-certificates")
# The official python images have no PEP 668 marker (pip installs system-wide) and put pip on PATH
# as `pip`; Debian's python3-pip ships `pip` / `pip3` but marks the system Python as externally managed.
_PYTHON_RUN = ("rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && command -v pip >/dev/null "
               "&& python -m venv --help >/dev/null",)
_TB = ("tmux", "asciinema")


@dataclass(frozen=True)
class Family:
    """A stand-in: Debian packages on top of the base, then shell steps; ``note`` says where it
    falls short of the original."""

    packages: tuple[str, ...] = ()
    run: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    note: str = ""

    def dockerfile(self, base: str, name: str) -> str:
        lines = [f"FROM {base}"]
        if self.packages:
            lines.append("RUN " + _APT.format(pkgs=" ".join(self.packages)))
        lines += [f"RUN {step}" for step in self.run]
        lines += [f"ENV {key}={value}" for key, value in self.env]
        lines.append(f"LABEL {STANDIN_LABEL}={name}")
        return "\n".join(lines) + "\n"


_PY_ENV = (("LANG", "C.UTF-8"), ("PIP_ROOT_USER_ACTION", "ignore"))
FAMILIES: dict[str, Family] = {
    "debian": Family(note="Debian bookworm minbase (what debian:*-slim carries), any release tag"),
    "ubuntu": Family(run=("id -u ubuntu >/dev/null 2>&1 || useradd -m -u 1000 -s /bin/bash ubuntu",),
                     note="Debian bookworm minbase with the image's 'ubuntu' user, not Ubuntu"),
    "python": Family(_PYTHON, _PYTHON_RUN, _PY_ENV,
                     note="Debian's Python 3.11 with pip and venv, whatever 3.X the tag asks for"),
    "python-full": Family(_PYTHON + _BUILD_TOOLS, _PYTHON_RUN, _PY_ENV,
                          note="Debian's Python 3.11 with pip, venv and build tools (python:3.X is buildpack-deps based)"),
    "tb-python": Family(_PYTHON + _TB, _PYTHON_RUN, _PY_ENV,
                        note="terminal-bench's Python base: Debian's Python 3.11, pip, venv, tmux, asciinema"),
    "tb-ubuntu": Family(_TB, ("id -u ubuntu >/dev/null 2>&1 || useradd -m -u 1000 -s /bin/bash ubuntu",),
                        note="terminal-bench's Ubuntu base: Debian minbase with tmux and asciinema"),
    "buildpack-deps": Family(_BUILD_TOOLS, note="Debian with build-essential, git, curl, wget (not every -dev library)"),
    "alpine": Family(("busybox",), note="no Alpine from Debian packages: Debian with sh and busybox; 'apk' is absent"),
}

# First match wins; user patterns come before these. Matched against the reference without a
# digest and without a docker.io/[library/] prefix.
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("ghcr.io/laude-institute/t-bench/python-3-*", "tb-python"),
    ("ghcr.io/laude-institute/t-bench/ubuntu-*", "tb-ubuntu"),
    ("python:*slim*", "python"),
    ("python:*alpine*", "python"),
    ("python", "python-full"),
    ("python:*", "python-full"),
    ("ubuntu", "ubuntu"),
    ("ubuntu:*", "ubuntu"),
    ("debian", "debian"),
    ("debian:*", "debian"),
    ("buildpack-deps", "buildpack-deps"),
    ("buildpack-deps:*", "buildpack-deps"),
    ("alpine", "alpine"),
    ("alpine:*", "alpine"),
)

_REF_CHARS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")


def normalize(ref: str) -> str:
    """``docker.io/library/python:3.11-slim@sha256:...`` -> ``python:3.11-slim``."""
    ref = ref.split("@", 1)[0]
    return ref.removeprefix("docker.io/").removeprefix("library/")


@dataclass
class StandInMap:
    """Ordered ``pattern -> family or image`` rules (user rules first, then the defaults)."""

    rules: list[tuple[str, str]]
    families: dict[str, Family] = field(default_factory=lambda: dict(FAMILIES))

    @classmethod
    def build(cls, user_rules: Mapping[str, str], user_families: Mapping[str, Iterable[str]] | None = None,
              *, defaults: bool = True) -> StandInMap:
        families = dict(FAMILIES)
        for name, packages in (user_families or {}).items():
            families[name] = Family(tuple(packages), note=f"user family: {' '.join(packages)}")
        rules = list(user_rules.items()) + (list(DEFAULT_PATTERNS) if defaults else [])
        out = cls(rules, families)
        for pattern, target in rules:
            out.check_target(pattern, target)
        return out

    def check_target(self, pattern: str, target: str) -> None:
        if target in self.families:
            return
        if ":" in target or "/" in target or "@" in target:
            if not _REF_CHARS.match(target):
                raise SandboxError(f"stand-in for {pattern!r}: {target!r} is not an image reference")
            return
        raise SandboxError(
            f"stand-in for {pattern!r}: unknown family {target!r} (families: {', '.join(sorted(self.families))}; "
            "or an image reference with a tag, e.g. 'mirror.local/python:3.11-slim')"
        )

    def match(self, ref: str) -> tuple[str, str] | None:
        """The first ``(pattern, target)`` whose glob matches ``ref`` (or its normalized form)."""
        short = normalize(ref)
        for pattern, target in self.rules:
            if fnmatch.fnmatchcase(short, pattern) or fnmatch.fnmatchcase(ref, pattern):
                return pattern, target
        return None

    def dockerfile(self, family: str, base: str) -> str:
        return self.families[family].dockerfile(base, family)


def family_tag(family: str, dockerfile: str, base_id: str) -> str:
    digest = hashlib.sha256(dockerfile.encode() + b"\0" + base_id.encode()).hexdigest()[:16]
    return f"{STANDIN_REPO}-{family}:{digest}"


class StandInResolver:
    """The backend's image look-up: ``image_map``, then the real image if it can be had, else
    the stand-in its pattern names. Remembers what it stood in (``stood_in``: ref -> image)."""

    def __init__(self, backend: DockerSandboxBackend) -> None:
        o = backend.options
        self.backend = backend
        self.map = StandInMap.build(o.stand_ins, o.stand_in_families, defaults=o.stand_in_defaults)
        self.stood_in: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def image(self, ref: str) -> str:
        """A spec image: present or pulled per the pull policy, else its stand-in (the pull
        error stands when no pattern matches)."""
        return await self._resolve(ref, pull_unmatched=True)

    async def from_ref(self, ref: str) -> str:
        """A Dockerfile FROM reference; one no pattern matches is left to the build (as before)."""
        return await self._resolve(ref, pull_unmatched=False)

    async def _resolve(self, ref: str, *, pull_unmatched: bool) -> str:
        be, o = self.backend, self.backend.options
        mapped = images.map_image(ref, o.image_map)
        rule = self.map.match(mapped) if o.stand_in else None
        if rule is None:
            if pull_unmatched:
                await images.ensure_image(be.cli, mapped, pull=o.pull, timeout_s=o.pull_timeout_s, retry=o.retry)
            return mapped
        async with self._lock(mapped):
            if mapped in self.stood_in:
                return self.stood_in[mapped]
            try:
                await images.ensure_image(be.cli, mapped, pull=o.pull, timeout_s=o.pull_timeout_s, retry=o.retry)
                return mapped
            except EngineUnreachable:
                raise
            except SandboxError as exc:
                why = str(exc).removeprefix("docker sandbox: ")
            if o.pull == "always" and await images.image_present(be.cli, mapped):
                log.warning("docker sandbox: pulling '%s' failed (%s); using the copy on the engine", mapped, why)
                return mapped  # the real image, if not the newest, still beats a stand-in
            pattern, target = rule
            image = await self._stand_in(mapped, pattern, target, why)
            self.stood_in[mapped] = image
        be.metrics.count("images_stood_in")
        what = f"family '{target}' ({image}: {self.map.families[target].note})" if target in self.map.families \
            else f"image '{image}'"
        log.warning("docker sandbox: image '%s' cannot be had (%s); standing in with %s, by pattern '%s'",
                    mapped, why.splitlines()[0], what, pattern)
        return image

    async def _stand_in(self, ref: str, pattern: str, target: str, why: str) -> str:
        be, o = self.backend, self.backend.options
        if target not in self.map.families:
            try:
                await images.ensure_image(be.cli, target, pull=o.pull, timeout_s=o.pull_timeout_s, retry=o.retry)
            except EngineUnreachable:
                raise
            except SandboxError as exc:
                raise SandboxError(f"docker sandbox: image '{ref}' cannot be had ({why}) and its stand-in "
                                   f"'{target}' (pattern '{pattern}') neither: {exc}") from exc
            return target
        return await self.family_image(target, ref=ref, why=why)

    async def family_image(self, family: str, *, ref: str = "", why: str = "") -> str:
        """The family's image, built from the base when no image of the same content exists."""
        be, o = self.backend, self.backend.options
        res = await be.cli.run(["image", "inspect", "--format", "{{.Id}}", o.stand_in_base],
                               what=f"inspect stand-in base '{o.stand_in_base}'", check=False)
        if res.rc != 0:
            err = classify(f"inspect stand-in base '{o.stand_in_base}'", res.err)
            if isinstance(err, EngineUnreachable):
                raise err
            need = f"image '{ref}' cannot be had ({why}) and " if ref else ""
            raise SandboxError(f"docker sandbox: {need}the stand-in base '{o.stand_in_base}' (option stand_in_base, "
                               "$MILES_DOCKER_STAND_IN_BASE) is not on the engine; scripts/container_engine.sh start "
                               "builds it")
        dockerfile = self.map.dockerfile(family, o.stand_in_base)
        tag = family_tag(family, dockerfile, res.stdout.decode().strip())
        async with self._lock(tag):
            if await images.image_present(be.cli, tag):
                return tag
            be.metrics.count("standin_builds")
            await self._build(family, tag, dockerfile)
        return tag

    async def _build(self, family: str, tag: str, dockerfile: str) -> None:
        be, o = self.backend, self.backend.options
        with tempfile.TemporaryDirectory(prefix="miles-standin-") as ctx:
            Path(ctx, "Dockerfile").write_text(dockerfile, encoding="utf-8")
            args = ["build", "--force-rm", "--tag", tag, "--label", f"{STANDIN_LABEL}={family}"]
            if o.build_network != "default":
                args += ["--network", o.build_network]
            log.info("docker sandbox: building stand-in family '%s' as %s", family, tag)
            res = await be.cli.run([*args, ctx], what=f"build stand-in '{family}'", timeout_s=o.build_timeout_s,
                                   check=False, max_stdout=4 << 20)
        if res.rc != 0:
            output = res.stdout.decode(errors="replace") + "\n" + res.err
            tail = "\n".join(line for line in output.splitlines()[-8:] if line.strip())
            step = images.failed_step(output)
            raise SandboxError(f"docker sandbox: building the stand-in family '{family}' ({tag}) failed"
                               + (f" at {step}" if step else "")
                               + f" (build_network='{o.build_network}': it installs from the Debian mirror):\n{tail}")

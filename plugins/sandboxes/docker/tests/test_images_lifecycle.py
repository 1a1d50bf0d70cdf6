"""The engine-free parts: image map, FROM rewriting, the failed build step, the env-var map,
owner liveness and the create limiter (these run everywhere, with or without an engine)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import pytest
from pydantic import ValidationError

from miles_engine.errors import ConfigError
from miles_sandbox_docker.images import failed_step, map_dockerfile, map_image
from miles_sandbox_docker.lifecycle import Limiter, StepMetrics, owner_id, owner_is_dead
from miles_sandbox_docker.options import DockerSandboxOptions

MAP = {"ubuntu:24.04": "miles-base:bookworm", "python:3.13-slim": "mirror.local/python:3.13-slim"}


def test_map_image_matches_with_and_without_the_docker_hub_prefix():
    assert map_image("ubuntu:24.04", MAP) == "miles-base:bookworm"
    assert map_image("docker.io/library/ubuntu:24.04", MAP) == "miles-base:bookworm"
    assert map_image("ubuntu:22.04", MAP) == "ubuntu:22.04"


def test_map_dockerfile_rewrites_only_from_references():
    text = ("# FROM ubuntu:24.04 in a comment stays\nFROM --platform=linux/amd64 ubuntu:24.04 AS build\n"
            "RUN echo ubuntu:24.04\nfrom python:3.13-slim\nFROM build\nCOPY --from=build /x /x\n")
    out = map_dockerfile(text, MAP)
    assert out.splitlines() == [
        "# FROM ubuntu:24.04 in a comment stays",
        "FROM --platform=linux/amd64 miles-base:bookworm AS build",
        "RUN echo ubuntu:24.04",
        "from mirror.local/python:3.13-slim",
        "FROM build",
        "COPY --from=build /x /x",
    ]
    assert map_dockerfile(text, {}) == text


def test_failed_step_from_classic_and_buildkit_output():
    classic = ("Step 1/3 : FROM miles-base:bookworm\n ---> 53d6\nStep 2/3 : RUN apt-get update\n"
               "E: Unable to locate package cowsay\nThe command '/bin/sh -c apt-get update' returned a non-zero code: 100")
    assert failed_step(classic) == "step 2/3: RUN apt-get update"
    buildkit = ('#5 [1/2] FROM docker.io/library/ubuntu:24.04\n#6 [2/2] RUN pip install numpy\n'
                '#6 ERROR: process "/bin/sh -c pip install numpy" did not complete successfully: exit code: 1')
    assert failed_step(buildkit) == "step 2/2: RUN pip install numpy"
    assert failed_step('ERROR: process "/bin/sh -c false" did not complete successfully') == "RUN false"
    assert failed_step("no steps at all") is None
    podman = "STEP 1/3: FROM ubuntu:24.04\nSTEP 2/3: RUN true\nSTEP 3/3: RUN apt-get update\nError: building at STEP"
    assert failed_step(podman) == "step 3/3: RUN apt-get update"


def test_image_map_from_the_environment(monkeypatch):
    monkeypatch.setenv("MILES_DOCKER_IMAGE_MAP", "ubuntu:24.04=miles-base:bookworm, debian:bookworm=x:y")
    assert DockerSandboxOptions().image_map == {"ubuntu:24.04": "miles-base:bookworm", "debian:bookworm": "x:y"}
    monkeypatch.setenv("MILES_DOCKER_IMAGE_MAP", "ubuntu:24.04")
    with pytest.raises(ConfigError, match=r"MILES_DOCKER_IMAGE_MAP: entry 'ubuntu:24.04' is not REF=IMAGE"):
        DockerSandboxOptions()
    monkeypatch.delenv("MILES_DOCKER_IMAGE_MAP")
    with pytest.raises(ValidationError, match="image_map entries need a reference and an image"):
        DockerSandboxOptions(image_map={"ubuntu:24.04": " "})


def test_owner_liveness():
    me = owner_id()
    assert me.startswith(socket.gethostname() + f":{os.getpid()}:") and not owner_is_dead(me)
    child = subprocess.Popen(["sleep", "30"])
    host, pid, start = me.split(":")[0], child.pid, open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[19]
    owner = f"{host}:{pid}:{start}"
    assert not owner_is_dead(owner)
    child.kill()
    child.wait()
    assert owner_is_dead(owner)
    assert not owner_is_dead(f"other-host:{pid}:{start}")  # never judged from here
    assert not owner_is_dead("garbage")


def test_limiter_caps_live_holders():
    async def go():
        lim = Limiter(max_live=2, rate_per_s=None)
        await lim.acquire()
        await lim.acquire()
        third = asyncio.ensure_future(lim.acquire())
        for _ in range(20):
            await asyncio.sleep(0)
        blocked = not third.done()
        lim.release()
        await asyncio.wait_for(third, 5)
        return blocked

    assert asyncio.run(go())


def test_step_metrics_snapshot():
    m = StepMetrics()
    for v in (0.1, 0.2, 0.3, 0.4):
        m.observe("exec", v)
    m.count("build_cache_hits", 2)
    snap = m.snapshot()
    assert snap["sandbox/exec_n"] == 4 and snap["sandbox/exec_p50_s"] == pytest.approx(0.25)
    assert 0.3 < snap["sandbox/exec_p95_s"] <= 0.4 and snap["sandbox/build_cache_hits"] == 2.0
    assert "sandbox/create_p50_s" not in snap


def test_step_metrics_window_is_what_happened_since_the_last_call():
    m = StepMetrics()
    m.observe("create", 2.0)
    m.observe("exec", 0.5)
    m.count("builds")
    first = m.window()
    assert first["sandbox/create_n"] == 1 and first["sandbox/create_p50_s"] == first["sandbox/create_p95_s"] == 2.0
    assert first["sandbox/destroy_n"] == 0 and "sandbox/destroy_p50_s" not in first
    assert (first["sandbox/builds"], first["sandbox/build_cache_hits"]) == (1.0, 0.0)
    m.observe("exec", 0.1)
    m.count("build_cache_hits", 3)
    second = m.window()
    assert second["sandbox/exec_n"] == 1 and second["sandbox/exec_p50_s"] == 0.1 and second["sandbox/create_n"] == 0
    assert (second["sandbox/builds"], second["sandbox/build_cache_hits"]) == (0.0, 3.0)
    assert m.snapshot()["sandbox/exec_n"] == 2  # the cumulative view is unchanged by windows


class _BuildingCli:
    """Just enough of DockerCli for ensure_build: ``image inspect`` and a build that takes a while."""

    def __init__(self) -> None:
        self.images: set[str] = set()
        self.builds: list[str] = []

    async def run(self, args, *, what, check=True, **_):
        from miles_sandbox_docker.cli import CliResult

        if args[:2] == ["image", "inspect"]:
            present = args[-1] in self.images
            return CliResult(0 if present else 1, b"", b"" if present else f"Error: No such image: {args[-1]}".encode())
        assert args[0] == "build", args
        tag = args[args.index("--tag") + 1]
        self.builds.append(tag)
        await asyncio.sleep(0.05)
        self.images.add(tag)
        return CliResult(0, b"", b"")


@pytest.mark.parametrize("single_flight", [True, False])
def test_concurrent_creates_of_one_build_context_build_it_once(tmp_path, single_flight):
    from miles_engine.sandbox.protocol import BuildContext
    from miles_engine.sandbox.remote import RetryPolicy
    from miles_sandbox_docker.images import ensure_build

    (tmp_path / "Dockerfile").write_text("FROM miles-base:bookworm\nRUN true\n")
    cli, stats, in_flight = _BuildingCli(), {}, {}

    async def build() -> str:
        return await ensure_build(cli, BuildContext(context_dir=str(tmp_path)), run_id="r", timeout_s=10,
                                  retry=RetryPolicy(), stats=stats,
                                  builds_in_flight=in_flight if single_flight else None)

    async def main() -> list[str]:
        return await asyncio.gather(*(build() for _ in range(3)))

    tags = asyncio.run(main())
    assert len(set(tags)) == 1
    if single_flight:
        assert cli.builds == tags[:1] and stats == {"builds": 1, "build_cache_hits": 2}
    else:  # each caller builds the same content: what builds_in_flight prevents
        assert len(cli.builds) == 3 and stats == {"builds": 3}

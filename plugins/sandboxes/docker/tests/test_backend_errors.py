"""Docker backend failure modes against the fake CLI: no engine, no CLI, image pull errors
(denied, rate limit, flaky registry), builds, lost answers, hung calls, dead containers;
what is retried (create, file I/O, close) and what never is (exec)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from miles_engine.errors import SandboxError
from miles_engine.sandbox.protocol import RUN_LABEL, BuildContext, NetworkPolicy, Resources, SandboxSpec
from miles_engine.sandbox.remote import RetryPolicy
from miles_sandbox_docker.backend import DockerSandboxBackend
from miles_sandbox_docker.cli import EngineUnreachable
from miles_sandbox_docker.options import DockerSandboxOptions
from miles_sandbox_docker.scripts import KEEPALIVE

from .conftest import FakeDocker, needs_bwrap

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")
FAST = RetryPolicy(attempts=3, quota_attempts=2, base_delay_s=0.01, max_delay_s=0.02)
RESET = "Error response from daemon: read unix @->/var/run/docker.sock: read: connection reset by peer"


def run(coro: Coroutine[Any, Any, T], timeout: float = 40.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def backend(fake: FakeDocker, **opts: Any) -> DockerSandboxBackend:
    return DockerSandboxBackend(DockerSandboxOptions(binary=fake.binary, retry=FAST, **opts))


def calls(fake: FakeDocker, sub: str) -> list[list[str]]:
    return [c for c in fake.calls() if c[0] == sub]


# ------------------------------------------------------------------ engine and CLI
def test_unreachable_engine_is_one_clear_error(fake_docker: FakeDocker):
    fake_docker.faults(down=True)
    be = backend(fake_docker)
    for call in (be.create(SandboxSpec()), be.sweep("r1"), be.ping()):
        with pytest.raises(EngineUnreachable) as exc:
            run(call)
        msg = str(exc.value)
        assert "\n" not in msg and "no Docker engine reachable" in msg and "DOCKER_HOST" in msg
    assert len(fake_docker.calls()) == 3  # not retried


def test_missing_cli_names_the_option(tmp_path: Path):
    be = DockerSandboxBackend(DockerSandboxOptions(binary=str(tmp_path / "no-docker")))
    with pytest.raises(EngineUnreachable, match=r"docker CLI '.*no-docker' was not found.*binary="):
        run(be.create(SandboxSpec()))


def test_unknown_option_is_refused_by_the_hub():
    from miles_engine.errors import ConfigError
    from miles_engine.hub import Hub

    with pytest.raises(ConfigError, match="pul"):
        Hub().create("sandbox", "docker", {"pul": "always"})


# ------------------------------------------------------------------ images
def test_pull_denied_is_not_retried_and_names_the_image(fake_docker: FakeDocker):
    with pytest.raises(SandboxError, match=r"cannot get image 'private/img'.*pull access denied"):
        run(backend(fake_docker).create(SandboxSpec(image="private/img")))
    assert len(calls(fake_docker, "pull")) == 1 and calls(fake_docker, "run") == []


def test_rate_limited_pull_backs_off_then_one_clear_error(fake_docker: FakeDocker):
    with pytest.raises(SandboxError, match=r"'busy/img'.*still throttling / over quota after 2 tries.*toomanyrequests"):
        run(backend(fake_docker).create(SandboxSpec(image="busy/img")))
    assert len(calls(fake_docker, "pull")) == 2


@needs_bwrap
def test_flaky_registry_is_retried_and_a_present_image_is_not_pulled(fake_docker: FakeDocker):
    fake_docker.faults(fail={"pull": ['Error response from daemon: Get "https://registry-1.docker.io/v2/": net/http: TLS handshake timeout']})
    be = backend(fake_docker)

    async def twice() -> None:
        for _ in range(2):
            sb = await be.create(SandboxSpec(image="python:3.12-slim"))
            await sb.close()

    run(twice())
    assert len(calls(fake_docker, "pull")) == 2  # one failure + one success, then cached
    assert "python:3.12-slim" in fake_docker.images()


def test_pull_never_refuses_an_absent_image(fake_docker: FakeDocker):
    with pytest.raises(SandboxError, match=r"'python:3.12-slim' is not present on the engine and pull='never'"):
        run(backend(fake_docker, pull="never").create(SandboxSpec(image="python:3.12-slim")))
    assert calls(fake_docker, "pull") == []


@needs_bwrap
def test_build_context_is_built_once_per_content(fake_docker: FakeDocker, tmp_path: Path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN true\n")
    be = backend(fake_docker, run_id="build-run")

    async def go() -> str:
        for _ in range(2):
            async with await be.create(SandboxSpec(build=BuildContext(context_dir=ctx))) as sb:
                out = (await sb.exec("echo built")).stdout
        return out

    assert run(go()) == "built\n"
    builds = calls(fake_docker, "build")
    assert len(builds) == 1
    tag = builds[0][builds[0].index("--tag") + 1]
    assert tag.startswith("miles-build:") and f"{RUN_LABEL}=build-run" in builds[0]
    (ctx / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN false\n")
    with pytest.raises(SandboxError, match=r"(?s)building '.*Dockerfile' failed at RUN false:.*did not complete successfully"):
        run(be.create(SandboxSpec(build=BuildContext(context_dir=ctx))))


def test_missing_dockerfile_fails_before_any_docker_call(fake_docker: FakeDocker, tmp_path: Path):
    with pytest.raises(SandboxError, match=r"no Dockerfile at '.*Dockerfile.dev'"):
        run(backend(fake_docker).create(SandboxSpec(build=BuildContext(context_dir=tmp_path, dockerfile="Dockerfile.dev"))))
    assert fake_docker.calls() == []


# ------------------------------------------------------------------ containers
def test_run_arguments_carry_spec_labels_resources_and_network(fake_docker: FakeDocker):
    be = backend(fake_docker, run_id="cfg-run", max_cpus=4, pids_limit=100)
    spec = SandboxSpec(
        image="python:3.12-slim",
        network=NetworkPolicy(mode="public"),
        resources=Resources(cpus=1.5, memory_mb=512, disk_mb=100),
        env={"A": "1"},
        user="1000:1000",
        ttl_s=30,
        labels={"miles.task": "t1"},
    )
    args = be.run_args("miles-sbx-1", "python:3.12-slim", spec, {"miles.task": "t1", RUN_LABEL: "cfg-run"})
    joined = " ".join(args)
    for part in ("--network bridge", "--cpus 1.5", "--memory 512m --memory-swap 512m", "--pids-limit 100",
                 "--env A=1", "--user 1000:1000", "--workdir /app", "--label miles.run=cfg-run", "--init", "--rm"):
        assert part in joined
    assert "--storage-opt" not in joined and args[-1] == "30"
    none = be.run_args("n", "i", SandboxSpec(), {})
    assert none[none.index("--network") + 1] == "none" and none[-1] == ""



def test_kept_entrypoint_gets_the_keepalive_as_its_command_and_no_rm(fake_docker: FakeDocker):
    be = backend(fake_docker)
    kept = be.run_args("c", "img", SandboxSpec(keep_entrypoint=True, ttl_s=30), {})
    assert "--entrypoint" not in kept and "--rm" not in kept and "--workdir" not in kept  # the image's own
    assert kept[kept.index("img"):] == ["img", "/bin/sh", "-c", KEEPALIVE, "miles-keepalive", "30"]
    replaced = be.run_args("c", "img", SandboxSpec(), {})
    assert replaced[replaced.index("--entrypoint"):] == ["--entrypoint", "/bin/sh", "img", "-c", KEEPALIVE,
                                                         "miles-keepalive", ""]
    assert "--rm" in replaced and be.capabilities().keep_entrypoint


@needs_bwrap
def test_lost_run_answer_is_retried_without_a_second_container(fake_docker: FakeDocker):
    fake_docker.faults(lose=["run"])
    be = backend(fake_docker)

    async def go() -> str:
        async with await be.create(SandboxSpec()) as sb:
            assert len(fake_docker.containers()) == 1
            return (await sb.exec("echo ok")).stdout

    assert run(go()) == "ok\n"
    assert len(calls(fake_docker, "run")) == 2 and fake_docker.containers() == []


@needs_bwrap
def test_exec_is_never_retried_but_file_io_is(fake_docker: FakeDocker):
    be = backend(fake_docker)

    async def go() -> None:
        async with await be.create(SandboxSpec()) as sb:
            fake_docker.faults(fail={"exec": [RESET], "cp": [RESET]})
            with pytest.raises(SandboxError, match="connection reset by peer"):
                await sb.exec("echo side-effect >> /app/log")
            await sb.write_file("/app/f.txt", b"data")  # first cp fails, the retry succeeds
            assert await sb.read_file("/app/f.txt") == b"data"
            res = await sb.exec("cat /app/log 2>/dev/null | wc -l")
            assert res.stdout.strip() == "0"

    run(go())
    commands = [c for c in calls(fake_docker, "exec") if "echo side-effect >> /app/log" in c]
    assert len(commands) == 1
    assert len([c for c in calls(fake_docker, "cp") if c[1] == "-"]) == 2


@needs_bwrap
def test_hung_close_is_bounded_and_reports_one_error(fake_docker: FakeDocker):
    be = backend(fake_docker, call_timeout_s=1.0, run_id="hung-run")

    async def go() -> None:
        sb = await be.create(SandboxSpec())
        fake_docker.faults(hang=["rm"])
        t0 = time.monotonic()
        with pytest.raises(SandboxError, match=r"remove sandbox .* failed after 3 tries: .*did not answer within 1s"):
            await sb.close()
        assert time.monotonic() - t0 < 10
        fake_docker.faults()
        assert await be.sweep("hung-run") == [sb.id]

    run(go())


@needs_bwrap
def test_ttl_expiry_makes_the_sandbox_dead(fake_docker: FakeDocker):
    be = backend(fake_docker)

    async def go() -> None:
        sb = await be.create(SandboxSpec(ttl_s=1))
        assert await sb.alive()
        await asyncio.sleep(2.0)
        assert not await sb.alive()
        with pytest.raises(SandboxError, match=r"is dead"):
            await sb.exec("true")
        await sb.close()  # idempotent on a container already gone

    run(go())
    assert fake_docker.containers() == []


@needs_bwrap
def test_sweep_removes_a_crashed_runs_containers(fake_docker: FakeDocker):
    async def go() -> tuple[list[str], list[str], list[str]]:
        crashed = backend(fake_docker, run_id="crashed-run")
        ids = [(await crashed.create(SandboxSpec())).id for _ in range(2)]  # never closed: a "crash"
        fresh = backend(fake_docker)  # a later process, e.g. `miles sandbox sweep`
        return ids, await fresh.sweep("crashed-run"), await fresh.sweep("crashed-run")

    ids, first, second = run(go())
    assert sorted(first) == sorted(ids) and second == []
    assert fake_docker.containers() == [] and fake_docker.processes() == []


@needs_bwrap
def test_file_io_on_a_removed_container_says_dead(fake_docker: FakeDocker):
    be = backend(fake_docker, run_id="gone-run")

    async def go() -> None:
        sb = await be.create(SandboxSpec())
        await be.sweep("gone-run")
        with pytest.raises(SandboxError, match=r"sandbox sbx-\w+ is dead"):
            await sb.write_file("/app/x", b"1")
        with pytest.raises(SandboxError, match=r"sandbox sbx-\w+ is dead"):
            await sb.exec("true")
        await sb.close()

    run(go())


@needs_bwrap
def test_miles_sandbox_sweep_cli_on_docker(fake_docker: FakeDocker):
    import json

    from click.testing import CliRunner

    from miles_engine.cli.main import cli

    be = backend(fake_docker, run_id="cli-run")
    sb = run(be.create(SandboxSpec()))
    res = CliRunner().invoke(
        cli, ["sandbox", "sweep", "--backend", "docker", "-o", f"binary={fake_docker.binary}", "--run", "cli-run", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == [sb.id] and fake_docker.containers() == []


# ------------------------------------------------------------------ route to a host server
@needs_bwrap
def test_route_to_host_needs_the_engine_on_this_host(fake_docker: FakeDocker, tmp_path: Path):
    be = backend(fake_docker, host="tcp://192.0.2.1:2375")

    async def go() -> None:
        async with await be.create(SandboxSpec()) as sb:
            await sb.route_to_host("127.0.0.1", 8000)

    with pytest.raises(SandboxError, match=r"needs the docker engine on this host .*tcp://192.0.2.1:2375"):
        run(go())
    assert not [c for c in fake_docker.calls() if "--network" in c and any("container:" in a for a in c)]


def test_ro_binds_are_read_only_volumes_and_bad_ones_are_refused(tmp_path: Path):
    opts = DockerSandboxOptions(ro_binds={"/miles/harnesses": str(tmp_path)})
    args = DockerSandboxBackend(opts).run_args("c", "img", SandboxSpec(), {})
    assert args[args.index("--volume") + 1] == f"{tmp_path}:/miles/harnesses:ro"
    for bad in ({"relative": str(tmp_path)}, {"/": str(tmp_path)}, {"/x": str(tmp_path / "missing")}):
        with pytest.raises(ValueError, match="ro_binds"):
            DockerSandboxOptions(ro_binds=bad)

"""The docker backend against a real container engine (``scripts/container_engine.sh start``
provides one: a private dockerd and a base image made from Debian packages, with the image
map ``ubuntu:24.04 -> miles-base:bookworm``). Skipped, with the reason, where none answers.

Covered: the hostile-command suite; a fork bomb at the pids limit stopped without losing the
sandbox; memory limit; Dockerfile builds cached by content, a build needing the network with
none allowed failing at its step; Harbor and terminal-bench tasks built from their own
directories (oracle 1.0, no-op 0.0 through ``miles env validate``), a multi-step Harbor task's
steps in one container; a SIGKILLed run's
containers swept by the next start and by ``miles sandbox sweep``. Sidecars and compose tasks:
test_real_engine_services.py; the helpers: real_engine.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles_engine.errors import SandboxError
from miles_engine.sandbox.hostile import run_hostile_suite
from miles_engine.sandbox.protocol import BuildContext, Resources, SandboxSpec

from .real_engine import ENGINE, TASKS, backend, containers_of, exit_code, run

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("real_engine")]


# ------------------------------------------------------------------ isolation and limits
@pytest.mark.slow
def test_hostile_suite_contained():
    be = backend()

    async def go():
        try:
            return await run_hostile_suite(be, concurrency=1)
        finally:
            await be.aclose()

    results = run(go())
    assert [r.case for r in results if not r.contained] == [], [(r.case, r.duration_s, r.detail) for r in results]
    assert all(r.leftover_processes == 0 for r in results)  # observable here: the engine is local
    assert containers_of(be.run_id) == []


def test_fork_bomb_at_the_pids_limit_is_stopped_and_the_sandbox_lives():
    be = backend(pids_limit=256)

    async def go():
        async with await be.create(SandboxSpec()) as sb:
            bomb = await sb.exec("b() { b | b & }; b; sleep 600", timeout_s=3)
            after = await sb.exec("echo alive; ls /proc | grep -c '^[0-9]'", timeout_s=60)
            return bomb, after, sb

    try:
        bomb, after, sb = run(go())
    except SandboxError as exc:
        # podman: when no exec fits under the limit to stop the bomb's tree from inside, the
        # container is killed instead: still contained, the sandbox reported dead, nothing left
        assert be.cli.engine_name() == "podman", exc
        assert "is dead: its container was killed: a timed-out command" in str(exc), exc
        assert containers_of(be.run_id) == []
        return
    assert bomb.timed_out and bomb.exit_code is None
    assert after.ok and after.stdout.split()[0] == "alive" and int(after.stdout.split()[1]) < 10, after
    assert sb.leftover_processes() == [] and containers_of(be.run_id) == []


def test_memory_limit_holds():
    be = backend()

    async def go():
        async with await be.create(SandboxSpec(resources=Resources(memory_mb=64))) as sb:
            return await sb.exec("python3 -c 'b = bytearray(256 << 20); print(len(b))'", timeout_s=60)

    res = run(go())
    assert res.exit_code not in (0, None) and "268435456" not in res.stdout, res


def test_network_none_has_no_route_out():
    be = backend()

    async def go():
        async with await be.create(SandboxSpec()) as sb:
            return await sb.exec("cat /proc/net/route | wc -l; ls /sys/class/net", timeout_s=30)

    res = run(go())
    lines = res.stdout.split()
    assert res.ok and lines[0] == "1" and lines[1:] == ["lo"], res  # only the header: no routes, only loopback


# ------------------------------------------------------------------ images
def test_build_is_cached_by_content_and_from_lines_are_mapped(tmp_path: Path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(f"FROM ubuntu:24.04\nRUN echo {secrets.token_hex(4)} > /built\n")
    be = backend()

    async def go():
        out = []
        for _ in range(2):
            async with await be.create(SandboxSpec(build=BuildContext(context_dir=ctx))) as sb:
                out.append((await sb.exec("cat /built /etc/debian_version", timeout_s=30)).stdout.split())
        return out

    first, second = run(go())
    assert first == second and len(first) == 2
    stats = be.stats()
    assert stats["sandbox/builds"] == 1 and stats["sandbox/build_cache_hits"] == 1
    assert stats["sandbox/create_n"] == 2 and stats["sandbox/destroy_n"] == 2 and stats["sandbox/exec_n"] == 2
    step = be.step_metrics()  # what the training log gets for a step: since the last call
    assert (step["sandbox/builds"], step["sandbox/build_cache_hits"], step["sandbox/create_n"]) == (1, 1, 2)
    assert 0 < step["sandbox/create_p50_s"] <= step["sandbox/create_p95_s"] and step["sandbox/destroy_p50_s"] > 0
    nothing = be.step_metrics()
    assert nothing["sandbox/builds"] == nothing["sandbox/exec_n"] == 0 and "sandbox/exec_p50_s" not in nothing
    assert (ctx / "Dockerfile").read_text().startswith("FROM ubuntu:24.04")  # the task dir is not modified


def test_build_needing_the_network_fails_at_its_step_when_none_is_allowed(tmp_path: Path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        f"FROM ubuntu:24.04\nRUN echo {secrets.token_hex(4)}\nRUN apt-get update && apt-get install -y cowsay\n"
    )
    be = backend(build_network="none", build_timeout_s=180)
    with pytest.raises(SandboxError) as exc:
        run(be.create(SandboxSpec(build=BuildContext(context_dir=ctx))))
    msg = str(exc.value)
    assert re.search(r"at step 3/\d+: RUN apt-get update && apt-get install -y cowsay", msg), msg
    assert "build_network='none'" in msg and "did not answer" not in msg
    left = subprocess.run([ENGINE, "ps", "--all", "--quiet", "--filter", "status=exited"], capture_output=True,
                          text=True, timeout=60, check=True).stdout.split()
    assert left == []  # no intermediate container of the failed step


# ------------------------------------------------------------------ tasks from their directories
@pytest.mark.parametrize("env_name", ["harbor", "terminal-bench"])
def test_tasks_validate_from_their_own_directories(env_name: str, capsys):
    path = TASKS / env_name
    code = exit_code("env", "validate", env_name, "--path", str(path), "--backend", "docker", "--json", "--jobs", "2")
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    expected = sorted(p.name for p in path.iterdir() if p.is_dir())
    assert sorted(t["task"] for t in report["tasks"]) == expected
    assert all(t["oracle_reward"] == 1.0 and t["nop_reward"] == 0.0 for t in report["tasks"]), report


# ------------------------------------------------------------------ lifecycle
CHILD = textwrap.dedent("""
    import asyncio, sys
    from miles_engine.sandbox.protocol import SandboxSpec
    from miles_sandbox_docker.backend import DockerSandboxBackend
    from miles_sandbox_docker.options import DockerSandboxOptions

    async def main():
        be = DockerSandboxBackend(DockerSandboxOptions(run_id=sys.argv[1]))
        sbs = [await be.create(SandboxSpec()) for _ in range(2)]
        print(" ".join(sb.id for sb in sbs), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def start_and_sigkill(run_id: str) -> list[str]:
    """A miles process creates two sandboxes and is SIGKILLed: its containers stay behind."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, run_id], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ))
    try:
        line = child.stdout.readline()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert len(line.split()) == 2, f"child printed {line!r}"
    left = containers_of(run_id)
    assert len(left) == 2
    return left


def test_sigkilled_run_is_swept_by_the_next_start():
    dead_run = "killed-" + secrets.token_hex(3)
    start_and_sigkill(dead_run)
    be = backend()

    async def go():
        async with await be.create(SandboxSpec()):
            return containers_of(dead_run)

    assert run(go()) == []


def test_sandbox_sweep_command_removes_a_runs_containers(capsys):
    dead_run = "swept-" + secrets.token_hex(3)
    start_and_sigkill(dead_run)
    code = exit_code("sandbox", "sweep", "--backend", "docker", "--option", "sweep_orphans=false",
                     "--run", dead_run, "--json")
    assert code == 0 and len(json.loads(capsys.readouterr().out)) == 2
    assert containers_of(dead_run) == []


def test_concurrency_limit_holds_on_the_engine():
    be = backend(max_sandboxes=2, max_creates_per_s=20)

    async def go():
        first, second = await be.create(SandboxSpec()), await be.create(SandboxSpec())
        third = asyncio.ensure_future(be.create(SandboxSpec()))
        await asyncio.sleep(1.0)
        waited = not third.done()  # a slot frees only when a sandbox closes
        await first.close()
        sb3 = await asyncio.wait_for(third, 120)
        await asyncio.gather(second.close(), sb3.close())
        return waited

    assert run(go())
    assert be.stats()["sandbox/create_n"] == 3 and containers_of(be.run_id) == []


def test_a_multi_step_harbor_task_runs_its_steps_in_one_container():
    """tasks/harbor/two-steps: step 1 solved, step 2 left: Harbor's mean gives 0.5; the step's
    workdir/setup.sh ran before it; [verifier.env] and [steps.verifier.env] reached test.sh; the
    declared artifact came out."""
    from miles_engine.agents.protocol import AgentResult
    from miles_engine.rollout.episode import run_episode
    from miles_env_harbor import load_harbor_task

    class FirstStepOnly:
        name = "first-step-only"

        async def run(self, ctx):
            await ctx.task.solve(ctx)  # step 'count'
            follow = await ctx.next_turn()  # verifies 'count', moves the same container to 'sum'
            hint = await ctx.call_tool("bash", {"command": "cat /app/hint.txt"})
            return AgentResult(turns=1, info={"next": follow, "hint": hint.content})

    be = backend()

    async def go():
        try:
            return await run_episode(load_harbor_task(TASKS / "harbor" / "two-steps"), FirstStepOnly(), be)
        finally:
            await be.aclose()

    result = run(go())
    assert (result.reward.reward, result.reward.error) == (0.5, None), result.reward
    assert result.reward.components == {"reward": 0.5, "steps.count.reward": 1.0, "steps.sum.reward": 0.0}
    assert result.agent.info["hint"] == "use awk\n" and "sum of the numbers" in result.agent.info["next"][0]["content"]
    artifacts = result.info["harbor_steps"]["artifacts"]
    assert artifacts["count"]["files"]["steps/count/app/count.txt"] == "3\n"
    assert containers_of(be.run_id) == []

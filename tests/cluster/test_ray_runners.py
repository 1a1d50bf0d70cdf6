"""Episode runners as Ray actors on a private loopback cluster (2 CPUs): two runners, each with
its own local sandbox backend, run shell-drills episodes with the TITO agent against a session
server in this process. While every episode is held in generation, one runner's actor is
SIGKILLed: its in-flight episodes are counted lost and run again on its replacement (retries=1)
or become failed trajectories naming the runner (retries=0); every group is completed either
way, the killed runner's sandboxes go with it, and every listener is on loopback."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from pathlib import Path

import pytest

from miles_engine.config.recipe import ComponentRef, SandboxRef
from miles_engine.rewards.config import RewardConfig
from miles_engine.rollout.buffer import AsyncBuffer, BufferOptions
from miles_engine.rollout.scheduler import Scheduler, SchedulerOptions
from miles_engine.rollout.tasks import TaskStream
from miles_engine.engines.scripted import ScriptedEngine

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ENV = ComponentRef(name="shell-drills", options={"kinds": ["echo"], "num_tasks": 8})
AGENT = ComponentRef(name="tito", options={"max_turns": 1, "max_tokens": 16, "client": "aiohttp"})
GROUPS, GROUP_SIZE = 4, 2


class HeldEngine(ScriptedEngine):
    """Replies once ``release`` is set; ``held`` counts the generations waiting for it."""

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer, lambda _ids, _req: "echo ok<|im_end|>")
        self.release = asyncio.Event()
        self.held = 0

    async def generate(self, request):  # type: ignore[override]
        self.held += 1
        try:
            await self.release.wait()
        finally:
            self.held -= 1
        return await super().generate(request)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    from miles_engine.cluster.config import MAX_TEMP_DIR, RayOptions
    from miles_engine.cluster.ray_cluster import RayCluster

    temp = tmp_path_factory.getbasetemp() / "ray"
    if len(str(temp)) > MAX_TEMP_DIR:  # Ray's unix sockets live below it
        temp = Path(f"/tmp/mrr-{os.getpid()}")
    c = RayCluster(RayOptions(num_cpus=2, temp_dir=str(temp)), prefix="miles-test").connect()
    yield c
    c.shutdown()
    assert not ray.is_initialized()


async def _until(check, what: str, polls: int = 1200) -> None:
    for _ in range(polls):  # a safety stop only: each condition is reached by the run's own steps
        if check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never reached: {what}")


def _tree(pid: int) -> list[int]:
    try:
        proc = psutil.Process(pid)
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.Error:
        return []


def _off_loopback(pids: list[int]) -> list[str]:
    import ipaddress

    bad = []
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections(kind="inet"):
                addr = ipaddress.ip_address(conn.laddr.ip.split("%")[0])
                addr = getattr(addr, "ipv4_mapped", None) or addr
                if conn.status == psutil.CONN_LISTEN and not addr.is_loopback:
                    bad.append(f"pid {pid} listens on {conn.laddr.ip}:{conn.laddr.port}")
        except psutil.Error:
            continue
    return bad


@pytest.mark.parametrize("retries", [1, 0])
def test_a_killed_runner_loses_only_its_inflight_episodes(cluster, retries: int) -> None:
    from miles_engine.cluster.episode_runners import RayEpisodeRunners, RunnerSpec
    from miles_engine.hub import default_hub
    from miles_engine.tito.families import ChatMLFamily
    from miles_engine.tito.serve import start_session_server
    from miles_engine.models.tokenizer import load_tokenizer

    codec = ChatMLFamily().bind(load_tokenizer("builtin:bpe-chatml"))
    source = default_hub().create("environment", ENV.name, ENV.options)
    refs = list(itertools.islice(TaskStream(source), GROUPS))

    async def main() -> None:
        engine = HeldEngine(codec.tokenizer)
        server = await start_session_server(engine, codec)
        assert server.url.startswith("http://127.0.0.1:")
        spec = RunnerSpec(ENV, SandboxRef(), AGENT, RewardConfig(), server.url)
        runners = RayEpisodeRunners(cluster, spec, count=2, resources={"CPU": 0.5}, retries=retries)
        try:
            restarts = dict(cluster.restarts)  # the cluster is shared by the module's tests
            await runners.start()
            pids = [await s.actor.pid.remote() for s in runners.slots]
            lost: list[str] = []

            async def run(ref, attempt):  # what the scheduler turns into failed trajectories
                try:
                    return await runners(ref, attempt)
                except Exception as exc:
                    lost.append(str(exc))
                    raise

            scheduler = Scheduler(refs, run, AsyncBuffer(BufferOptions(capacity_groups=GROUPS, min_group_size=1)),
                                  SchedulerOptions(group_size=GROUP_SIZE, max_inflight=GROUPS * GROUP_SIZE,
                                                   episode_timeout_s=240))
            await scheduler.start()
            total = GROUPS * GROUP_SIZE
            await _until(lambda: engine.held == total, "every episode held in generation")
            assert [s.inflight for s in runners.slots] == [total // 2] * 2  # least busy first
            sandboxes = _tree(pids[0])[1:]
            assert sandboxes, "runner 0 runs its episodes' sandboxes as its own children"
            assert not _off_loopback(_tree(pids[0]) + _tree(pids[1]))
            os.kill(pids[0], signal.SIGKILL)
            await _until(lambda: runners.counts["episodes_lost"] == total // 2, "runner 0's episodes counted lost")
            engine.release.set()
            await scheduler.wait_idle(timeout=240)
            c = scheduler.counts
            assert c["finished_trajectories"] == total
            assert c["groups_put"] + c["groups_filtered"] == GROUPS  # every group completed
            assert restarts.get("runner-0", 0) + 1 == cluster.restarts["runner-0"]
            assert restarts.get("runner-1", 0) == cluster.restarts.get("runner-1", 0)
            if retries:
                assert c["failed_trajectories"] == 0 and not lost
                assert dict(runners.counts) == {"episodes_lost": total // 2, "episodes_retried": total // 2}
            else:
                assert c["failed_trajectories"] == total // 2
                assert dict(runners.counts) == {"episodes_lost": total // 2, "episodes_failed_lost": total // 2}
                assert len(lost) == total // 2 and all("runner 0 (Ray actor) died" in e for e in lost), lost
            await _until(lambda: not any(psutil.pid_exists(p) for p in sandboxes), "the killed runner's sandboxes gone")
            new_pid = await runners.slots[0].actor.pid.remote()
            assert new_pid != pids[0]
            await scheduler.stop()
        finally:
            await runners.close()
            await server.stop()
        assert cluster.metrics()["ray/actors"] == 0 and cluster.metrics()["ray/placement_groups"] == 0
        await _until(lambda: not any(psutil.pid_exists(p) for p in [new_pid, pids[1]]), "the runner actors gone")

    asyncio.run(main())

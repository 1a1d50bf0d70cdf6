"""TITO session servers as Ray actors on a private loopback cluster (2 CPUs): scripted engines
served over HTTP on loopback in this process behind the driver's router; a session-server actor
kept at the router's view; runner actors running shell-drills episodes with the TITO agent
through it (the driver's own server is a dead address here, so nothing can go around it).

- every episode's trajectory is exactly the engine's prompt + sampled ids and log-probs;
- a quarantine and a re-admission in the driver reach the actor, which routes accordingly;
- a SIGKILLed session-server actor: its in-flight episodes are counted lost and run again, the
  actor is replaced and starts from the driver's current view; every group is completed and
  nothing of ours is left in the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal

import pytest

from miles_engine.config.recipe import ComponentRef, SandboxRef
from miles_engine.rewards.config import RewardConfig
from miles_engine.rollout.buffer import AsyncBuffer, BufferOptions
from miles_engine.rollout.scheduler import Scheduler, SchedulerOptions
from miles_engine.rollout.tasks import TaskStream
from miles_engine.engines.scripted import ScriptedEngine
from tests.cluster.test_ray_runners import HeldEngine, _off_loopback, _tree, _until, cluster  # noqa: F401

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ENV = ComponentRef(name="shell-drills", options={"kinds": ["echo"], "num_tasks": 8})
AGENT = ComponentRef(name="tito", options={"max_turns": 1, "max_tokens": 16, "client": "aiohttp"})
NOWHERE = "http://127.0.0.1:9"  # the driver's session server: no episode may use it here


def _codec():
    from miles_engine.tito.families import ChatMLFamily
    from miles_engine.models.tokenizer import load_tokenizer

    return ChatMLFamily().bind(load_tokenizer("builtin:bpe-chatml"))


@contextlib.asynccontextmanager
async def _served(engines: dict[str, object]):
    """Each engine behind our engine server's HTTP app on 127.0.0.1, and a driver router over them."""
    import uvicorn

    from miles_engine.engines.http.client import HttpEngine
    from miles_engine.run.engine_server import create_engine_app
    from miles_engine.engines.router import Router

    class Quiet(uvicorn.Server):
        def capture_signals(self):  # type: ignore[no-untyped-def]
            return contextlib.nullcontext()

    servers, tasks, clients = [], [], {}
    try:
        for name, engine in engines.items():
            srv = Quiet(uvicorn.Config(create_engine_app(engine, close_engine=False), host="127.0.0.1", port=0,
                                       log_level="warning", lifespan="off"))
            tasks.append(asyncio.create_task(srv.serve()))
            servers.append(srv)
            await _until(lambda: srv.started, f"engine {name} listening")
            port = srv.servers[0].sockets[0].getsockname()[1]
            clients[name] = HttpEngine(f"http://127.0.0.1:{port}", name=name)
        yield Router(clients, health_interval_s=0)
    finally:
        for c in clients.values():
            await c.aclose()
        for srv in servers:
            srv.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


async def _start(cluster, router, codec, *, runners: int, retries: int = 1):  # noqa: F811
    from miles_engine.cluster.episode_runners import RayEpisodeRunners, RunnerSpec
    from miles_engine.cluster.session_servers import RaySessionServers
    from miles_engine.tito.service import RunSessionServerConfig

    servers = RaySessionServers(cluster, router, codec, RunSessionServerConfig(), count=1, resources={"CPU": 0.5})
    await servers.start()
    spec = RunnerSpec(ENV, SandboxRef(), AGENT, RewardConfig(), NOWHERE)
    pool = RayEpisodeRunners(cluster, spec, count=runners, resources={"CPU": 0.5}, retries=retries, servers=servers)
    await pool.start()
    return servers, pool


async def _close(cluster, servers, pool) -> None:  # noqa: F811
    await pool.close()
    await servers.close()
    assert cluster.metrics()["ray/actors"] == 0 and cluster.metrics()["ray/placement_groups"] == 0


def test_episodes_through_a_session_server_actor_are_exact_and_follow_the_drivers_quarantine(cluster) -> None:  # noqa: F811
    codec = _codec()
    source = __import__("miles_engine.hub", fromlist=["default_hub"]).default_hub().create(
        "environment", ENV.name, ENV.options)
    refs = list(itertools.islice(TaskStream(source), 4))
    counter = itertools.count()
    # a distinct answer per generation, tokenized non-canonically (a re-tokenization would show)
    engines = {n: ScriptedEngine(codec.tokenizer, lambda _ids, _req: f"answer number {next(counter)} ok<|im_end|>")
               for n in ("e0", "e1")}

    async def episodes(n: int, pool) -> list:
        return await asyncio.gather(*(pool(refs[i % len(refs)], i) for i in range(n)))

    async def main() -> None:
        async with _served(engines) as router:
            servers, pool = await _start(cluster, router, codec, runners=1)
            try:
                slot = servers.slots[0]
                assert slot.url.startswith("http://127.0.0.1:")
                assert not _off_loopback(_tree(slot.pid))
                trajs = await episodes(6, pool)
                results = {tuple(r.output_ids): (e, r) for e in engines.values() for r in e.results}
                assert len(results) == sum(len(e.results) for e in engines.values()) == 6  # nothing extra
                for t in trajs:
                    assert t.status == "ok", t.error
                    n = sum(t.loss_mask)
                    prompt, sampled = t.token_ids[:-n], t.token_ids[-n:]
                    assert t.loss_mask == [0] * len(prompt) + [1] * n
                    engine, r = results.pop(tuple(sampled))  # the engine's sampled ids, exactly, once
                    assert engine.requests[engine.results.index(r)].input_ids == prompt
                    assert t.rollout_logprobs[-n:] == r.output_logprobs
                    assert t.weight_versions[-n:] == r.weight_versions
                assert not results  # every generation is in a trajectory
                assert all(e.results for e in engines.values())  # both admitted engines served
                stats = await slot.actor.stats.remote()
                assert stats["turns"] == 6 and stats["sessions"] == 0
                await servers.pull_stats()  # the driver router's per-engine counts cover the actor's routes
                assert [s.requests for s in router.slots] == [len(engines[n].results) for n in ("e0", "e1")]
                assert servers.counts["turns"] == 6

                router._quarantine(router.slots[1], "quarantined by the driver (test)")
                await _until(lambda: servers.view.engines[1].admitted is False, "the driver's view changed")
                serial = servers.view.serial
                assert (await _caught_up(slot.actor, serial))["admitted"] == ["e0"]
                before = {n: len(e.results) for n, e in engines.items()}
                assert all(t.status == "ok" for t in await episodes(4, pool))
                assert len(engines["e1"].results) == before["e1"]  # never routed to the quarantined engine
                assert len(engines["e0"].results) == before["e0"] + 4

                await router._readmit(router.slots[1])
                assert router.slots[1].healthy
                await _until(lambda: servers.view.engines[1].admitted, "the re-admission reached the driver's view")
                assert (await _caught_up(slot.actor, servers.view.serial))["admitted"] == ["e0", "e1"]
                assert servers.metrics()["ray/session_servers"] == 1
            finally:
                await _close(cluster, servers, pool)

    asyncio.run(main())


async def _caught_up(actor, serial: int, polls: int = 300) -> dict:
    """The actor's stats once the driver's view ``serial`` reached it (the push is an async Ray call)."""
    for _ in range(polls):  # a safety stop only
        stats = await actor.stats.remote()
        if stats["serial"] >= serial:
            return stats
        await asyncio.sleep(0.1)
    raise AssertionError(f"the session-server actor never received view {serial}: {stats}")


def test_a_killed_session_server_actor_is_replaced_and_its_episodes_run_again(cluster) -> None:  # noqa: F811
    codec = _codec()
    source = __import__("miles_engine.hub", fromlist=["default_hub"]).default_hub().create(
        "environment", ENV.name, ENV.options)
    groups, group_size = 3, 2
    refs = list(itertools.islice(TaskStream(source), groups))
    held = HeldEngine(codec.tokenizer)
    other = ScriptedEngine(codec.tokenizer)

    async def main() -> None:
        async with _served({"e0": held, "e1": other}) as router:
            router._quarantine(router.slots[1], "quarantined before the start (test)")  # every turn is held
            servers, pool = await _start(cluster, router, codec, runners=2)
            try:
                restarts = dict(cluster.restarts)
                slot = servers.slots[0]
                old_pid, old_url = slot.pid, slot.url
                scheduler = Scheduler(refs, pool, AsyncBuffer(BufferOptions(capacity_groups=groups, min_group_size=1)),
                                      SchedulerOptions(group_size=group_size, max_inflight=groups * group_size,
                                                       episode_timeout_s=240))
                await scheduler.start()
                total = groups * group_size
                await _until(lambda: held.held == total, "every episode held in generation")
                os.kill(old_pid, signal.SIGKILL)
                await _until(lambda: servers.counts["episodes_lost"] == total, "its episodes counted lost")
                await _until(lambda: slot.ready.is_set(), "a fresh session server")
                assert slot.pid != old_pid and slot.url != old_url and slot.url.startswith("http://127.0.0.1:")
                stats = await slot.actor.stats.remote()  # it re-received the driver's view: e1 still quarantined
                assert stats["serial"] == servers.view.serial and stats["admitted"] == ["e0"]
                held.release.set()
                await scheduler.wait_idle(timeout=240)
                c = scheduler.counts
                assert c["finished_trajectories"] == total and c["failed_trajectories"] == 0
                assert c["groups_put"] + c["groups_filtered"] == groups  # every group completed
                assert dict(pool.counts) == {"episodes_lost": total, "episodes_retried": total}
                assert cluster.restarts["session-server-0"] == restarts.get("session-server-0", 0) + 1
                assert not other.results  # the quarantined engine never served, before or after the restart
                assert not _off_loopback(_tree(slot.pid))
                m = servers.metrics()
                assert m["ray/session_servers"] == 1 and m["session_servers/episodes_lost"] == total
                await scheduler.stop()
            finally:
                await _close(cluster, servers, pool)
        await _until(lambda: not psutil.pid_exists(old_pid) and not psutil.pid_exists(slot.pid),
                     "the session-server actors gone")

    asyncio.run(main())


def test_an_episode_gets_a_live_server_on_its_runners_node_else_the_least_busy() -> None:
    """The assignment alone (no cluster): nodes as the actors would report them."""
    from miles_engine.cluster.session_servers import RaySessionServers, ServerSlot
    from miles_engine.engines.router import Router

    async def main() -> None:
        router = Router({"e0": ScriptedEngine(_codec().tokenizer)}, health_interval_s=0)
        servers = RaySessionServers(None, router, None, None, count=3, resources={"CPU": 1})
        servers.slots = [ServerSlot(i, node=node) for i, node in enumerate(["A", "A", "B"])]
        for s in servers.slots:
            s.ready.set()
        picks = []
        for _ in range(4):  # two servers on node A share its runners' episodes
            slot = await servers.pick("A")
            slot.episodes += 1
            picks.append(slot.index)
        assert picks == [0, 1, 0, 1]
        assert (await servers.pick("B")).index == 2
        servers.slots[2].ready.clear()  # B's server restarting: the least busy elsewhere
        assert (await servers.pick("B")).index == 0
        assert (await servers.pick("C")).index == 0  # no server on node C: the least busy live one
        for s in servers.slots:
            s.ready.clear()
        waiting = asyncio.create_task(servers.pick("A"))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # none live: it waits for one
        servers.slots[1].ready.set()
        assert (await asyncio.wait_for(waiting, 5)).index == 1

    asyncio.run(main())


def test_the_actors_router_follows_each_view_and_keeps_counts_over_engine_restarts() -> None:
    """ViewRouter alone (no cluster): admitted engines only, a restarted engine's new address,
    waiting while none is admitted, per-engine counts that never go back."""
    from miles_engine.cluster.fleet_view import EngineView, FleetView, ViewRouter
    from miles_engine.engines.protocol import GenerateRequest, SamplingParams

    tok = _codec().tokenizer
    clients: dict[str, ScriptedEngine] = {}

    def client(view: EngineView) -> ScriptedEngine:
        clients[str(view.url)] = ScriptedEngine(tok)
        return clients[str(view.url)]

    def view(serial: int, *engines: tuple[str, str | None, int, bool]) -> FleetView:
        return FleetView(tuple(EngineView(n, u, g, a, 0) for n, u, g, a in engines), 0, False, serial)

    def req(session: str) -> GenerateRequest:
        return GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4), session_id=session)

    async def main() -> None:
        r = ViewRouter(client, wait_s=30)
        await r.apply(view(1, ("e0", "u0", 1, True), ("e1", "u1", 1, False)))
        for i in range(3):
            assert (await r.generate(req(f"s{i}"))).info["engine"] == "e0"  # e1 quarantined by the driver
        assert not clients["u1"].requests
        await r.apply(view(1, ("e0", "u0", 1, False)))  # an old serial: ignored
        assert r.admitted() == ["e0"]
        await r.apply(view(2, ("e0", None, 1, True), ("e1", "u1", 1, False)))  # e0 restarting, e1 out
        waiting = asyncio.create_task(r.generate(req("s9")))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # no admitted engine: it waits for the driver's next view
        await r.apply(view(3, ("e0", "u0b", 2, True), ("e1", "u1", 1, False)))  # e0 back on a new address
        assert (await asyncio.wait_for(waiting, 10)).info["engine"] == "e0"
        assert len(clients["u0b"].requests) == 1 and len(clients["u0"].requests) == 3
        assert r.stats()["engines"]["e0"][0] == 4  # counted over the restart, never back to 0
        await r.apply(view(4, ("e0", "u0b", 2, False), ("e1", "u1", 1, True)))
        assert (await r.generate(req("s0"))).info["engine"] == "e1"  # its session moves off the quarantined e0

    asyncio.run(main())

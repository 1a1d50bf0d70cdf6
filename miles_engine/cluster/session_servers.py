"""TITO session servers as Ray actors (``placement.ray.session_servers: N``).

Each :class:`SessionServerHost` actor runs the run's session server (the same app, codec and
``session_server`` options as the driver's) on its node's address, in front of a
:class:`~miles_engine.cluster.fleet_view.ViewRouter`: the driver's fleet as the driver decides
it. The driver's :class:`RaySessionServers` places the N actors (one bundle each, spread over
nodes), pushes every change of the fleet's view to them (admit / quarantine / restart URLs /
versions / weights held) and hands each episode a server on its runner's node (the least busy
there; else the least busy anywhere).

A session-server actor that dies takes its sessions with it: the episodes using it are lost
(counted with the runners' ``episodes_lost``, and in ``session_servers/episodes_lost``) and run
again like a dead runner's, and the actor is replaced by a fresh one in its bundle that starts
from the current view (``ray/restarts/session-server-N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from miles_engine.cluster.fleet_view import FleetView, ViewRouter, fleet_view
from miles_engine.errors import MilesError
from miles_engine.tito.serve import start_session_server

log = logging.getLogger(__name__)
BOOT_ATTEMPTS = 5
STATS_EVERY_S = 1.0  # how often the actors' per-engine counts are added to the driver router's


class SessionServerHost:
    """The actor body (decorated with ``ray.remote`` by :func:`host_class`)."""

    def __init__(self, codec: Any, config: Any) -> None:
        self.codec, self.config = codec, config
        self.router: ViewRouter | None = None
        self.server: Any = None

    async def start(self, view: FleetView) -> str:
        import ray

        self.router = ViewRouter()
        await self.router.apply(view)
        host = ray.util.get_node_ip_address()  # the node's address (127.0.0.1 on a private cluster)
        self.server = await start_session_server(self.router, self.codec, host=host, port=0, config=self.config)
        return str(self.server.url)

    async def set_fleet(self, view: FleetView) -> int:
        assert self.router is not None
        return await self.router.apply(view)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def stats(self) -> dict[str, Any]:
        assert self.router is not None and self.server is not None
        manager = self.server.server.config.app.state.manager
        return {**self.router.stats(), "sessions": len(manager.sessions), "turns": manager.counters["turns"]}

    async def wait_exit(self) -> None:
        """Never returns: its reference fails when the actor dies (the driver watches it)."""
        await asyncio.Event().wait()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
        if self.router is not None:
            await self.router.aclose()


def host_class(ray: Any) -> Any:
    # restarts are ours (a fresh actor in the bundle, started from the current view)
    return ray.remote(max_restarts=0, max_concurrency=1000)(SessionServerHost)


@dataclass
class ServerSlot:
    index: int
    actor: Any = None
    generation: int = 0
    url: str = ""
    node: str = ""
    pid: int = 0
    episodes: int = 0  # in flight through it
    died: asyncio.Future[str] | None = None  # resolved with the reason when this generation dies
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    watch: asyncio.Task[None] | None = None


class RaySessionServers:
    """The driver's side: N session-server actors, kept at the driver router's view."""

    def __init__(self, cluster: Any, router: Any, codec: Any, config: Any, *, count: int,
                 resources: dict[str, float], sync_interval_s: float = 0.05) -> None:
        self.cluster, self.router, self.codec, self.config = cluster, router, codec, config
        self.count, self.resources, self.sync_interval_s = count, dict(resources), sync_interval_s
        self.slots: list[ServerSlot] = []
        self.counts: Counter[str] = Counter()
        self.view = dataclasses.replace(fleet_view(router), serial=1)
        self.sessions = 0  # open on the actors, at the last pull
        # (slot, generation) -> the totals last added: per engine (requests, tokens, failures), turns
        self._pulled: dict[tuple[int, int], dict[str, tuple[int, int, int]]] = {}
        self._turns: dict[tuple[int, int], int] = {}
        self._group: Any = None
        self._sync: asyncio.Task[None] | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ actors
    async def start(self) -> RaySessionServers:
        self._group = await asyncio.to_thread(self.cluster.placement_group, [self.resources] * self.count,
                                              f"{self.cluster.prefix}-session-servers", strategy="SPREAD")
        self.slots = [ServerSlot(i) for i in range(self.count)]
        try:
            await asyncio.gather(*(self._boot(s) for s in self.slots))
        except Exception as exc:  # noqa: BLE001 - a RayActorError / RayTaskError wrapping the start's error
            raise MilesError(f"a session-server actor failed to start: {_cause(exc)}") from None
        self._sync = asyncio.create_task(self._sync_loop(), name="session-server-views")
        return self

    def _spawn(self, slot: ServerSlot) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = dict(self.resources)
        options: dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0), "resources": res or None,
            "name": f"{self.cluster.prefix}-session-server-{slot.index}-start{slot.generation}",
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._group,
                                                                    placement_group_bundle_index=slot.index),
        }
        slot.actor = self.cluster.track(host_class(self.cluster.ray).options(**options).remote(self.codec,
                                                                                               self.config))

    async def _boot(self, slot: ServerSlot) -> None:
        """A fresh actor in the slot's bundle, serving from the current view."""
        self._spawn(slot)
        sent = self.view
        slot.url = await slot.actor.start.remote(sent)
        slot.node, slot.pid = await slot.actor.where.remote()
        if self.view.serial != sent.serial:  # changed while it started: it must not miss that push
            await slot.actor.set_fleet.remote(self.view)
        slot.died = asyncio.get_running_loop().create_future()
        slot.watch = asyncio.create_task(self._watch(slot, slot.generation), name=f"session-server-{slot.index}")
        slot.ready.set()

    async def _watch(self, slot: ServerSlot, generation: int) -> None:
        try:
            await slot.actor.wait_exit.remote()
            reason = "it returned"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - RayActorError: the actor died
            reason = _cause(exc)
        if not self._closing:
            await self.replace(slot, generation, reason)

    async def replace(self, slot: ServerSlot, generation: int, reason: str) -> None:
        """One replacement per death: mark the dead generation's episodes lost, start a fresh actor."""
        if slot.generation != generation or self._closing:
            return
        log.warning("session server %d (Ray actor) died: %s; starting a fresh one", slot.index, reason)
        slot.ready.clear()
        if slot.died is not None and not slot.died.done():
            slot.died.set_result(f"session server {slot.index} (Ray actor) died: {reason}")
        with contextlib.suppress(Exception):
            self.cluster.ray.kill(slot.actor, no_restart=True)
        self.cluster.forget(slot.actor)
        slot.url = ""
        for attempt in range(BOOT_ATTEMPTS):
            slot.generation += 1
            self.cluster.restarts[f"session-server-{slot.index}"] += 1
            try:
                await self._boot(slot)
                return
            except Exception as exc:  # noqa: BLE001 - retried; episodes go to the other servers meanwhile
                log.warning("session server %d: restart failed: %s", slot.index, _cause(exc))
                with contextlib.suppress(Exception):
                    self.cluster.ray.kill(slot.actor, no_restart=True)
                self.cluster.forget(slot.actor)
                await asyncio.sleep(min(0.5 * 2 ** attempt, 10))
        log.error("session server %d: could not be restarted in %d attempts", slot.index, BOOT_ATTEMPTS)

    async def alive(self, slot: ServerSlot, generation: int) -> bool:
        """Is the generation an episode used still up? (Asked when its episode failed: a death
        the watcher has not seen yet is found here, and the slot replaced.)"""
        if slot.generation != generation or not slot.ready.is_set():
            return False
        try:
            await asyncio.wait_for(asyncio.wrap_future(slot.actor.where.remote().future()), 30)
            return True
        except asyncio.TimeoutError:
            return True  # busy, not dead
        except Exception as exc:  # noqa: BLE001 - RayActorError
            slot.ready.clear()  # no episode picks it again; replaced in a task of its own (not this episode's)
            task = asyncio.create_task(self.replace(slot, generation, _cause(exc)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return False

    # ------------------------------------------------------------------ the fleet's view
    async def _sync_loop(self) -> None:
        pull_every = max(1, round(STATS_EVERY_S / self.sync_interval_s))
        for n in itertools.count(1):
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync()
                if n % pull_every == 0:
                    await self.pull_stats()
            except Exception:  # noqa: BLE001 - the loop must survive; a dead actor is the watcher's
                log.exception("pushing the fleet's view to the session servers failed")

    async def pull_stats(self) -> None:
        """Add what the actors' engines served since the last pull to the driver router's per-engine
        counts, so ``engines/<name>/requests``, ``tokens_per_s`` and ``failures`` cover every route."""
        live = [s for s in self.slots if s.ready.is_set()]
        answers = await asyncio.gather(*(s.actor.stats.remote() for s in live), return_exceptions=True)
        by_name = {slot.name: slot for slot in self.router.slots}
        sessions = 0
        for s, stats in zip(live, answers):
            if isinstance(stats, BaseException):
                continue
            sessions += int(stats["sessions"])
            seen = self._pulled.setdefault((s.index, s.generation), {})
            self.counts["turns"] += int(stats["turns"]) - self._turns.get((s.index, s.generation), 0)
            self._turns[(s.index, s.generation)] = int(stats["turns"])
            for name, totals in stats["engines"].items():
                before = seen.get(name, (0, 0, 0))
                slot = by_name.get(name)
                if slot is not None:
                    slot.requests += totals[0] - before[0]
                    slot.output_tokens += totals[1] - before[1]
                    slot.failures += totals[2] - before[2]
                seen[name] = tuple(totals)
        self.sessions = sessions

    async def sync(self) -> bool:
        """Push the driver router's view when it changed; True if it did."""
        now = fleet_view(self.router)
        if dataclasses.replace(now, serial=self.view.serial) == self.view:
            return False
        self.view = dataclasses.replace(now, serial=self.view.serial + 1)
        live = [s for s in self.slots if s.ready.is_set()]
        results = await asyncio.gather(*(s.actor.set_fleet.remote(self.view) for s in live), return_exceptions=True)
        self.counts["fleet_pushes"] += 1
        for s, r in zip(live, results):
            if isinstance(r, BaseException):
                log.warning("session server %d did not take view %d: %s", s.index, self.view.serial, _cause(r))
        return True

    # ------------------------------------------------------------------ episodes
    async def pick(self, node: str | None) -> ServerSlot:
        """A live server for an episode whose runner is on ``node``: the least busy there, else anywhere."""
        while True:
            live = [s for s in self.slots if s.ready.is_set()]
            if live:
                local = [s for s in live if s.node == node] or live
                return min(local, key=lambda s: (s.episodes, s.index))
            waits = [asyncio.ensure_future(s.ready.wait()) for s in self.slots]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    def metrics(self) -> dict[str, float]:
        out = {"ray/session_servers": float(sum(s.ready.is_set() for s in self.slots)),
               "session_servers/episodes": float(sum(s.episodes for s in self.slots)),
               "session_servers/sessions": float(self.sessions),
               "session_servers/fleet_view": float(self.view.serial)}
        out.update({f"session_servers/{k}": float(v) for k, v in self.counts.items()})
        return out

    async def close(self) -> None:
        self._closing = True
        tasks = [t for t in [self._sync, *(s.watch for s in self.slots), *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ray = self.cluster.ray
        if ray is None or not ray.is_initialized():
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(s.actor.stop.remote() for s in self.slots if s.actor),
                                                  return_exceptions=True), 15)
        self.cluster.dismiss([s.actor for s in self.slots], self._group)
        self.slots, self._group = [], None


def _cause(exc: BaseException) -> str:
    text = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"

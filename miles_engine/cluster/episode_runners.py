"""Episode runners as Ray actors: ``run_trajectory(task_ref, attempt) -> Trajectory`` for the
scheduler, as :class:`~miles_engine.rollout.episodes.EpisodeTrajectories` is in the driver.

Each :class:`EpisodeRunner` actor builds, on its node, the recipe's environment source, sandbox
backend, reward stack and the task's agent (pointed at the session server's address: the
driver's, or per episode a session-server actor's, see :mod:`.session_servers`), and runs
whole episodes there: sandbox → agent ↔ session server → verifier → trajectory. The driver's
:class:`RayEpisodeRunners` hands each episode to the least busy runner and awaits its trajectory;
the scheduler, buffer and driver loop see the same callable as with local episodes.

A runner whose actor dies takes only its in-flight episodes with it: each is counted
(``runners/episodes_lost``), the runner is replaced by a fresh actor in its placement-group
bundle (``ray/restarts/runner-N``), and the episode runs again on a live runner up to
``placement.ray.episode_retries`` times; past that it is a failed trajectory whose error names
the runner (the scheduler's accounting), never a lost one. An episode whose session-server
actor died is lost and retried the same way. Cancelling an episode (its deadline,
the scheduler stopping) cancels its call in the actor, whose ``finally`` closes the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from miles_engine.errors import MilesError
from miles_engine.hub import default_hub
from miles_engine.rollout.episodes import EpisodeTrajectories, finish_trajectory
from miles_engine.rollout.parts import agent_factory, open_environment, open_reward, open_sandboxes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner builds on its node: the recipe's sections, the session server's address."""

    environment: Any  # ComponentRef
    sandbox: Any  # SandboxRef
    agent: Any  # ComponentRef
    reward: Any  # RewardConfig
    server_url: str
    env: tuple[tuple[str, str], ...] = ()  # variables the episodes see (the run name for remote sandboxes)


class EpisodeLost(MilesError):
    """An episode whose runner died, once its retries are spent."""


class EpisodeRunner:
    """The actor body (decorated with ``ray.remote`` by :func:`runner_class`)."""

    def __init__(self, spec: RunnerSpec) -> None:
        os.environ.update(dict(spec.env))
        self.spec = spec
        hub = default_hub()  # an actor body is a program of its own: it builds the hub of its process
        self._stack = AsyncExitStack()
        self.source = open_environment(hub, spec.environment, self._stack)
        self.backend = open_sandboxes(hub, spec.sandbox, self._stack)
        self.reward = open_reward(hub, spec.reward, self._stack)

        def episodes(server_url: str) -> EpisodeTrajectories:
            make_agent = agent_factory(hub, spec.agent, server_url=server_url)
            return EpisodeTrajectories(self.backend, make_agent, self.source, self.reward)

        self._episodes = episodes
        self.by_server: dict[str, EpisodeTrajectories] = {}

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    async def run(self, task: Any, attempt: int, server_url: str | None = None) -> Any:
        """One episode through ``server_url`` (a session-server actor's), else the driver's server."""
        if isinstance(task, str):
            task = self.source.load_task(task)
        url = server_url or self.spec.server_url
        episodes = self.by_server.get(url)
        if episodes is None:
            episodes = self.by_server[url] = self._episodes(url)
        return await episodes(task, attempt)

    async def close(self) -> None:
        await self._stack.aclose()


def runner_class(ray: Any) -> Any:
    # async actor: its episodes interleave like the driver's; restarts are ours (see RayEpisodeRunners)
    return ray.remote(max_restarts=0, max_concurrency=100_000)(EpisodeRunner)


@dataclass
class _Slot:
    index: int
    actor: Any
    generation: int = 0
    inflight: int = 0
    node: str = ""  # its bundle's node (a replacement starts in the same bundle)


class RayEpisodeRunners:
    """``placement.ray.episode_runners`` runner actors behind the scheduler's ``run_trajectory``."""

    def __init__(self, cluster: Any, spec: RunnerSpec, *, count: int, resources: dict[str, float], retries: int,
                 after: Callable[[Any], Awaitable[None]] | None = None, servers: Any = None) -> None:
        self.cluster, self.spec, self.count, self.retries = cluster, spec, count, retries
        self.servers = servers  # RaySessionServers (placement.ray.session_servers > 0), else the driver's server
        self.resources = dict(resources)
        self.after = after  # post-episode step on an ok trajectory, in the driver (teacher scoring)
        self.slots: list[_Slot] = []
        self.counts: Counter[str] = Counter()
        self._group: Any = None
        self._seen_errors: set[str] = set()

    # ------------------------------------------------------------------ actors
    async def start(self) -> RayEpisodeRunners:
        """Place the runners (one bundle each, spread over nodes) and wait until each has built its
        environment, sandbox backend and reward stack: a bad option fails here, before training."""
        self._group = await asyncio.to_thread(self.cluster.placement_group, [self.resources] * self.count,
                                              f"{self.cluster.prefix}-runners", strategy="SPREAD")
        self.slots = [_Slot(i, self._spawn(i, 0)) for i in range(self.count)]
        try:
            nodes = await asyncio.gather(*(s.actor.node.remote() for s in self.slots))
        except Exception as exc:  # noqa: BLE001 - a RayActorError wrapping the constructor's error
            raise MilesError(f"an episode runner actor failed to start: {_cause(exc)}") from None
        for slot, node in zip(self.slots, nodes):
            slot.node = node
        return self

    def _spawn(self, index: int, generation: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = dict(self.resources)
        options: dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0), "resources": res or None,
            "name": f"{self.cluster.prefix}-runner-{index}-start{generation}",
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=index),
        }
        return self.cluster.track(runner_class(self.cluster.ray).options(**options).remote(self.spec))

    def _replace(self, slot: _Slot, generation: int, exc: BaseException) -> None:
        """One replacement per death, however many of its episodes report it."""
        if slot.generation != generation:
            return
        log.warning("episode runner %d (Ray actor) died: %s; starting a fresh one", slot.index, _cause(exc))
        with contextlib.suppress(Exception):
            self.cluster.ray.kill(slot.actor, no_restart=True)
        self.cluster.forget(slot.actor)
        slot.generation += 1
        slot.actor = self._spawn(slot.index, slot.generation)
        self.cluster.restarts[f"runner-{slot.index}"] += 1

    async def close(self) -> None:
        """Let every runner close its sandboxes and sources, then remove the actors and their group."""
        ray = self.cluster.ray
        if ray is None or not ray.is_initialized():
            return
        refs = [s.actor.close.remote() for s in self.slots]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*refs, return_exceptions=True), 30)
        self.cluster.dismiss([s.actor for s in self.slots], self._group)
        self.slots, self._group = [], None

    # ------------------------------------------------------------------ run_trajectory
    async def __call__(self, ref: Any, attempt: int) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        task = ref.id if hasattr(ref, "id") and not hasattr(ref, "verify") else ref
        task_id = str(getattr(ref, "id", ref))
        deaths: list[str] = []
        for _ in range(self.retries + 1):
            slot = min(self.slots, key=lambda s: (s.inflight, s.index))
            generation = slot.generation
            server = await self.servers.pick(slot.node) if self.servers is not None else None
            slot.inflight += 1
            if server is not None:
                server.episodes += 1
            try:
                traj, lost = await self._run_on(slot, server, task, attempt)
            except RayActorError as exc:
                self.counts["episodes_lost"] += 1
                deaths.append(f"runner {slot.index} (Ray actor) died: {_cause(exc)}")
                self._replace(slot, generation, exc)
                continue
            except RayTaskError as exc:  # the episode itself raised (a refused sandbox): as in the driver
                raise exc.as_instanceof_cause() from None
            finally:
                slot.inflight -= 1
                if server is not None:
                    server.episodes -= 1
            if lost is not None:  # its session server died: the episode's sessions went with it
                self.counts["episodes_lost"] += 1
                self.servers.counts["episodes_lost"] += 1
                deaths.append(lost)
                continue
            if deaths:
                self.counts["episodes_retried"] += 1
            return await self._finish(traj, task_id)
        self.counts["episodes_failed_lost"] += 1
        raise EpisodeLost(f"episode {attempt} of task '{task_id}' was lost {len(deaths)} time(s) "
                          f"(placement.ray.episode_retries={self.retries}): {'; '.join(deaths)}")

    async def _run_on(self, slot: _Slot, server: Any, task: Any, attempt: int) -> tuple[Any, str | None]:
        """The episode's trajectory, or (None, why) when its session server died meanwhile."""
        if server is None:
            call = slot.actor.run.remote(task, attempt)
            try:
                return await call, None
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    self.cluster.ray.cancel(call)  # the actor's episode unwinds and closes its sandbox
                raise
        generation, died = server.generation, server.died
        call = slot.actor.run.remote(task, attempt, server.url)
        done = asyncio.wrap_future(call.future())
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved when abandoned
        try:
            await asyncio.wait([done, died], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                self.cluster.ray.cancel(call)
            raise
        if not done.done():
            with contextlib.suppress(Exception):
                self.cluster.ray.cancel(call)
            return None, died.result()
        traj = done.result()
        # an episode that failed as its server died (a reset connection) is lost, not failed
        if traj.status != "ok" and not await self.servers.alive(server, generation):
            return None, f"session server {server.index} (Ray actor) died"
        return traj, None

    async def _finish(self, traj: Any, task_id: str) -> Any:
        return await finish_trajectory(traj, task_id, self.after, self._seen_errors)

    def metrics(self) -> dict[str, float]:
        out = {"runners/live": float(len(self.slots)),
               "runners/inflight": float(sum(s.inflight for s in self.slots))}
        out.update({f"runners/{k}": float(v) for k, v in self.counts.items()})
        return out


def _cause(exc: BaseException) -> str:
    text = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"

"""``placement.backend=ray``: what the composition root asks of the cluster.

    placement = await RayPlacement.start(cfg, kinds, stack)   # joined, resources checked
    trainer   = create_trainer(policy, cfg.trainer, ranks=placement.trainer_ranks())
    ctx       = FleetContext(..., launcher=placement)          # server engines as actors

Every engine of a placeable kind (``server``) is an actor in its group's placement group (one
bundle per engine, ``placement.ray.engine_resources``, +1 GPU on a cuda device); the trainer's
``trainer.parallel.world_size`` ranks are actors in one placement group
(``placement.ray.trainer_resources`` each); the episode runners (agents + sandboxes) are
``placement.ray.episode_runners`` actors spread over nodes (``placement.ray.runner_resources``
each); ``placement.ray.session_servers`` TITO session servers are actors too, kept at the
driver router's view of the engines. The driver loop, the router, the driver's own session
server (bound to the driver node's address: evaluation episodes, and every episode when
``session_servers`` is 0) and the weight transports stay in the driver process.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

from miles_engine.cluster.episode_runners import RayEpisodeRunners
from miles_engine.cluster.ray_cluster import Demand, RayCluster
from miles_engine.cluster.session_servers import RaySessionServers
from miles_engine.cluster.trainer_ranks import RayRanks
from miles_engine.engines.fleet.build import group_names
from miles_engine.errors import ConfigError


def _check_placeable(cfg: Any, kinds: Sequence[Any]) -> None:
    if cfg.placement.colocated:
        raise ConfigError("placement.backend=ray runs the trainer ranks in Ray actors; placement.trainer=in_process "
                          "keeps it in the driver process: use placement.trainer=subprocess")
    for i, (group, kind) in enumerate(zip(cfg.engines, kinds)):
        if kind.in_process:
            raise ConfigError(f"placement.backend=ray places engines in Ray actors, but engines.{i}.kind="
                              f"{group.kind!r} runs them in the driver process; use engines.{i}.kind=server "
                              f"(our engine server, one actor per replica) with weights.transport=broadcast or "
                              f"disk_delta")
        if not getattr(kind, "placeable", False) and group.kind != "external":
            raise ConfigError(f"placement.backend=ray cannot place engines.{i}.kind={group.kind!r} yet; launch "
                              f"those servers yourself and list them with engines.{i}.kind=external, or use "
                              f"engines.{i}.kind=server")


RESOURCE_KEYS = ("engine_resources", "trainer_resources", "runner_resources", "session_server_resources")
DEFAULT_CPU = 1.0
CPU_GRAIN = 1e-4  # Ray's fractional resource granularity


def fit_cpus(bundles: dict[str, int], explicit: dict[str, dict[str, float] | None],
             cluster_cpus: float) -> dict[str, dict[str, float]]:
    """Each component's reservation per bundle: its ``placement.ray.*_resources`` when set; unset, 1
    CPU, or an equal share of the CPUs the set ones leave when the run would not fit otherwise (a
    2-CPU machine runs the defaults). What still does not fit is left to the resource check's error."""
    out = {key: dict(res) for key, res in explicit.items() if res is not None}
    auto = [key for key in bundles if explicit.get(key) is None]
    taken = sum(out[key].get("CPU", 0.0) * bundles.get(key, 0) for key in out)
    wanted = sum(bundles[key] for key in auto) * DEFAULT_CPU
    share = DEFAULT_CPU
    if auto and taken + wanted > cluster_cpus and cluster_cpus - taken > 0:
        share = round(int((cluster_cpus - taken) / sum(bundles[key] for key in auto) / CPU_GRAIN) * CPU_GRAIN, 4)
    for key in auto:
        out[key] = {"CPU": share if share > 0 else DEFAULT_CPU}
    return out


def _with_gpu(resources: dict[str, float], device: str) -> dict[str, float]:
    out = dict(resources)
    if device.startswith("cuda"):
        out["GPU"] = max(out.get("GPU", 0.0), 1.0)
    return out


class RayPlacement:
    def __init__(self, cfg: Any, kinds: Sequence[Any], run_name: str = "miles") -> None:
        self.cfg = cfg
        self.options = cfg.placement.ray
        self.cluster = RayCluster(self.options, prefix=f"miles-{run_name}")
        self.groups = {name: group for name, group, kind in zip(group_names(cfg.engines), cfg.engines, kinds)
                       if getattr(kind, "placeable", False)}
        self._bundles: dict[str, Any] = {}
        # per bundle, by placement.ray key: fitted to the cluster once it is joined
        self.resources = fit_cpus(self.bundle_counts(), {k: getattr(self.options, k) for k in RESOURCE_KEYS},
                                  float("inf"))
        self.runners: Any = None  # RayEpisodeRunners, once started
        self.servers: Any = None  # RaySessionServers, once started

    @classmethod
    async def start(cls, cfg: Any, kinds: Sequence[Any], stack: AsyncExitStack, run_name: str = "miles") -> RayPlacement:
        _check_placeable(cfg, kinds)
        self = cls(cfg, kinds, run_name)
        await asyncio.to_thread(self.cluster.connect)
        stack.push_async_callback(asyncio.to_thread, self.cluster.shutdown)
        cpus = float(self.cluster.ray.cluster_resources().get("CPU", 0.0))
        self.resources = fit_cpus(self.bundle_counts(), {k: getattr(self.options, k) for k in RESOURCE_KEYS}, cpus)
        self.cluster.check_resources(self.demands())
        for name, group in self.groups.items():  # reserve now: a cluster that cannot hold them fails before any start
            pg = await asyncio.to_thread(self.cluster.placement_group, [self.engine_resources(group)] * group.replicas,
                                         f"{self.cluster.prefix}-engines-{name}")
            self._bundles[name] = pg
        return self

    def bundle_counts(self) -> dict[str, int]:
        """How many bundles each ``placement.ray.*_resources`` key sizes in this run."""
        counts = {"engine_resources": sum(g.replicas for g in self.groups.values()),
                  "trainer_resources": self.cfg.trainer.parallel.world_size,
                  "runner_resources": self.options.episode_runners,
                  "session_server_resources": self.options.session_servers}
        return {k: n for k, n in counts.items() if n}

    def engine_resources(self, group: Any) -> dict[str, float]:
        return _with_gpu(self.resources.get("engine_resources", {"CPU": DEFAULT_CPU}), group.device)

    def trainer_resources(self) -> dict[str, float]:
        return _with_gpu(self.resources["trainer_resources"], self.cfg.trainer.parallel.device)

    def demands(self) -> list[Demand]:
        out = [Demand(f"engines.{i} ({g.kind}, {g.replicas} replica(s))", self.engine_resources(g), g.replicas)
               for i, g in enumerate(self.cfg.engines) if g in self.groups.values()]
        world = self.cfg.trainer.parallel.world_size
        out.append(Demand(f"the trainer (trainer.parallel.world_size={world} rank(s))", self.trainer_resources(), world,
                          "trainer_resources"))
        n = self.options.episode_runners
        out.append(Demand(f"the episode runners (placement.ray.episode_runners={n})",
                          self.resources["runner_resources"], n, "runner_resources"))
        if self.options.session_servers:
            n = self.options.session_servers
            out.append(Demand(f"the session servers (placement.ray.session_servers={n})",
                              self.resources["session_server_resources"], n, "session_server_resources"))
        return out

    # ------------------------------------------------------------------ the episode runners
    async def episode_runners(self, spec: Any, after: Callable[..., Any] | None, servers: Any = None) -> Any:
        """Runner actors (agents + sandboxes) behind the scheduler's ``run_trajectory``, started."""
        o = self.options
        self.runners = RayEpisodeRunners(self.cluster, spec, count=o.episode_runners,
                                         resources=self.resources["runner_resources"],
                                         retries=o.episode_retries, after=after, servers=servers)
        return await self.runners.start()

    async def session_servers(self, router: Any, codec: Any, config: Any) -> Any:
        """``placement.ray.session_servers`` session-server actors kept at ``router``'s view, started (None: 0)."""
        if not self.options.session_servers:
            return None
        o = self.options
        self.servers = RaySessionServers(self.cluster, router, codec, config, count=o.session_servers,
                                         resources=self.resources["session_server_resources"])
        return await self.servers.start()

    # ------------------------------------------------------------------ the trainer
    def trainer_ranks(self) -> Callable[..., Any]:
        return functools.partial(RayRanks, cluster=self.cluster, resources=self.trainer_resources())

    # ------------------------------------------------------------------ EngineLauncher
    def device(self, group: Any, index: int) -> str:
        return "cuda" if group.device.startswith("cuda") else group.device  # an actor sees its own GPU only

    def process_factory(self, group_name: str, replica: int) -> Callable[..., Any]:
        from miles_engine.cluster.engine_actor import RayServerProcess

        group = self.groups[group_name]
        return functools.partial(RayServerProcess, cluster=self.cluster, bundle=(self._bundles[group_name], replica),
                                 resources=self.engine_resources(group))

    def driver_address(self) -> str:
        """The address engine actors reach the driver at (the broadcast group's rendezvous)."""
        return str(self.cluster.ray.util.get_node_ip_address())

    def metrics(self) -> dict[str, float]:
        out = self.cluster.metrics()
        if self.runners is not None:
            out.update(self.runners.metrics())
        if self.servers is not None:
            out.update(self.servers.metrics())
        return out

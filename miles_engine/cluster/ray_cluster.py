"""The run's Ray cluster: joined (``placement.ray.address``) or started privately on loopback,
every resource the recipe asks for checked before anything starts, every actor and placement
group the run made removed at the end.

Ray binds the machine's own address (and ``::``) even when told ``127.0.0.1``; with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (in the environment of the processes it starts and in
this process's Ray constants) a private cluster listens on 127.0.0.1 only. A joined cluster is
left as it is configured: its nodes must reach each other on real addresses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_engine.cluster.config import RayOptions
from miles_engine.errors import ConfigError, MilesError

log = logging.getLogger(__name__)

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("placement.backend=ray needs Ray: pip install 'miles-engine[ray]'") from exc
    return ray


@dataclass
class Demand:
    """What one placed component reserves: ``bundles`` bundles of ``resources`` each."""

    component: str  # the recipe key it comes from, e.g. "engines.0 (server, 2 replicas)"
    resources: dict[str, float]
    bundles: int = 1
    key: str = "engine_resources"  # the placement.ray key that sizes it


@dataclass
class RayCluster:
    options: RayOptions
    prefix: str = "miles"  # the run's name: actor and placement-group names carry it
    ray: Any = None
    started_here: bool = False
    _temp_dir: str | None = None
    _actors: list[Any] = field(default_factory=list)
    _groups: list[Any] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    # ------------------------------------------------------------------ joining
    def connect(self) -> RayCluster:
        ray = self.ray = import_ray()
        o = self.options
        if ray.is_initialized():
            raise MilesError("placement.backend=ray: Ray is already initialised in this process; the run joins "
                             "its cluster itself (set placement.ray.address)")
        common = dict(namespace=o.namespace, log_to_driver=False, logging_level=logging.WARNING,
                      configure_logging=True)
        if o.address is None:
            _loopback_only(ray)
            self._temp_dir = o.temp_dir or tempfile.mkdtemp(prefix="miles-ray-", dir="/tmp")
            ray.init(num_cpus=o.num_cpus, num_gpus=o.num_gpus, include_dashboard=o.dashboard,
                     _node_ip_address="127.0.0.1", _temp_dir=self._temp_dir, **common)
            self.started_here = True
        else:
            self._probe(o.address)  # Ray itself retries a dead address for minutes
            try:
                ray.init(address=o.address, **common)
            except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, ValueError, RuntimeError…
                raise ConfigError(f"placement.ray.address={o.address!r}: no Ray cluster answers there "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                  f"start one with `ray start --head`, or unset placement.ray.address for a "
                                  f"private one-node cluster") from exc
        return self

    @property
    def temp_dir(self) -> str | None:
        """A private cluster's session directory (on this machine)."""
        return self._temp_dir

    def _probe(self, address: str) -> None:
        """Fail within ``connect_timeout_s`` (one error naming the address) when nothing listens there."""
        from ray._private.services import canonicalize_bootstrap_address

        where = f"placement.ray.address={address!r}"
        hint = "start one with `ray start --head`, or unset placement.ray.address for a private one-node cluster"
        try:
            target = canonicalize_bootstrap_address(address.removeprefix("ray://"))
        except Exception as exc:  # noqa: BLE001 - a malformed address or no running cluster for "auto"
            raise ConfigError(f"{where}: {type(exc).__name__}: {exc}; {hint}") from None
        if target is None:
            raise ConfigError(f"{where}: no running Ray cluster was found on this machine; {hint}")
        host, _, port = target.rpartition(":")
        deadline = time.monotonic() + self.options.connect_timeout_s
        while True:
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                    return
            except (OSError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise ConfigError(f"{where}: nothing answers at {target} within "
                                      f"{self.options.connect_timeout_s:g} s ({exc}); {hint}") from None
            time.sleep(0.5)

    def check_resources(self, demands: Sequence[Demand]) -> None:
        """One error naming the component and the resource when the cluster cannot hold them all."""
        total = self.ray.cluster_resources()
        need: dict[str, float] = defaultdict(float)
        for d in demands:
            for res, amount in d.resources.items():
                need[res] += amount * d.bundles
        shown = ", ".join(f"{k}: {v:g}" for k, v in sorted(total.items())
                          if "_group_" not in k and not k.startswith("node:"))
        for d in demands:  # one component alone too big: name it
            for res, amount in d.resources.items():
                have = float(total.get(res, 0.0))
                if amount * d.bundles > have:
                    raise ConfigError(
                        f"{d.component} asks for {res}: {amount:g} x {d.bundles} bundle(s), and the run needs "
                        f"{need[res]:g} {res} in all, but the Ray cluster has {have:g} {res} ({shown}); lower "
                        f"placement.ray.{d.key} or the replicas / ranks / runners, or grow the cluster")
        for res, amount in need.items():  # only together too big: name every component asking for it
            have = float(total.get(res, 0.0))
            if amount > have:
                askers = [d for d in demands if d.resources.get(res)]
                parts = "; ".join(f"{d.component} asks for {res}: {d.resources[res]:g} x {d.bundles} bundle(s)"
                                  for d in askers)
                keys = ", ".join(dict.fromkeys(f"placement.ray.{d.key}" for d in askers))
                raise ConfigError(f"the run needs {amount:g} {res} in all ({parts}), but the Ray cluster has "
                                  f"{have:g} {res} ({shown}); lower {keys} or the replicas / ranks / runners, "
                                  f"or grow the cluster")

    # ------------------------------------------------------------------ placing
    def placement_group(self, bundles: list[dict[str, float]], name: str, strategy: str | None = None) -> Any:
        from ray.util.placement_group import placement_group

        pg = placement_group(bundles, strategy=strategy or self.options.strategy, name=name)
        self._groups.append(pg)
        ready, _ = self.ray.wait([pg.ready()], timeout=self.options.connect_timeout_s)
        if not ready:
            raise MilesError(f"Ray could not reserve {bundles} for {name} within "
                             f"{self.options.connect_timeout_s:g} s (placement.ray.connect_timeout_s)")
        return pg

    def remove_group(self, pg: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        if pg in self._groups:
            self._groups.remove(pg)
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    def track(self, actor: Any) -> Any:
        self._actors.append(actor)
        return actor

    def forget(self, actor: Any) -> None:
        with contextlib.suppress(ValueError):
            self._actors.remove(actor)

    def dismiss(self, actors: Any, group: Any = None) -> None:
        """Kill these actors (no restart), stop tracking them and remove their placement group."""
        for actor in actors:
            if actor is None:
                continue
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            self.forget(actor)
        if group is not None:
            self.remove_group(group)

    def metrics(self) -> dict[str, float]:
        out = {"ray/actors": float(len(self._actors)), "ray/placement_groups": float(len(self._groups))}
        out.update({f"ray/restarts/{k}": float(v) for k, v in self.restarts.items()})
        return out

    # ------------------------------------------------------------------ leaving
    def shutdown(self) -> None:
        """Kill the run's actors, remove its placement groups, leave (and stop a private cluster)."""
        ray = self.ray
        if ray is None or not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for actor in reversed(self._actors):
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        for pg in reversed(self._groups):
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self._actors.clear()
        self._groups.clear()
        ray.shutdown()
        if self.started_here and self._temp_dir and self.options.temp_dir is None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _session_processes_alive(self._temp_dir):
                time.sleep(0.2)
            shutil.rmtree(self._temp_dir, ignore_errors=True)


def _loopback_only(ray: Any) -> None:
    """Keep a private cluster on 127.0.0.1: the processes Ray starts read the variable, and this
    process's Ray read it at import (possibly before this ran), so its constant is set too."""
    os.environ.update(LOOPBACK_ENV)
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _session_processes_alive(temp_dir: str) -> bool:
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                return True
    return False

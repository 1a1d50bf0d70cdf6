"""Engine processes in Ray actors. An :class:`EngineHost` actor launches our engine server on
its node (bound to the node's address) and watches it; :class:`RayServerProcess` is that
actor as the engine supervisor sees a server process (spawn / wait_ready / alive / kill / stop),
so restart-with-current-weights and request retries work unchanged: a dead actor (or a dead
server inside it) is replaced by a fresh actor in the same placement-group bundle.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_engine.engines.launch import EngineStartError, ServerProcess

DIED = -9  # returncode reported for an actor that died (its server went with it)


class EngineHost:
    """The actor body (decorated with ``ray.remote`` by :func:`host_class`)."""

    def __init__(self, argv: Sequence[str], log_path: str, env: Mapping[str, str] | None) -> None:
        import ray

        self.host = ray.util.get_node_ip_address()
        port_file = Path(tempfile.mkdtemp(prefix="miles-engine-port-")) / "port"  # on this actor's node
        argv = _replace(_replace(list(argv), "--host", self.host), "--port-file", str(port_file))
        self.process = ServerProcess(argv, host=self.host, port_file=port_file, env=env,
                                     log_path=log_path, name=Path(log_path).parent.name)
        self.started = asyncio.Event()

    async def start(self, deadline_s: float) -> str:
        self.process.spawn()
        self.started.set()
        await self.process.wait_ready(deadline_s)
        return self.process.url

    async def wait_exit(self) -> int:
        await self.started.wait()
        while self.process.alive():
            await asyncio.sleep(0.2)
        return int(self.process.returncode or 0)

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    async def stop(self, grace_s: float) -> int | None:
        return await self.process.stop(grace_s=grace_s)


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


def host_class(ray: Any) -> Any:
    return ray.remote(max_restarts=0, max_concurrency=16)(EngineHost)


class RayServerProcess:
    """One engine server in a Ray actor, behind :class:`ServerProcess`'s interface."""

    def __init__(self, argv: Sequence[str], *, cluster: Any, bundle: tuple[Any, int], resources: Mapping[str, float],
                 log_path: str | Path, name: str, env: Mapping[str, str] | None = None, **_: Any) -> None:
        self.argv, self.cluster, self.bundle, self.name = list(argv), cluster, bundle, name
        self.resources = dict(resources)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = dict(env) if env is not None else None
        self.actor: Any = None
        self.url = ""
        self.starts = 0
        self._exit_ref: Any = None
        self._start_ref: Any = None

    @property
    def pid(self) -> int | None:
        return None

    def spawn(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.cluster.ray
        pg, index = self.bundle
        res = dict(self.resources)
        options: dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0), "resources": res or None,
            "name": f"{self.cluster.prefix}-{self.name}-start{self.starts}",
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        }
        if self.starts:
            self.cluster.restarts[self.name] += 1
        self.starts += 1
        self.actor = self.cluster.track(host_class(ray).options(**options).remote(self.argv, str(self.log_path),
                                                                                  self.env))
        self._start_ref = None
        self._exit_ref = self.actor.wait_exit.remote()

    async def wait_ready(self, deadline_s: float) -> None:
        self._start_ref = self.actor.start.remote(deadline_s)
        try:
            self.url = await asyncio.wait_for(asyncio.wrap_future(self._start_ref.future()), deadline_s + 30)
        except asyncio.TimeoutError:
            self.kill()
            raise EngineStartError(f"{self.name}: its Ray actor was not placed and serving within "
                                   f"{deadline_s:.0f}s; log {self.log_path}:\n{self.log_tail()}") from None
        except Exception as exc:  # noqa: BLE001 - a RayTaskError wraps the actor's EngineStartError
            self.kill()
            cause = getattr(exc, "cause", None) or exc
            raise EngineStartError(f"{self.name}: its Ray actor failed to start the engine server: "
                                   f"{type(cause).__name__}: {str(cause).strip().splitlines()[0]}; log "
                                   f"{self.log_path}:\n{self.log_tail()}") from None

    def alive(self) -> bool:
        if self._exit_ref is None:
            return False
        ready, _ = self.cluster.ray.wait([self._exit_ref], timeout=0)
        return not ready

    @property
    def returncode(self) -> int | None:
        if self.alive():
            return None
        try:
            return int(self.cluster.ray.get(self._exit_ref, timeout=5))
        except Exception:  # noqa: BLE001 - the actor died (RayActorError): its server with it
            return DIED

    def log_tail(self, lines: int = 40) -> str:
        try:  # the log lives on the actor's node: read it from the file where it is shared, else ask the actor
            data = self.log_path.read_bytes()[-32768:].decode("utf-8", "replace")
            return "\n".join(data.splitlines()[-lines:])
        except OSError:
            pass
        with contextlib.suppress(Exception):
            return str(self.cluster.ray.get(self.actor.log_tail.remote(lines), timeout=5))
        return "(no log)"

    def kill(self) -> None:
        """Kill the actor (its server stops with it: ``--exit-with-parent``)."""
        if self.actor is None:
            return
        with contextlib.suppress(Exception):
            self.cluster.ray.kill(self.actor, no_restart=True)
        self.cluster.forget(self.actor)
        self._exit_ref = None

    async def stop(self, grace_s: float = 10.0) -> int | None:
        if self.actor is None:
            return None
        code: int | None = None
        with contextlib.suppress(Exception):
            ref = self.actor.stop.remote(grace_s)
            code = await asyncio.wait_for(asyncio.wrap_future(ref.future()), grace_s + 10)
        self.kill()
        return code

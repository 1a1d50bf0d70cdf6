"""Trainer ranks as Ray actors: one actor per rank in one placement group, each running the
same :class:`RankWorker` as a local rank process, joined into one torch.distributed group
(gloo / NCCL) whose rendezvous address and port come from rank 0's actor.

:class:`RayRanks` is what :class:`FSDPTrainer` drives (``ranks=``): send a command to every
rank, gather rank 0's answer. A rank that raises or whose actor dies fails the trainer with one
:class:`TrainerError` naming the rank; the run then resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from miles_engine.trainer.distributed import RankWorker
from miles_engine.trainer.protocol import TrainerError

WEIGHT_THREADS = 4  # a broadcast waiting, an abort, a restarted engine's fetch, a check's digests


class RankHost:
    """The actor body (``ray.remote`` applied in :class:`RayRanks`)."""

    def rendezvous(self) -> tuple[str, int]:
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def init(self, rank: int, world: int, init_method: str, model: Any, config: dict, make: Any) -> dict[str, Any]:
        self.worker = RankWorker(rank, world, init_method, model, config, make)
        return self.worker.info()

    def handle(self, cmd: str, arg: Any) -> Any:
        return self.worker.handle(cmd, arg)

    def weights(self, method: str, *args: Any) -> Any:
        """Rank 0's side of the weight-sync group (:class:`Rank0WeightSync`), called in the actor's
        ``weights`` concurrency group: an abort is taken while a broadcast waits, and trainer
        commands (the default group, one at a time) never interleave with each other."""
        if getattr(self, "sync", None) is None:
            import ray

            from miles_engine.weights.rank0 import Rank0WeightSync

            self.sync = Rank0WeightSync(self.worker.exports, ray.util.get_node_ip_address())
        return getattr(self.sync, method)(*args)


class RayRanks:
    def __init__(self, world: int, model: Any, config: dict, make: Callable[..., Any] | None, *,
                 cluster: Any, resources: Mapping[str, float]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cluster = cluster
        ray = cluster.ray
        res = dict(resources)
        cpus, gpus = res.pop("CPU", 0.0), res.pop("GPU", 0.0)
        self.group = cluster.placement_group([dict(resources) for _ in range(world)], name=f"{cluster.prefix}-trainer")
        cls = ray.remote(max_restarts=0, concurrency_groups={"weights": WEIGHT_THREADS})(RankHost)
        self.actors = [
            cluster.track(cls.options(
                num_cpus=cpus, num_gpus=gpus, resources=res or None, name=f"{cluster.prefix}-trainer-rank{r}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=r),
            ).remote()) for r in range(world)
        ]
        if cluster.started_here:  # one machine: a file store, no listening socket
            init = f"file://{cluster.temp_dir}/trainer-store-{uuid.uuid4().hex[:8]}"
        else:  # rank 0's node and a port free there (its TCPStore listens on every interface)
            host, port = ray.get(self.actors[0].rendezvous.remote(), timeout=cluster.options.connect_timeout_s)
            init = f"tcp://{host}:{port}"
        model_ref = ray.put(model)
        self._refs = [a.init.remote(r, world, init, model_ref, config, make) for r, a in enumerate(self.actors)]

    def weight_call(self, method: str, *args: Any) -> Any:
        """Rank 0's weight-sync side (an ObjectRef): never queued behind a trainer command."""
        return self.actors[0].weights.options(concurrency_group="weights").remote(method, *args)

    def send(self, cmd: str, args: Sequence[Any]) -> None:
        self._refs = [a.handle.remote(cmd, arg) for a, arg in zip(self.actors, args)]

    def gather(self, timeout: float | None, what: str) -> Any:
        ray = self.cluster.ray
        pending = list(self._refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                ranks = sorted(self._refs.index(p) for p in pending)
                raise TrainerError(f"trainer ranks {ranks} did not answer {what} within {timeout:.0f} s")
            for ref in ready:
                rank = self._refs.index(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise TrainerError(f"trainer rank {rank} (Ray actor) died during {what}: "
                                       f"{str(exc).splitlines()[0]}") from None
                except ray.exceptions.RayTaskError as exc:
                    raise TrainerError(f"trainer rank {rank} failed during {what}:\n{exc}") from None
        return ray.get(self._refs[0])

    def close(self, grace_s: float = 30.0) -> None:
        with contextlib.suppress(Exception):
            self.send("close", [None] * len(self.actors))
            self.gather(grace_s, "close")
        self.stop()

    def stop(self) -> None:
        ray = self.cluster.ray
        if not ray.is_initialized():
            return
        self.cluster.dismiss(self.actors, self.group)

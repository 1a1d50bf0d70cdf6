"""``placement.backend=ray`` + ``weights.transport=broadcast``: trainer rank 0's actor is rank 0
of the weight-sync group (a private loopback cluster, 2 CPUs, 2 ``server`` engine actors, 2
FSDP2 rank actors, the composition root's own builders). Checked pushes carry exactly the trainer's weights while no
tensor reaches the driver; an engine actor killed mid-run is restored from rank 0's last pushed
export and the group is rebuilt on a new port; a rank-0 wait stuck on an engine that never joins is aborted
at once from the driver (the actor takes the abort while the wait runs)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from miles_engine.config import load_recipe
from miles_engine.hub import default_hub
from miles_engine.run.compose import Teardown, _engine_kinds, _start_engines, _start_placement, _start_transport
from miles_engine.run.trainer_access import TrainerAccess
from miles_engine.trainer.distributed import FSDPTrainer
from miles_engine.weights import WeightPushError
from miles_engine.weights.tensors import digests
from tests.trainer.helpers import TINY, random_groups
from tests.weights.helpers import trainer_model

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _recipe(world: int, temp: Path) -> object:
    trainer_cpu = 0.5 / world
    return load_recipe("tiny-terminal", [
        "engines=[{kind: server, replicas: 2}]", "weights.transport=broadcast", "weights.check_update_equal=true",
        "placement.backend=ray", "placement.ray.num_cpus=2", "placement.ray.engine_resources={CPU: 0.5}",
        f"placement.ray.trainer_resources={{CPU: {trainer_cpu}}}", "placement.ray.runner_resources={CPU: 0.25}",
        f"placement.ray.temp_dir={temp}", f"trainer.parallel.world_size={world}",
        "trainer.max_tokens_per_micro_batch=64", "trainer.minibatches=1"], hub=default_hub())


async def _push(trainer: TrainerAccess, engines: object, transport: object) -> object:
    """TrainingRun.push_weights' own steps."""
    export = await trainer.export_for_push()
    async with engines.weights_held():
        stats = await transport.push(export, trainer.weight_version)
        trainer.record_push(export, stats.version)
    return stats


async def _engine_digests(engines: object) -> list[dict[str, str]]:
    return [await s.engine.weight_checksums() for s in engines.slots]


def test_rank0_broadcasts_checked_pushes_without_the_driver_holding_tensors(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    world = 2  # FSDP2 ranks: the export is gathered onto rank 0 (world 1 runs in test_ray_e2e.py)
    shipped: list[str] = []  # every trainer export that came to the driver
    real = FSDPTrainer.named_tensors
    monkeypatch.setattr(FSDPTrainer, "named_tensors", lambda self, *a: shipped.append("export") or real(self, *a))
    temp = Path(f"/tmp/mw-{os.getpid()}-{world}")  # short: Ray's socket paths stay < 108 bytes
    cfg = _recipe(world, temp)
    policy = trainer_model(seed=1, config=TINY)

    async def go() -> None:
        async with Teardown() as stack:
            kinds = _engine_kinds(cfg, default_hub())
            placement = await _start_placement(cfg, kinds, tmp_path, stack)
            trainer = await asyncio.to_thread(TrainerAccess.create, policy, cfg, ranks=placement.trainer_ranks())
            stack.push_async_callback(asyncio.to_thread, trainer.close)
            engines = await _start_engines(cfg, kinds, tmp_path, policy, trainer, placement, stack)
            transport = await _start_transport(cfg, tmp_path, engines, kinds, trainer, None, placement, stack)
            sender = trainer._rank0
            assert sender is not None and transport.inner.sender is sender
            ports: list[int] = []  # each group's rendezvous port on rank 0's node
            opened = sender.open

            async def open_group(*args: object) -> tuple:
                got = await opened(*args)
                ports.append(got[1])
                return got

            sender.open = open_group

            for step in range(1, 3):
                await trainer.train_step(random_groups(2, 4, seed=step))
                stats = await _push(trainer, engines, transport)
                metrics = stats.metrics()
                assert metrics["weights/sender_rank0"] == 1.0 and metrics["weights/driver_bytes"] == 0.0
                assert stats.version == step and stats.engines == 2 and stats.bytes > 0
                assert stats.tensors_checked == 2 * stats.tensors  # digests on rank 0, read back on both engines
            assert shipped == [] and sender.fetched_bytes == 0  # not one tensor came to the driver
            exported = await trainer.named_tensors()  # now, for this test's own comparison
            assert await _engine_digests(engines) == [digests(dict(exported))] * 2

            # an engine actor dies: restored from rank 0's last push, the group rebuilt
            victim = engines.slots[0].engine
            ray.kill(victim.process.actor, no_restart=True)
            for _ in range(1200):  # bounded by count; the restart itself by its start timeout
                if victim.restarts and victim.client is not None and engines.slots[0].healthy:
                    break
                await asyncio.sleep(0.1)
            assert victim.restarts == 1 and sender.fetched_bytes > 0  # the one time tensors came here
            assert await victim.weight_checksums() == digests(dict(exported))  # the last pushed weights
            await trainer.train_step(random_groups(2, 4, seed=9))
            stats = await _push(trainer, engines, transport)
            assert transport.inner.builds == 2 and len(ports) == 2 and ports[0] != ports[1]
            assert stats.tensors_checked == 2 * stats.tensors
            assert stats.driver_bytes == 0
            assert await _engine_digests(engines) == [digests(dict(await trainer.named_tensors()))] * 2

            # rank 0 waiting for an engine that never joins: the driver's abort frees it at once
            _, port, _, joining = await sender.open(2, "never-joined", "gloo", 600.0)
            assert port > 0
            await asyncio.sleep(0.5)
            await asyncio.wait_for(sender.abort(), 60)  # safety stops, far below the 600 s the join would wait
            with pytest.raises(WeightPushError, match="joining the weight-sync group on trainer rank 0 was aborted"):
                await asyncio.wait_for(joining, 60)

    try:
        asyncio.run(go())
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert not ray.is_initialized()

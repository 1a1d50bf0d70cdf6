"""Trainer ranks as Ray actors (a private loopback cluster, 2 CPUs): two FSDP2 ranks in actors
train exactly like two rank processes of this machine, and a rank actor that dies fails the
step with one error naming the rank (the run then resumes from its checkpoint)."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator

import pytest

from miles_engine.trainer import FSDPTrainer, TrainerError
from miles_engine.trainer.distributed import rank_info
from tests.trainer.helpers import TIMING, TINY, max_diff, random_groups

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

CFG = {"optimizer": {"lr": 1e-3}, "mismatch": {"mode": "tis"}, "max_tokens_per_micro_batch": 40,
       "parallel": {"world_size": 2}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from miles_engine.cluster.config import RayOptions
    from miles_engine.cluster.ray_cluster import RayCluster

    temp = f"/tmp/mt-{os.getpid()}"
    c = RayCluster(RayOptions(num_cpus=2, temp_dir=temp), prefix="miles-test").connect()
    yield c
    c.shutdown()
    assert not ray.is_initialized()
    shutil.rmtree(temp, ignore_errors=True)


def _ranks(cluster: object) -> functools.partial:
    from miles_engine.cluster.trainer_ranks import RayRanks

    return functools.partial(RayRanks, cluster=cluster, resources={"CPU": 0.5})


def test_rank_actors_train_like_rank_processes(cluster) -> None:
    groups = random_groups(3, 4, seed=2, gaps=True)
    with FSDPTrainer(TINY, CFG) as local, FSDPTrainer(TINY, CFG, ranks=_ranks(cluster)) as placed:
        assert placed.call(rank_info) == {"rank": 0, "world_size": 2, "device": "cpu", "weight_version": 0}
        a, b = local.train_step(groups), placed.train_step(groups)
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
        assert max_diff(dict(local.named_tensors()), dict(placed.named_tensors())) == 0
        state = placed.state_dict()
        assert state["weight_version"] == 1
        assert cluster.metrics()["ray/actors"] == 2
    assert cluster.metrics()["ray/actors"] == 0  # closed: its actors are gone


def test_a_dead_rank_actor_fails_the_step_naming_it(cluster) -> None:
    trainer = FSDPTrainer(TINY, CFG, ranks=_ranks(cluster))
    try:
        trainer.train_step(random_groups(2, 4, seed=1))
        ray.kill(trainer._ranks.actors[1], no_restart=True)
        with pytest.raises(TrainerError, match=r"trainer rank 1 \(Ray actor\) died during train_step"):
            trainer.train_step(random_groups(2, 4, seed=3))
        with pytest.raises(TrainerError, match="closed"):
            trainer.train_step(random_groups(2, 4, seed=4))
    finally:
        trainer.close()
    assert cluster.metrics()["ray/actors"] == 0


def test_a_rank_that_raises_reports_its_traceback(cluster) -> None:
    with FSDPTrainer(TINY, CFG, ranks=_ranks(cluster)) as trainer:
        with pytest.raises(TrainerError, match=r"trainer rank [01] failed during call:(.|\n)*ZeroDivisionError") as err:
            trainer.call(_divide_by_zero)
        assert "ip=127.0.0.1" in str(err.value)  # the private cluster's actors are on loopback


def _divide_by_zero(trainer: object) -> float:
    return 1 / 0

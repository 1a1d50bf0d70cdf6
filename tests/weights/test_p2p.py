"""weights.transport=p2p: two FSDP2 trainer ranks write straight into engine processes (our HTTP
server), each engine receiving from the source the plan gives it and only what its layout
declares; every push checked equal; a write that fails mid-update fails the update and no engine
activates any of it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from miles_engine.engines.http.client import HttpEngine
from miles_engine.trainer.distributed import FSDPTrainer
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions
from miles_engine.weights.p2p import P2PExport, P2PTransport, TrainerSources, plan
from miles_engine.weights.protocol import WeightPushError
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.trainer.helpers import random_groups
from tests.weights.helpers import TINY_QWEN3, engine_process

pytestmark = pytest.mark.timeout(300)
torch.set_num_threads(1)
CFG = {"optimizer": {"lr": 1e-2}, "parallel": {"world_size": 2}}


def test_the_plan_is_one_to_one_then_spread_evenly() -> None:
    assert plan(2, 2) == [0, 1]
    assert plan(2, 3) == [0, 1, 0]
    assert plan(2, 5) == [0, 1, 0, 1, 0]
    assert plan(1, 2) == [0, 0]
    assert plan(3, 2) == [0, 1]  # a source with no target sends nothing
    with pytest.raises(ValueError):
        plan(0, 2)


class Partial:
    """An engine that declares only part of the model (as one holding half of a MoE's experts would)."""

    def __init__(self, inner: HttpEngine, keep: str) -> None:
        self.inner, self.keep = inner, keep

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def weight_metadata(self):
        return [m for m in self.inner.weight_metadata() if self.keep in m.name]


class FailsAt:
    """An engine client whose ``bucket``-th p2p write (once armed) is refused before it reaches the server."""

    def __init__(self, inner: HttpEngine) -> None:
        self.inner, self.bucket, self.seen = inner, None, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def arm(self, bucket: int | None) -> None:
        self.bucket, self.seen = bucket, 0

    async def update_weights_from_distributed(self, *args, **kwargs):
        self.seen += 1
        if self.seen == self.bucket:
            raise RuntimeError("the engine refused this bucket")
        return await self.inner.update_weights_from_distributed(*args, **kwargs)


@contextlib.asynccontextmanager
async def clients(procs):
    engines = [await HttpEngine(p.url, name=f"engine{i}").connect() for i, p in enumerate(procs)]
    try:
        yield engines
    finally:
        for e in engines:
            await e.aclose()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(engine_process(tmp_path_factory.mktemp(f"engine{i}"), start_s=75)) for i in range(3)]


@pytest.fixture(scope="module")
def trainer():
    with FSDPTrainer(dict(TINY_QWEN3), CFG, world_size=2) as t:
        yield t


def _step(trainer, seed: int) -> None:
    trainer.train_step(random_groups(2, 2, seed=seed))


def test_two_ranks_write_to_two_and_three_engines_checked_equal(servers, trainer) -> None:
    sources = TrainerSources(trainer)

    async def main():
        async with clients(servers) as engines:
            for count, version in ((2, 1), (3, 2)):
                targets = engines[:count]
                transport = create_transport("p2p", targets, sources=sources, bucket_bytes=16 << 10,
                                             backend="gloo", timeout_s=30, check=CheckOptions())
                _step(trainer, version)
                export = await P2PExport.stage(sources, version)
                stats = await transport.push(export, version)
                whole = sum(s[3] for s in export.specs)
                assert stats.tensors_checked > 0 and stats.driver_bytes == 0
                assert transport.target_bytes == {e.name: whole for e in targets}  # full layouts: everything
                sent = transport.source_bytes  # rank 0 writes to targets 0 (and 2), rank 1 to target 1
                assert len(sent) == 2 and sent[0] >= (2 if count == 3 else 1) * whole and sent[1] >= whole
                assert sent[0] > sent[1] if count == 3 else sent[0] == sent[1]
                want = digests(await export.fetch())
                for e in targets:
                    sums = await e.weight_checksums()
                    assert all(sums[n] == d for n, d in want.items()) and await e.fetch_weight_version() == version
                await transport.close()
            _step(trainer, 9)
            await P2PExport.stage(sources, 3)  # the next push staged: an engine restarted now wants version 2
            assert digests(await export.fetch()) == want
    run(main(), 240)


def test_a_partial_target_receives_only_its_part(servers, trainer) -> None:
    sources = TrainerSources(trainer)

    async def main():
        async with clients(servers[:2]) as (full, half):
            part = Partial(half, "layers.1.")
            transport = P2PTransport([full, part], sources=sources, bucket_bytes=16 << 10, backend="gloo",
                                     timeout_s=30)
            _step(trainer, 3)
            export = await P2PExport.stage(sources, 10)
            await transport.push(export, 10)
            mine = {s[0]: s[3] for s in export.specs if "layers.1." in s[0]}
            assert transport.target_bytes == {"engine0": sum(s[3] for s in export.specs), "engine1": sum(mine.values())}
            want = digests(await export.fetch())
            sums = await half.weight_checksums()
            assert all(sums[n] == want[n] for n in mine)
            assert not any(sums[n] == want[n] for n in want if n not in mine)  # the rest was never sent
            await transport.close()
    run(main(), 120)


def test_a_failed_write_fails_the_update_and_no_engine_activates_it(servers, trainer) -> None:
    sources = TrainerSources(trainer)

    async def main():
        async with clients(servers[:2]) as (good, bad):
            flaky = FailsAt(bad)
            transport = P2PTransport([good, flaky], sources=sources, bucket_bytes=16 << 10, backend="gloo",
                                     timeout_s=5)
            export = await P2PExport.stage(sources, 20)
            await transport.push(export, 20)
            before = [await e.weight_checksums() for e in (good, bad)]
            _step(trainer, 4)
            flaky.arm(2)  # the second bucket to engine1 never arrives
            with pytest.raises(WeightPushError) as err:
                await transport.push(await P2PExport.stage(sources, 21), 21)
            assert "engine1" in str(err.value) and "p2p write of 'model." in str(err.value), str(err.value)
            assert "no engine activated any of this push" in str(err.value)
            for e, sums in zip((good, bad), before):
                assert await e.fetch_weight_version() == 20
                assert await e.weight_checksums() == sums
            flaky.arm(None)
            again = await P2PExport.stage(sources, 22)  # the next push builds a new group and lands
            await transport.push(again, 22)
            assert await bad.fetch_weight_version() == 22 and transport.builds == 2
            want, sums = digests(await again.fetch()), await bad.weight_checksums()
            assert all(sums[n] == d for n, d in want.items())
            await transport.close()
    run(main(), 200)

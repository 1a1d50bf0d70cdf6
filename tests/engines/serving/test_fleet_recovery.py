"""A fleet of real engine server processes behind the router, across an engine SIGKILL:
in-flight requests complete on the restarted process, which serves the trainer's current
weights and version; broadcast rebuilds its group, disk_delta re-syncs the new process, and
check_update_equal names a corrupted tensor on one server engine. No process outlives a test."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_engine.engines.launch import server_command
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.router import Router
from miles_engine.engines.supervisor import SupervisedEngine
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions, WeightCheckError
from miles_engine.weights.tensors import digests
from tests.engines.serving.test_supervisor import group_gone, kill_members
from tests.rollout.helpers import run
from tests.weights.helpers import TINY_QWEN3, differing, trainer_model

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
CORRUPTED = "model.layers.0.mlp.up_proj.weight"


class Trainer:
    """The trainer's current weights and version, as a ``restore`` callback serves them."""

    def __init__(self, seed: int) -> None:
        self.model = trainer_model(seed=seed)
        self.version = 0
        self.restores = 0

    def step(self, seed: int) -> list[tuple[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        self.version += 1
        return list(self.model.named_parameters())

    async def restore(self) -> tuple[dict[str, torch.Tensor], int]:
        self.restores += 1
        return {n: t.detach().clone() for n, t in self.model.state_dict().items()}, self.version

    def digests(self) -> dict[str, str]:
        return digests(self.model.state_dict())


def engines(tmp: Path, n: int, restore: Any = None) -> list[SupervisedEngine]:
    (tmp / "config.json").write_text(json.dumps(TINY_QWEN3))
    cmd = server_command(str(tmp / "config.json"), threads=1, dtype="float32")
    return [SupervisedEngine(cmd, name=f"e{i}", env=ENV, cwd=REPO, restore=restore, start_timeout_s=90,
                             backoff_base_s=0.1, monitor_interval_s=0.1, state_dir=tmp / f"e{i}")
            for i in range(n)]


async def start(sups: list[SupervisedEngine]) -> list[int]:
    await asyncio.gather(*(s.start() for s in sups))
    return [s.process.pid for s in sups]


async def close_all(sups: list[SupervisedEngine], pgids: list[int]) -> None:
    await asyncio.gather(*(s.aclose() for s in sups))
    stray = [p for p in pgids if not group_gone(p)]
    for pgid in stray:
        kill_members(pgid)
    assert not stray, f"process groups {stray} outlived their supervisors"


async def kill_and_wait_restart(sup: SupervisedEngine, pgids: list[int]) -> None:
    os.killpg(sup.process.pid, signal.SIGKILL)
    for _ in range(900):  # bounded by count; the restart itself is bounded by start_timeout_s
        if sup.restarts and sup.client is not None:
            break
        await asyncio.sleep(0.1)
    assert sup.restarts == 1 and sup.generation == 2
    pgids.append(sup.process.pid)


class CorruptOne:
    """A transport that delivers, then leaves one tensor wrong on one engine (the bug to catch)."""

    def __init__(self, inner: Any, engine: SupervisedEngine) -> None:
        self.inner, self.engine, self.name = inner, engine, inner.name

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> Any:
        named = list(named)
        stats = await self.inner.push(named, version)
        bad = dict(named)[CORRUPTED].detach().clone()
        bad[0, 0] += 1.0
        await self.engine.update_weights({CORRUPTED: bad}, version=version)
        return stats

    async def close(self) -> None:
        await self.inner.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_in_flight_then_broadcast_rebuilds_and_check_names_a_corrupted_tensor(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(seed=1)

    async def main() -> None:
        sups = engines(tmp_path, 2, restore=trainer.restore)
        pgids = await start(sups)
        router = Router(sups, health_interval_s=0)
        transport = create_transport("broadcast", router, check=CheckOptions(), backend="gloo", timeout_s=60,
                                     bucket_bytes=64 << 10, group_name="fleet")
        try:
            stats = await transport.push(trainer.step(seed=1), version=1)
            assert stats.tensors_checked == 2 * len(trainer.digests()) and transport.inner.builds == 1

            # requests in flight on both engines; e0's process is SIGKILLed under them
            reqs = [GenerateRequest([1 + i, 2, 3], SamplingParams(max_new_tokens=200, seed=i), session_id=f"s{i}")
                    for i in range(4)]
            tasks = [asyncio.create_task(router.generate(r)) for r in reqs]
            await asyncio.sleep(0.3)
            running = [not t.done() for t in tasks]
            homes = [router.session_engine(r.session_id) for r in reqs]
            assert "e0" in homes and "e1" in homes
            await kill_and_wait_restart(sups[0], pgids)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 150)
            for res, home, was_running in zip(results, homes, running):
                assert res.finish_reason == "length" and len(res.output_ids) == 200 and res.info["engine"] == home
                assert set(res.weight_versions) == {1}  # the restarted process serves the trainer's version
                if home == "e0" and was_running:
                    assert res.info["retries"] >= 1
            assert trainer.restores == 1 and sups[1].restarts == 0
            # the restarted process holds the trainer's current tensors, at its version
            assert differing(await sups[0].weight_checksums(), trainer.digests()) == []
            assert await sups[0].fetch_weight_version() == 1

            metrics = router.metrics()
            assert metrics["engines/e0/restarts"] == 1 and metrics["engines/restarts"] == 1
            assert metrics["engines/e0/requests"] + metrics["engines/e1/requests"] == 4
            assert metrics["engines/healthy"] == 2 and metrics["engines/e0/quarantined"] == 0
            assert metrics["engines/tokens_per_s"] > 0 and metrics["engines/e1/inflight"] == 0

            # the next push rebuilds the group (e0 is a new process) and reaches both engines
            stats = await transport.push(trainer.step(seed=2), version=2)
            assert transport.inner.builds == 2 and stats.tensors_checked == 2 * len(trainer.digests())
            for sup in sups:
                assert differing(await sup.weight_checksums(), trainer.digests()) == []
                assert await sup.fetch_weight_version() == 2

            # a transport that leaves one tensor wrong on e1: the check names e1 and the tensor only
            transport.inner = CorruptOne(transport.inner, sups[1])
            with pytest.raises(WeightCheckError, match=rf"on e1 \(checksums\), 1 of \d+ tensors: '{CORRUPTED}' "
                                                       r"differs, max abs diff 1") as err:
                await transport.push(trainer.step(seed=3), version=3)
            assert "on e0" not in str(err.value)
        finally:
            await transport.close()
            await close_all(sups, pgids)
    run(main(), 230)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_disk_delta_resyncs_a_restarted_engine_without_restore(tmp_path: Path) -> None:
    """No restore callback: the supervisor re-sends its last disk_delta sync (resync) to the new
    process, which rebuilds its copy from the baseline and serves the current version again."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    trainer = Trainer(seed=3)
    baseline = tmp_path / "baseline.safetensors"
    save_file({n: t.detach().clone() for n, t in trainer.model.state_dict().items()}, str(baseline))

    async def main() -> None:
        sups = engines(tmp_path, 2)
        pgids = await start(sups)
        router = Router(sups, health_interval_s=0)
        transport = create_transport("disk_delta", router, check=CheckOptions(), root=str(tmp_path / "publish"),
                                     baseline=str(baseline))
        try:
            await transport.push(list(trainer.model.named_parameters()), version=0)
            for seed in (1, 2):
                await transport.push(trainer.step(seed=seed), version=trainer.version)
            await kill_and_wait_restart(sups[0], pgids)
            # before any push: the new process is back at the current version, with its tensors
            assert sups[0].weight_version == 2 and await sups[0].fetch_weight_version() == 2
            assert differing(await sups[0].weight_checksums(), trainer.digests()) == []
            res = await router.generate(GenerateRequest([4, 5], SamplingParams(max_new_tokens=4), session_id="x"))
            assert res.weight_versions == [2] * 4
            stats = await transport.push(trainer.step(seed=3), version=3)
            assert stats.tensors_checked == 2 * len(trainer.digests())
            for sup in sups:
                assert differing(await sup.weight_checksums(), trainer.digests()) == []
                assert await sup.fetch_weight_version() == 3
        finally:
            await transport.close()
            await close_all(sups, pgids)
    run(main(), 230)


@pytest.mark.timeout(90)
def test_external_engine_down_is_quarantined_and_readmitted_at_the_current_weights(tmp_path: Path) -> None:
    """An HttpEngine the router must never restart: its server is SIGKILLed (quarantined, work goes
    elsewhere, metrics say so), comes back empty on the same URL and is re-admitted after
    ``restore`` brought it to the fleet's version; with every engine down the run can stop with
    one clear error after the configured time."""
    from miles_engine.engines.http.client import HttpEngine
    from miles_engine.engines.launch import ServerProcess, free_port
    from miles_engine.engines.router import NoHealthyEngine
    from tests.engines.fakes import FakeEngine

    port = free_port()
    argv = server_command("fake:delay=0.002", engine_factory="tests.engines.fakes:make_fake_engine",
                          extra=["--port", str(port)])
    proc = ServerProcess(argv, port=port, env=ENV, cwd=REPO, log_path=tmp_path / "external.log", name="external")
    restored: list[int] = []

    async def restore() -> tuple[dict[str, torch.Tensor], int]:
        restored.append(5)
        return {"head.bias": torch.full((64,), 0.5)}, 5

    async def main() -> None:
        await proc.start(45)
        external = await HttpEngine(proc.url, name="ext", retries=1, backoff_s=0.05).connect()
        local = FakeEngine(name="local")
        router = Router([external, local], health_interval_s=0, fail_threshold=2, readmit_after=2, restore=restore)
        try:
            for e in (external, local):
                await e.update_weights({"head.bias": torch.zeros(64)}, version=5)
            for i in range(4):
                await router.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=3), session_id=f"s{i}"))
            assert {router.session_engine(f"s{i}") for i in range(4)} == {"ext", "local"}
            first = router.metrics()
            assert first["engines/ext/requests"] == 2 and first["engines/local/requests"] == 2
            assert first["engines/ext/tokens_per_s"] > 0 and first["engines/quarantined"] == 0

            os.killpg(proc.pid, signal.SIGKILL)
            await proc.stop(grace_s=1)
            await router.check_health()
            await router.check_health()
            m = router.metrics()
            assert m["engines/ext/quarantined"] == 1 and m["engines/healthy"] == 1 and m["engines/ext/requests"] == 0
            for i in range(4):  # the external engine's sessions move; nothing is placed on it
                res = await router.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=3),
                                                            session_id=f"s{i}"))
                assert res.info["engine"] == "local"
            assert router.no_healthy_since is None

            await proc.start(45)  # someone else brings it back, empty (version 0), on the same URL
            await router.check_health()
            assert router.metrics()["engines/ext/quarantined"] == 1  # one good check is not enough
            await router.check_health()
            assert router.metrics()["engines/ext/quarantined"] == 0 and restored == [5]
            assert await external.fetch_weight_version() == 5

            # every engine down: the run may stop, with one error naming each engine's last error
            local.healthy = False
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.stop(grace_s=1)
            for _ in range(2):
                await router.check_health()
            assert router.no_healthy_since is not None
            router.raise_if_unhealthy_for(3600)  # not for long enough yet
            with pytest.raises(NoHealthyEngine, match=r"no engine behind the router has been healthy.*ext: .*local"):
                router.raise_if_unhealthy_for(0)
        finally:
            await external.aclose()
            await proc.stop(grace_s=2)
    run(main(), 80)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

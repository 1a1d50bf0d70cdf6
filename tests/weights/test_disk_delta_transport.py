"""disk_delta transport into a real EmbeddedEngine: pushes land exactly with both encodings,
only changed tensors travel, and every safety rule refuses what it must."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from miles_engine.engines.embedded.engine import EmbeddedEngine
from miles_engine.weights import create_transport
from miles_engine.weights.disk_delta.errors import BaselineMismatchError, LineageError
from miles_engine.weights.disk_delta.layout import INDEX, read_index, scan, version_dir
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.weights.helpers import TINY_QWEN3, differing


def _engine() -> EmbeddedEngine:
    return EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=128)


def _trainer(engine: EmbeddedEngine) -> torch.nn.Module:
    return copy.deepcopy(engine.model)  # the trainer starts from the engines' baseline


def _step(model: torch.nn.Module, names: list[str], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].add_(0.01 * torch.randn(params[n].shape, generator=gen))


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_pushes_land_exactly_and_only_changes_travel(tmp_path: Path, encoding: str) -> None:
    engine = _engine()
    trainer = _trainer(engine)
    changed = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), encoding=encoding)
        await transport.preflight(trainer.named_parameters())
        first = await transport.push(trainer.named_parameters(), version=0)  # the baseline itself: nothing
        assert first.bytes == 0 and scan(tmp_path) == ([0], [])
        for version in (1, 2, 3):
            _step(trainer, changed if version < 3 else list(dict(trainer.named_parameters())), seed=version)
            stats = await transport.push(trainer.named_parameters(), version=version)
            assert engine.weight_version == version
            assert differing(digests(engine.model.state_dict()), digests(trainer.state_dict())) == []
            index = read_index(tmp_path, version)
            assert index.base_version == version - 1 and index.encoding == encoding
            assert index.checksum == "xxh3_128" and index.compression == "zstd"
            if version < 3:
                assert sorted(index.tensors) == sorted(changed)  # unchanged tensors skipped
                assert stats.tensors == 2
            m = stats.metrics()
            for key in ("weights/changed_density", "weights/bytes_pushed", "weights/publish_s", "weights/pull_s",
                        "weights/apply_s", "weights/pause_s"):
                assert key in m
            assert 0 < m["weights/changed_density"] <= 1 and m["weights/bytes_pushed"] > 0
            assert stats.pause_s < stats.push_s
        await transport.close()
        await engine.aclose()

    run(main(), 60)


def test_baseline_mismatch_fails_naming_each_tensor(tmp_path: Path) -> None:
    engine = _engine()
    named = dict(_trainer(engine).named_parameters())
    named["model.norm.weight"] = torch.zeros(7)
    named["model.layers.0.mlp.up_proj.weight"] = named["model.layers.0.mlp.up_proj.weight"].to(torch.int32)
    named["extra.bias"] = torch.zeros(3)

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path))
        with pytest.raises(BaselineMismatchError) as err:
            await transport.preflight(named.items())
        msg = str(err.value)
        assert msg.startswith("3 exported tensors do not match the baseline")
        for name in ("model.norm.weight", "model.layers.0.mlp.up_proj.weight", "extra.bias"):
            assert repr(name) in msg
        await engine.aclose()

    run(main(), 60)


def test_xor_applied_twice_or_on_the_wrong_base_is_refused(tmp_path: Path) -> None:
    from miles_engine.weights.disk_delta import chain

    engine = _engine()
    trainer = _trainer(engine)

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), encoding="xor")
        _step(trainer, ["model.norm.weight"], seed=1)
        await transport.push(trainer.named_parameters(), version=1)
        applier = next(iter(transport.appliers.values()))
        before = digests(engine.model.state_dict())
        v1 = chain.pull(tmp_path, read_index(tmp_path, 1))
        # twice: the held copy is already version 1
        with pytest.raises(LineageError, match="applied twice"):
            chain.patch_versions(applier.state, 1, [v1])
        # wrong base: a version-2 delta against base 1 offered to bytes that are version 0
        _step(trainer, ["model.norm.weight"], seed=2)
        await transport.push(trainer.named_parameters(), version=2)
        v2 = chain.pull(tmp_path, read_index(tmp_path, 2))
        with pytest.raises(LineageError, match="wrong base"):
            chain.patch_versions(applier.state, 0, [v2])
        # moving backwards is a rollback: refused, the engine keeps version 2
        after = digests(engine.model.state_dict())
        with pytest.raises(LineageError, match="roll back"):
            await applier.sync(1)
        assert engine.weight_version == 2 and digests(engine.model.state_dict()) == after != before
        await transport.close()
        await engine.aclose()

    run(main(), 60)


def test_engine_changed_behind_the_applier_is_refused(tmp_path: Path) -> None:
    engine = _engine()
    trainer = _trainer(engine)

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), encoding="xor")
        await transport.push(trainer.named_parameters(), version=0)
        # someone else loads version 1 into the engine: an xor on top would corrupt it
        _step(trainer, ["model.norm.weight"], seed=1)
        await engine.update_weights(dict(trainer.named_parameters()), version=1)
        _step(trainer, ["model.norm.weight"], seed=2)
        with pytest.raises(LineageError, match="reports weight version 1"):
            await transport.push(trainer.named_parameters(), version=2)
        await transport.close()
        await engine.aclose()

    run(main(), 60)


def test_torn_version_is_never_activated(tmp_path: Path) -> None:
    engine = _engine()
    trainer = _trainer(engine)

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path), pull_timeout_s=0.3)
        _step(trainer, ["model.norm.weight"], seed=1)
        await transport.push(trainer.named_parameters(), version=1)
        applier = next(iter(transport.appliers.values()))
        # a publish of version 2 that died after its shards, before its index
        _step(trainer, ["model.norm.weight"], seed=2)
        transport.publisher.publish(2, list(trainer.named_parameters()))
        (version_dir(tmp_path, 2) / INDEX).unlink()
        held = digests(engine.model.state_dict())
        with pytest.raises(Exception, match="weight version 2 is torn"):
            await applier.sync(2)
        assert engine.weight_version == 1 and digests(engine.model.state_dict()) == held
        assert scan(tmp_path) == ([0, 1], [2])
        await transport.close()
        await engine.aclose()

    run(main(), 60)


def test_versions_only_move_forward(tmp_path: Path) -> None:
    engine = _engine()
    trainer = _trainer(engine)

    async def main() -> None:
        transport = create_transport("disk_delta", engine, root=str(tmp_path))
        _step(trainer, ["model.norm.weight"], seed=1)
        await transport.push(trainer.named_parameters(), version=1)
        await transport.push(trainer.named_parameters(), version=1)  # same bytes, same version: a no-op
        _step(trainer, ["model.norm.weight"], seed=2)
        with pytest.raises(LineageError, match="already published"):
            await transport.push(trainer.named_parameters(), version=1)
        with pytest.raises(LineageError, match="only move forward"):
            transport.publisher.publish(0, list(trainer.named_parameters()))
        assert scan(tmp_path) == ([0, 1], [])  # nothing was deleted by the refusals
        await transport.close()
        await engine.aclose()

    run(main(), 60)


def test_a_fresh_engine_pulls_the_whole_chain_it_lacks(tmp_path: Path) -> None:
    first = _engine()
    trainer = _trainer(first)

    async def main() -> None:
        transport = create_transport("disk_delta", first, root=str(tmp_path), encoding="xor")
        for version in (1, 2):
            _step(trainer, ["model.norm.weight", "model.layers.1.self_attn.q_proj.weight"], seed=version)
            await transport.push(trainer.named_parameters(), version=version)
        await transport.close()
        await first.aclose()
        # a new trainer process and a new engine host on the same root: the trainer rebuilds version 2 from
        # the chain on disk, the engine starts from the baseline and patches 1, 2 and 3 before one load
        late = _engine()
        reopened = create_transport("disk_delta", late, root=str(tmp_path), encoding="xor")
        _step(trainer, ["model.norm.weight"], seed=3)
        stats = await reopened.push(trainer.named_parameters(), version=3)
        assert reopened.publisher.version == 3 and sorted(read_index(tmp_path, 3).tensors) == ["model.norm.weight"]
        assert late.weight_version == 3
        assert differing(digests(late.model.state_dict()), digests(trainer.state_dict())) == []
        assert stats.pause_s > 0
        await reopened.close()
        await late.aclose()

    run(main(), 60)


def test_a_resumed_run_rewinds_the_versions_published_after_its_checkpoint(tmp_path: Path) -> None:
    first = _engine()
    trainer = _trainer(first)

    async def main() -> None:
        transport = create_transport("disk_delta", first, root=str(tmp_path))
        for version in (1, 2, 3):
            _step(trainer, ["model.norm.weight"], seed=version)
            await transport.push(trainer.named_parameters(), version=version)
            if version == 1:
                at_checkpoint = copy.deepcopy(trainer)
        await transport.close()
        await first.aclose()
        # the run crashed after publishing 3; it resumes from its checkpoint at version 1 and trains differently
        late = _engine()
        resumed = create_transport("disk_delta", late, root=str(tmp_path))
        without = create_transport("disk_delta", _engine(), root=str(tmp_path))
        _step(at_checkpoint, ["model.norm.weight"], seed=99)
        with pytest.raises(LineageError, match="only move forward"):  # what happens without the rewind
            await without.push(at_checkpoint.named_parameters(), version=2)
        assert await resumed.rewind(1) == [2, 3]
        assert scan(tmp_path) == ([0, 1], [])
        await resumed.push(at_checkpoint.named_parameters(), version=2)
        assert late.weight_version == 2
        assert differing(digests(late.model.state_dict()), digests(at_checkpoint.state_dict())) == []
        assert await resumed.rewind(2) == []  # nothing newer: a no-op
        await resumed.close()
        await late.aclose()

    run(main(), 60)

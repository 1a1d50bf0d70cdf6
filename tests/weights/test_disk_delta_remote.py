"""disk_delta with the engine pulling for itself: our HTTP engine server in another process is
told "sync to version N" and patches its own copy from the shared publish root; refusals leave
it serving its old version; a restarted engine resumes from its persisted local copy after
garbage collection removed the start of the chain."""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.launch import ServerProcess
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.weights import create_transport
from miles_engine.weights.disk_delta import chain
from miles_engine.weights.disk_delta.errors import (
    ChecksumError,
    LineageError,
    TornVersionError,
)
from miles_engine.weights.disk_delta.layout import INDEX, scan, version_dir
from miles_engine.weights.disk_delta.remote import RemoteDeltaSync
from miles_engine.weights.disk_delta.retention import collect, lease_path
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.weights.helpers import TINY_QWEN3, differing, trainer_model

REPO = Path(__file__).resolve().parents[2]
NAME = "engine-a"


def _server(tmp: Path) -> ServerProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(TINY_QWEN3))
    (tmp / "port").unlink(missing_ok=True)
    argv = [sys.executable, "-m", "miles_engine.run.engine_server", "--model", str(tmp / "config.json"),
            "--port", "0", "--port-file", str(tmp / "port"), "--threads", "1", "--dtype", "float32"]
    return ServerProcess(argv, port_file=tmp / "port", cwd=REPO, name="engine", log_path=tmp / "server.log",
                         env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})


def _baseline(tmp: Path) -> tuple[torch.nn.Module, Path]:
    """The trainer's starting weights, saved as the canonical checkpoint (the engine process starts
    from other random weights: attaching loads the baseline)."""
    from safetensors.torch import save_file

    trainer = trainer_model(seed=3)
    path = tmp / "baseline.safetensors"
    save_file({n: t.detach().clone() for n, t in trainer.state_dict().items()}, str(path))
    return trainer, path


def _step(model: torch.nn.Module, names: list[str] | None, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names or list(params):
            params[n].add_(0.01 * torch.randn(params[n].shape, generator=gen))


async def _serving(engine: HttpEngine, version: int) -> None:
    """The engine reports ``version`` and still generates, every token under that version."""
    assert await engine.fetch_weight_version() == version
    res = await engine.generate(GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=3)))
    assert res.weight_versions == [version] * len(res.output_ids)


class _Edited:
    """Edit a version's index in place for one refused sync, then put the original back."""

    def __init__(self, root: Path, version: int) -> None:
        self.path = version_dir(root, version) / INDEX
        self.original = self.path.read_bytes()

    def set(self, **changes: object) -> None:
        index = json.loads(self.original)
        for key, value in changes.items():
            if key == "checksum_of":
                index["tensors"][value]["checksum"] = "0" * 32
            else:
                index[key] = value
        self.path.write_text(json.dumps(index))

    def restore(self) -> None:
        self.path.write_bytes(self.original)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_engine_server_pulls_versions_and_refuses_bad_ones(tmp_path: Path, encoding: str) -> None:
    trainer, baseline = _baseline(tmp_path)
    root = tmp_path / "publish"
    server = _server(tmp_path / "engine")
    changed = ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]

    async def main() -> None:
        await server.start(90)
        engine = await HttpEngine(server.url, name=NAME).connect()
        try:
            transport = create_transport("disk_delta", engine, root=str(root), baseline=str(baseline),
                                         encoding=encoding, pull_timeout_s=1.0)
            await transport.preflight(trainer.named_parameters())
            await transport.push(trainer.named_parameters(), version=0)  # the engine attaches: baseline loaded
            assert isinstance(next(iter(transport.appliers.values())), RemoteDeltaSync)
            assert differing(await engine.weight_checksums(), digests(trainer.state_dict())) == []
            for version in (1, 2, 3):
                _step(trainer, changed if version < 3 else None, seed=version)
                stats = await transport.push(trainer.named_parameters(), version=version)
                assert differing(await engine.weight_checksums(), digests(trainer.state_dict())) == []
                assert stats.pause_s > 0 and stats.pull_s > 0 and stats.bytes > 0 and stats.pause_s < stats.push_s
                lease = json.loads(lease_path(root, NAME).read_text())  # written by the engine's process
                assert lease["engine"] == NAME and lease["version"] == version
            await _serving(engine, 3)
            sync = transport.appliers[id(engine)]
            held = await engine.weight_checksums()

            async def refused(error: type, match: str, version: int) -> None:
                with pytest.raises(error, match=match) as err:
                    await sync.sync(version)
                assert f"engine {server.url} refused disk_delta sync to version {version}" in str(err.value)
                assert "keeps serving weight version 3" in str(err.value)
                await _serving(engine, 3)
                assert await engine.weight_checksums() == held

            _step(trainer, changed, seed=4)
            transport.publisher.publish(4, list(trainer.named_parameters()))
            # torn: the index is not there (yet)
            index4 = version_dir(root, 4) / INDEX
            index4.rename(index4.with_name("index.hidden"))
            await refused(TornVersionError, "weight version 4 is torn", 4)
            index4.with_name("index.hidden").rename(index4)
            # a patched tensor that does not hash to its recorded checksum
            edited = _Edited(root, 4)
            edited.set(checksum_of="model.norm.weight")
            await refused(ChecksumError, "'model.norm.weight' patched to xxh3_128", 4)
            # a delta on another base than the one held (an xor on it would corrupt the weights)
            edited.set(base_version=2)
            await refused(LineageError, "delta on version 2, but version 3 is held", 4)
            edited.restore()
            await refused(LineageError, "roll back", 2)
            # after the refusals the intact version goes through
            answer = await sync.sync(4)
            assert answer.versions == 1 and answer.pause_s > 0 and answer.wire_bytes > 0
            assert differing(await engine.weight_checksums(), digests(trainer.state_dict())) == []
            await _serving(engine, 4)
            # a malformed request is refused as such (400), not as a weight problem
            resp = await engine._call("POST", "/update_weights_from_disk_delta", json={"version": -1, "bogus": 1})
            msg = resp.json()["message"]
            assert resp.status_code == 400 and "publish_root" in msg and "version" in msg and "bogus" in msg
            await transport.close()
        finally:
            await engine.aclose()
            await server.stop(grace_s=10)

    run(main(), 160)


@pytest.mark.timeout(200)
def test_restarted_engine_resumes_from_its_local_copy_after_gc(tmp_path: Path) -> None:
    trainer, baseline = _baseline(tmp_path)
    root, local = tmp_path / "publish", tmp_path / "engine-host"
    names = ["model.norm.weight", "model.layers.1.self_attn.q_proj.weight"]

    async def main() -> None:
        first = _server(tmp_path / "engine")
        await first.start(90)
        engine = await HttpEngine(first.url, name=NAME).connect()
        transport = create_transport("disk_delta", engine, root=str(root), baseline=str(baseline), encoding="xor",
                                     retain=1, engine_local_dir=str(local / "{engine}"))
        try:
            for version in (0, 1, 2):
                if version:
                    _step(trainer, names, seed=version)
                stats = await transport.push(trainer.named_parameters(), version=version)
            assert stats.persist_s > 0 and json.loads((local / NAME / "copy.json").read_text())["version"] == 2
            assert scan(root) == ([0, 2], [])  # retain=1: version 1 is gone
        finally:
            await engine.aclose()
            await first.stop(grace_s=10)
        # the engine is down; the trainer goes on publishing, garbage collection goes on
        for version in (3, 4):
            _step(trainer, names[:1], seed=version)
            transport.publisher.publish(version, list(trainer.named_parameters()))
            collect(root, retain=1, ttl_s=600)
        assert scan(root) == ([0, 3, 4], [])  # the engine's lease (its copy: 2) kept 3 and 4
        with pytest.raises(TornVersionError, match="weight version 2 does not exist"):
            chain.resolve(root, 0, 4)  # a cold engine without its copy could not catch up from the baseline

        second = _server(tmp_path / "engine")  # same host, same name, a fresh process
        await second.start(90)
        engine = await HttpEngine(second.url, name=NAME).connect()
        assert engine.weight_version == 0
        transport.targets = engine
        try:
            _step(trainer, names[:1], seed=5)
            stats = await transport.push(trainer.named_parameters(), version=5)
            assert differing(await engine.weight_checksums(), digests(trainer.state_dict())) == []
            sync = transport.appliers[id(engine)]
            assert sync.snapshot_version == 5 and stats.pause_s > 0
            await _serving(engine, 5)
            assert sync.attached_from == {"source": "local_copy", "version": 2}
            await transport.close()
        finally:
            await engine.aclose()
            await second.stop(grace_s=10)

    run(main(), 190)


def test_local_copy_of_another_lineage_is_not_used_and_a_dir_has_one_owner(tmp_path: Path) -> None:
    import numpy as np

    from miles_engine.weights.disk_delta import codec
    from miles_engine.weights.disk_delta.baseline import load, materialise
    from miles_engine.weights.disk_delta.errors import DiskDeltaError
    from miles_engine.weights.disk_delta.local_copy import LocalCopyStore

    model = trainer_model(seed=5)
    tensors = {n: t.detach().clone() for n, t in model.state_dict().items()}
    index_a = materialise(tmp_path / "a", "xxh3_128", tensors=tensors)
    state = load(tmp_path / "a", index_a)
    store = LocalCopyStore(tmp_path / "local")
    with pytest.raises(DiskDeltaError, match="in use by another engine process"):
        LocalCopyStore(tmp_path / "local")
    store.save(tmp_path / "a", index_a, 0, state)
    restored = store.load(tmp_path / "a", index_a)
    assert restored is not None and restored.version == 0
    assert all(np.array_equal(restored.state[n], state[n]) for n in state)
    # another baseline: the copy belongs to another run
    other = copy.deepcopy(tensors)
    other["model.norm.weight"] += 1
    index_b = materialise(tmp_path / "b", "xxh3_128", tensors=other)
    assert store.load(tmp_path / "b", index_b) is None and "another baseline" in store.rejected
    # a corrupted file: a checksum fails, the copy is not used
    (tmp_path / "c").mkdir()
    shutil.copytree(tmp_path / "a" / "weight_v000000", tmp_path / "c" / "weight_v000000")
    data = state["model.norm.weight"].copy()
    data[0] ^= 1
    bad = {**state, "model.norm.weight": data}
    store.save(tmp_path / "a", index_a, 0, bad)
    meta = json.loads((tmp_path / "local" / "copy.json").read_text())
    meta["checksums"]["model.norm.weight"] = codec.checksum("xxh3_128", state["model.norm.weight"])
    (tmp_path / "local" / "copy.json").write_text(json.dumps(meta))
    assert store.load(tmp_path / "c", index_a) is None and "'model.norm.weight' patched to" in store.rejected
    store.close()
    LocalCopyStore(tmp_path / "local").close()  # released: the next engine process may take it


def test_apply_on_engine_needs_our_engine_server(tmp_path: Path) -> None:
    import httpx

    from miles_engine.errors import ConfigError
    from miles_engine.weights.disk_delta.errors import DiskDeltaError
    from miles_engine.weights.disk_delta.options import DiskDeltaOptions
    from miles_engine.weights.disk_delta.remote import RemoteDeltaSync, pulls_itself

    sglang = HttpEngine("http://127.0.0.1:9", name="sglang-0",
                        transport=httpx.MockTransport(lambda _: httpx.Response(404, json={"detail": "Not Found"})))
    with pytest.raises(DiskDeltaError, match=r"engine http://127.0.0.1:9 has no /update_weights_from_disk_delta.*"
                                             r"apply_on=trainer"):
        run(RemoteDeltaSync(sglang, tmp_path, DiskDeltaOptions(), name="sglang-0").sync(1), 10)
    run(sglang.aclose(), 10)
    auto, forced = DiskDeltaOptions(), DiskDeltaOptions(apply_on="engine")
    assert pulls_itself(sglang, auto, "sglang-0") is False  # a real SGLang server: the trainer applies
    sglang.is_miles_server = True
    assert pulls_itself(sglang, auto, "e") and pulls_itself(sglang, forced, "e")
    assert not pulls_itself(sglang, DiskDeltaOptions(apply_on="trainer"), "e")
    with pytest.raises(ConfigError, match="apply_on=engine, but local-0 .*not an HTTP engine"):
        pulls_itself(object(), forced, "local-0")

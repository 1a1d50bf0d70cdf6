"""disk_delta publishing from several sources, and retention: a replicated tensor that
differs between sources fails the publish before any index exists; garbage collection
never deletes what a live engine still needs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from miles_engine.weights.disk_delta import chain, codec
from miles_engine.weights.disk_delta.errors import ReplicaConflictError
from miles_engine.weights.disk_delta.layout import scan, version_dir
from miles_engine.weights.disk_delta.options import DiskDeltaOptions
from miles_engine.weights.disk_delta.publisher import DeltaPublisher, SourceWriter, commit
from miles_engine.weights.disk_delta.retention import collect, live_holds, write_lease


def _baseline(root: Path) -> dict[str, torch.Tensor]:
    from miles_engine.weights.disk_delta import baseline

    gen = torch.Generator().manual_seed(0)
    tensors = {"norm": torch.ones(64), "a": torch.randn(32, 16, generator=gen), "b": torch.randn(16, generator=gen)}
    baseline.materialise(root, "xxh3_128", tensors=tensors)
    return tensors


def _writers(root: Path, opts: DiskDeltaOptions) -> list[SourceWriter]:
    from miles_engine.weights.disk_delta import baseline
    from miles_engine.weights.disk_delta.layout import read_index

    state = baseline.load(root, read_index(root, 0))
    # rank 0 owns "a", rank 1 owns "b"; both hold a replica of "norm"
    return [SourceWriter(root, "rank0", {k: state[k].copy() for k in ("a", "norm")}, 0, opts),
            SourceWriter(root, "rank1", {k: state[k].copy() for k in ("b", "norm")}, 0, opts)]


def test_sources_agreeing_on_a_replica_publish_one_version(tmp_path: Path) -> None:
    opts = DiskDeltaOptions(root=str(tmp_path))
    t = _baseline(tmp_path)
    r0, r1 = _writers(tmp_path, opts)
    norm = t["norm"] * 1.5
    r0.write_part(1, [("a", t["a"] + 1), ("norm", norm)])
    r1.write_part(1, [("b", t["b"]), ("norm", norm.clone())])
    index = commit(tmp_path, 1, ["rank0", "rank1"], opts)
    assert sorted(index.tensors) == ["a", "norm"] and index.total_tensors == 3
    for w in (r0, r1):
        w.advance(1)
    state = {k: codec.canonical(v) for k, v in t.items()}
    chain.replay(tmp_path, state, 0, 1)
    assert np.array_equal(state["norm"], codec.canonical(norm))


def test_replicated_tensor_differing_between_sources_fails_before_any_index(tmp_path: Path) -> None:
    opts = DiskDeltaOptions(root=str(tmp_path))
    t = _baseline(tmp_path)
    r0, r1 = _writers(tmp_path, opts)
    r0.write_part(1, [("a", t["a"]), ("norm", t["norm"] * 1.5)])
    r1.write_part(1, [("b", t["b"]), ("norm", t["norm"])])  # rank 1's replica did not change
    with pytest.raises(ReplicaConflictError, match=r"'norm' \(rank0: [0-9a-f]{32}, rank1: [0-9a-f]{32}\)"):
        commit(tmp_path, 1, ["rank0", "rank1"], opts)
    assert scan(tmp_path) == ([0], []) and not version_dir(tmp_path, 1).exists()
    with pytest.raises(Exception, match="never committed"):
        r0.advance(1)  # a source cannot move past a failed publish


def _publish_chain(root: Path, n: int, opts: DiskDeltaOptions) -> DeltaPublisher:
    from miles_engine.weights.disk_delta import baseline
    from miles_engine.weights.disk_delta.layout import read_index

    t = _baseline(root)
    pub = DeltaPublisher(root, opts, baseline.load(root, read_index(root, 0)), 0)
    for v in range(1, n + 1):
        pub.publish(v, [("norm", t["norm"] + v), ("a", t["a"]), ("b", t["b"])])
    return pub


def test_retention_keeps_the_baseline_the_newest_and_what_live_engines_need(tmp_path: Path) -> None:
    opts = DiskDeltaOptions(root=str(tmp_path), retain=2)
    _publish_chain(tmp_path, 6, opts)
    write_lease(tmp_path, "slow-engine", 2)  # live, needs 3..6 to catch up
    write_lease(tmp_path, "dead-engine", 0)
    dead = tmp_path / "leases" / "dead-engine.json"
    dead.write_text(dead.read_text().replace('"updated": ', '"updated": 1.0, "was": '))
    assert live_holds(tmp_path, opts.lease_ttl_s) == {"slow-engine": 2}
    assert collect(tmp_path, opts.retain, opts.lease_ttl_s) == [1, 2]
    assert scan(tmp_path)[0] == [0, 3, 4, 5, 6]
    # the slow engine can still catch up from what it holds
    assert [i.version for i in chain.resolve(tmp_path, 2, 6)] == [3, 4, 5, 6]
    write_lease(tmp_path, "slow-engine", 6)
    assert collect(tmp_path, opts.retain, opts.lease_ttl_s) == [3, 4]
    assert scan(tmp_path)[0] == [0, 5, 6]


def test_retention_removes_torn_debris_below_the_newest_version(tmp_path: Path) -> None:
    opts = DiskDeltaOptions(root=str(tmp_path))
    _publish_chain(tmp_path, 2, opts)
    version_dir(tmp_path, 1).joinpath("index.json").unlink()  # as if a publish of 1 had died
    version_dir(tmp_path, 9).mkdir()  # a publish in progress above the newest: untouched
    assert collect(tmp_path, None, opts.lease_ttl_s) == [1]
    assert scan(tmp_path) == ([0, 2], [9])

"""Rank 0's side of the weight-sync group as trainer rank 0's actor runs it (here in-process, a
gloo peer on loopback as rank 1): its export is kept by version, cut into buckets and broadcast;
digests and fetches come from the kept copy; an abort frees a wait stuck on a peer at once."""

from __future__ import annotations

import io
import threading

import pytest
import torch

from miles_engine.weights import WeightPushError, dist, tensors
from miles_engine.weights.rank0 import ExportStash, Rank0WeightSync
from miles_engine.weights.tensors import digest


def test_the_stash_keeps_the_pushed_export_and_the_staged_one_only() -> None:
    stash = ExportStash()
    live = {"w": torch.zeros(2)}
    stash.stage(1, live)
    live["w"].add_(1)  # the trainer's next step: the stash holds its own copy
    assert torch.equal(stash.get(1)["w"], torch.zeros(2))
    stash.stage(2, live, keep=1)
    assert sorted(stash._exports) == [1, 2]
    stash.stage(3, live, keep=2)
    with pytest.raises(WeightPushError, match=r"no export of weight version 1 \(it holds \[2, 3\]\)"):
        stash.get(1)


def test_rank0_broadcasts_its_export_bucket_by_bucket_and_an_abort_frees_a_stuck_wait() -> None:
    stash = ExportStash()
    export = {"a": torch.randn(3, 4), "b": torch.arange(10, dtype=torch.int32), "c": torch.randn(10)}
    specs = stash.stage(7, export)
    assert specs == [("a", "float32", (3, 4), 48), ("b", "int32", (10,), 40), ("c", "float32", (10,), 40)]
    sync = Rank0WeightSync(stash, "127.0.0.1")
    host, port, backend = sync.open(2, "t", "gloo", 30.0)
    assert (host, backend) == ("127.0.0.1", "gloo")
    peer = dist.new_group("gloo", master_address=host, master_port=port, rank=1, world_size=2, group_name="t",
                          timeout_s=30.0)
    sync.wait_open(30.0)
    plan = sync.plan(7, [], bucket_bytes=100)
    assert [[s[0] for s in b] for b in plan] == [["a", "b"], ["c"]]

    got = {}
    for i, bucket in enumerate(plan):
        dtypes, shapes = [getattr(torch, s[1]) for s in bucket], [s[2] for s in bucket]
        buf = torch.empty(tensors.layout(dtypes, shapes)[1], dtype=torch.uint8)
        sent = threading.Thread(target=sync.broadcast, args=(i, True, 30.0))
        sent.start()
        dist.broadcast(peer, buf)
        sent.join(30)
        got.update(zip([s[0] for s in bucket], tensors.unpack(buf, dtypes, shapes)))
    assert all(torch.equal(got[n], export[n]) for n in export)
    assert sync.digests(7, {"a": "bfloat16"}) == {"a": digest(export["a"].to(torch.bfloat16)),
                                                   "b": digest(export["b"]), "c": digest(export["c"])}
    assert torch.equal(torch.load(io.BytesIO(sync.fetch(7, ["c"])))["c"], export["c"])

    sync.open(2, "never-joined", "gloo", 600.0)  # the old group is dropped; nobody joins this one
    errors: list[str] = []

    def wait() -> None:
        try:
            sync.wait_open(600.0)
        except WeightPushError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    sync.abort()
    waiter.join(30)  # a safety stop far below the 600 s it would wait
    assert errors == ["joining the weight-sync group on trainer rank 0 was aborted"]
    with pytest.raises(WeightPushError, match="no weight-sync group"):
        sync.broadcast(0, True, 1.0)

"""Broadcast pushes to a real engine process (our HTTP server in a subprocess) over a gloo
group on loopback, verified tensor by tensor; engine-side refusals; missed pushes."""

from __future__ import annotations

import time

import pytest
import torch

from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.weights import WeightPushError, create_transport, verify_versions
from miles_engine.weights.sender import Bucket
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.weights.helpers import TINY_QWEN3, differing, engine_process, trainer_model



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_process(tmp_path_factory.mktemp("engine"), start_s=75) as proc:
        yield proc


@pytest.mark.timeout(120)
def test_broadcast_push_verified_tensor_by_tensor(server):
    trainer = trainer_model(seed=1)

    async def main():
        engine = await HttpEngine(server.url, name="engine-proc").connect()
        transport = create_transport("broadcast", engine, bucket_bytes=16 << 10, backend="gloo", timeout_s=30,
                                     group_name="test-push")
        wanted = digests(trainer.state_dict())
        assert differing(await engine.weight_checksums(), wanted) == sorted(wanted)

        # 1. flat buckets (our server): staged, applied at once on the last bucket
        stats = await transport.push(trainer.named_parameters(), version=1)
        assert transport.flatten is True and stats.buckets > 3 and stats.tensors == len(wanted)
        assert stats.bytes == sum(p.numel() * 4 for p in trainer.parameters()) and stats.missing == 0
        assert differing(await engine.weight_checksums(), wanted) == []
        assert await engine.fetch_weight_version() == 1
        res = await engine.generate(GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4)))
        assert res.weight_versions == [1] * len(res.output_ids)

        # 2. SGLang's layout (one broadcast per tensor), new weights
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(0.5)
        transport.flatten = False
        await transport.push(trainer.named_parameters(), version=2)
        wanted = digests(trainer.state_dict())
        assert differing(await engine.weight_checksums(), wanted) == [] and engine.weight_version == 2

        # 3. a missed push is detected from what the server says, not from the client's cache
        engine._version = 3  # the client believes it is at 3
        with pytest.raises(WeightPushError, match="engine-proc reports 2.*missed the push"):
            await verify_versions([engine], 3)

        # 4. bad input: refused before sending (trainer side) or after draining (engine side)
        bad = {**dict(trainer.named_parameters()), "model.norm.weight": torch.zeros(7)}  # late in the stream
        with pytest.raises(WeightPushError, match="shape.*mix of old and new weights under their old version"):
            await transport.push(bad.items(), version=3)  # SGLang layout: earlier buckets were loaded
        assert await engine.fetch_weight_version() == 2
        transport.flatten = True  # our layout stages buckets: a failed push changes nothing
        with pytest.raises(WeightPushError, match="unknown tensor 'model.nrom.weight'"):
            bucket = Bucket(["model.nrom.weight"], ["float32"], [[32]], 128, [torch.zeros(32)])
            await transport._send([engine], bucket, 3, last=True)
        before = await engine.weight_checksums()
        with pytest.raises(WeightPushError, match="shape") as err:
            await transport.push({n: p * 3 for n, p in bad.items()}.items(), version=3)
        assert "mix" not in str(err.value) and await engine.weight_checksums() == before
        assert differing(before, wanted) == [] and await engine.fetch_weight_version() == 2
        info = await engine._call("GET", "/get_server_info")
        assert info.json()["internal_states"][0]["paused"] is False  # resumed after the refusals

        # 5. the group survived the refusals; what the failed push staged is never mixed into the next
        norm = trainer.model.norm.weight.detach() * 2
        stats = await transport.push([("model.norm.weight", norm)], version=3)
        assert stats.missing == len(wanted) - 1 and await engine.fetch_weight_version() == 3
        assert differing(await engine.weight_checksums(), wanted) == ["model.norm.weight"]
        assert (await engine.weight_checksums(["model.norm.weight"])) == digests({"model.norm.weight": norm})
        await transport.close()
        resp = await engine._call("POST", "/update_weights_from_distributed", json={
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "test-push"})
        assert resp.status_code == 400 and "init_weights_update_group first" in resp.json()["message"]
        await engine.aclose()
    run(main(), 110)


@pytest.mark.timeout(60)
def test_broadcast_needs_http_engines_and_a_known_backend(server):
    from miles_engine.engines.embedded.engine import EmbeddedEngine

    async def main():
        local = EmbeddedEngine.from_model(dict(TINY_QWEN3), num_threads=1, max_context=64)
        with pytest.raises(WeightPushError, match="needs HTTP engines"):
            await create_transport("broadcast", local, backend="gloo").push(iter([]), version=1)
        await local.aclose()
        engine = await HttpEngine(server.url).connect()
        with pytest.raises(ValueError, match="unknown process-group backend 'mpi'"):
            await create_transport("broadcast", engine, backend="mpi").push(iter([]), version=1)
        resp = await engine._call("POST", "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"})
        assert resp.status_code == 400 and "nccl" in resp.json()["message"]
        # an engine refusing to join fails the push at once (not after the group timeout)
        first = create_transport("broadcast", engine, backend="gloo", timeout_s=20, group_name="dup")
        await first.push([("model.norm.weight", torch.ones(32))], version=1)
        second = create_transport("broadcast", engine, backend="gloo", timeout_s=20, group_name="dup")
        t0 = time.monotonic()
        with pytest.raises(WeightPushError, match="already exists.*unusable, the next push rebuilds it"):
            await second.push([("model.norm.weight", torch.ones(32))], version=2)
        assert time.monotonic() - t0 < 5
        # the next push rebuilds under a new group name (the first transport's group is left alone)
        await second.push([("model.norm.weight", torch.ones(32))], version=2)
        assert second.builds == 2 and await engine.fetch_weight_version() == 2
        await second.close()
        await first.push([("model.norm.weight", torch.ones(32))], version=3)
        await first.close()
        await engine.aclose()
    t0 = time.monotonic()
    run(main(), 50)
    assert time.monotonic() - t0 < 15  # the stuck rendezvous thread does not hold up the loop's shutdown

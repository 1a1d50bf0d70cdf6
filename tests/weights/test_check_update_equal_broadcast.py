"""check-weight-update-equal over the broadcast transport into an engine in another process (our
HTTP server): engine-side checksums, tensors fetched through /get_weights_by_name only when they
differ; a transport that skips a tensor is caught and named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from miles_engine.engines.http.client import HttpEngine
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions
from miles_engine.weights.check.readback import RemoteReader, WeightCheckError, reader_for
from miles_engine.weights.check import transport as check_transport
from miles_engine.weights.check.transport import CheckedTransport
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.weights.check_helpers import SkipOne
from tests.weights.helpers import TINY_QWEN3, differing, engine_process, trainer_model

SKIPPED = "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with engine_process(tmp_path_factory.mktemp("engine"), start_s=75) as proc:
        yield proc


def _broadcast(engine: HttpEngine, group: str) -> object:
    return create_transport("broadcast", engine, bucket_bytes=16 << 10, backend="gloo", timeout_s=30,
                            group_name=group)


@pytest.mark.timeout(150)
def test_checked_broadcast_passes_then_a_skipped_tensor_is_named(server):
    trainer = trainer_model(seed=11)

    async def main():
        engine = await HttpEngine(server.url, name="engine-proc").connect()
        try:
            reader = reader_for(engine, 0)
            assert isinstance(reader, RemoteReader) and reader.kind == "checksums"
            transport = CheckedTransport(_broadcast(engine, "check-ok"), engine, CheckOptions())
            stats = await transport.push(trainer.named_parameters(), version=1)
            n = len(dict(trainer.named_parameters()))
            assert stats.tensors_checked == n and stats.check_s > 0 and stats.metrics()["weights/tensors_checked"] == n
            assert differing(await engine.weight_checksums(), digests(trainer.state_dict())) == []
            await transport.close()

            # a fresh run against the same server: the fill comes first, then the broken push
            broken = CheckedTransport(SkipOne(_broadcast(engine, "check-skip"), SKIPPED), engine, CheckOptions())
            with pytest.raises(WeightCheckError) as err:
                await broken.push(trainer.named_parameters(), version=2)
            msg = str(err.value)
            assert f"on engine-proc (checksums), 1 of {n} tensors: {SKIPPED!r} was never written" in msg
            assert "broadcast push of weight version 2" in msg
            # the engine holds the trainer's weights except exactly that tensor, which holds noise
            assert differing(await engine.weight_checksums(), digests(trainer.state_dict())) == [SKIPPED]
            assert await engine.fetch_weight_version() == 2
            await broken.close()
        finally:
            await engine.aclose()
    run(main(), 140)


@pytest.mark.timeout(90)
def test_get_weights_by_name_matches_sglang_and_reads_exactly(server, monkeypatch):
    async def main():
        engine = await HttpEngine(server.url, name="engine-proc").connect()
        try:
            meta = {m.name: m for m in engine.weight_metadata()}
            # SGLang's default: the first 100 rows, float32 nested lists
            rows = await engine.get_weights_by_name("model.embed_tokens.weight")
            assert len(rows) == 100 and len(rows[0]) == TINY_QWEN3["hidden_size"]
            assert len(await engine.get_weights_by_name("model.norm.weight", truncate_size=5)) == 5
            with pytest.raises(ValueError, match="no tensor 'model.nrom.weight'.*did you mean 'model.norm.weight'"):
                await engine.get_weights_by_name("model.nrom.weight")
            with pytest.raises(ValueError, match="truncate_size must be a positive integer"):
                await engine.get_weights_by_name("model.norm.weight", truncate_size=0)
            # the path used against servers without checksums: every tensor, read back exactly
            reader = RemoteReader(engine, "engine-proc", checksums=False)
            got = await reader.tensors(list(meta), meta)
            assert await reader.digests(list(meta)) is None
            assert digests(got) == await engine.weight_checksums()
            assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in got.values())
            # the whole check over that path (as against a server without /miles/weight_checksums)
            monkeypatch.setattr(check_transport, "reader_for",
                                lambda e, i: RemoteReader(e, "engine-proc", checksums=False))
            check = CheckedTransport(SimpleNamespace(name="none"), engine)
            named = {n: t.clone() for n, t in got.items()}
            assert await check.check(named, 9) == len(named)
            named["model.norm.weight"] = named["model.norm.weight"] + 0.25
            named["model.extra.weight"] = torch.zeros(2)
            with pytest.raises(WeightCheckError) as err:
                await check.check(named, 9)
            assert (f"on engine-proc (get_weights_by_name), 2 of {len(named)} tensors: 'model.extra.weight' is "
                    f"missing on the engine; 'model.norm.weight' differs, max abs diff 0.25") in str(err.value)
        finally:
            await engine.aclose()
    run(main(), 80)

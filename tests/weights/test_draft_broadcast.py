"""A co-trained speculative draft pushed by the broadcast transport into an engine in another process
(our HTTP server, ``speculative.train``): the draft's ``draft.*`` tensors are served names, travel in
the same push as the policy's, are read back equal by engine-side checksums, and one the transport
skipped is named."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from miles_engine.engines.embedded.options import SpeculativeOptions
from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.launch import ServerProcess
from miles_engine.trainer.draft import DraftTrainer
from miles_engine.weights import create_transport
from miles_engine.weights.check import CheckOptions
from miles_engine.weights.check.readback import WeightCheckError
from miles_engine.weights.check.transport import CheckedTransport
from miles_engine.weights.tensors import digests
from tests.rollout.helpers import run
from tests.weights.check_helpers import SkipOne
from tests.weights.helpers import TINY_QWEN3, differing, trainer_model

REPO = Path(__file__).resolve().parents[2]
SPEC = dict(method="draft", num_tokens=2, draft_model="tiny:qwen3,hidden_size=16,num_hidden_layers=1,"
            "intermediate_size=32,num_attention_heads=2,num_key_value_heads=1,head_dim=8", train=True)
SKIPPED = "draft.model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    (tmp / "config.json").write_text(json.dumps(TINY_QWEN3))
    argv = [sys.executable, "-m", "miles_engine.run.engine_server", "--model", str(tmp / "config.json"),
            "--port", "0", "--port-file", str(tmp / "port"), "--threads", "1", "--dtype", "float32",
            "--engine-options", json.dumps({"speculative": SPEC})]
    proc = ServerProcess(argv, port_file=tmp / "port", cwd=REPO, name="engine",
                         env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    run(proc.start(75), 90)
    yield proc
    run(proc.stop(grace_s=10), 30)


def _broadcast(engine: HttpEngine, group: str) -> object:
    return create_transport("broadcast", engine, bucket_bytes=16 << 10, backend="gloo", timeout_s=30,
                            group_name=group)


@pytest.mark.timeout(150)
def test_the_draft_travels_with_the_policy_and_is_checked(server):
    policy = trainer_model(seed=11)
    draft = DraftTrainer(SpeculativeOptions(**SPEC), seed=3, vocab_size=TINY_QWEN3["vocab_size"])
    push = {**dict(policy.named_parameters()), **draft.named_tensors()}
    want = {**digests(policy.state_dict()), **digests(draft.named_tensors())}

    async def main():
        engine = await HttpEngine(server.url, name="engine-proc").connect()
        try:
            assert set(draft.named_tensors()) <= {m.name for m in engine.weight_metadata()}
            transport = CheckedTransport(_broadcast(engine, "draft-ok"), engine, CheckOptions())
            stats = await transport.push(push.items(), version=1)
            assert stats.tensors_checked == len(push)
            assert differing(await engine.weight_checksums(list(want)), want) == []
            await transport.close()

            broken = CheckedTransport(SkipOne(_broadcast(engine, "draft-skip"), SKIPPED), engine, CheckOptions())
            with pytest.raises(WeightCheckError, match=rf"{SKIPPED!r} was never written"):
                await broken.push(push.items(), version=2)
            await broken.close()
        finally:
            await engine.aclose()
    run(main(), 140)

"""``kind: external`` speaks the API its servers speak (``options.api``), and SGLang-compatible
clients built by the ``sglang`` / ``external`` kinds can decode routed experts (R3): they know the
MoE shape from the policy's config."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from miles_engine.engines.fleet.config import EngineGroupConfig, ExternalKindOptions
from miles_engine.engines.fleet.external import ExternalKind
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.engines.http.client import HttpEngine
from miles_engine.engines.http.wire import routed_experts_shape
from miles_engine.engines.vllm.client import VllmEngine
from miles_engine.errors import ConfigError

MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2}


def test_routed_experts_shape_from_the_policys_config(tmp_path):
    assert routed_experts_shape(MOE) == (3, 2)
    assert routed_experts_shape({"num_hidden_layers": 3}) is None  # dense
    (tmp_path / "config.json").write_text(__import__("json").dumps(MOE))
    assert FleetContext(model=str(tmp_path), state_dir=tmp_path).routed_experts_shape() == (3, 2)


@pytest.mark.parametrize(("api", "client", "transports"), [
    ("sglang", HttpEngine, ("broadcast", "disk_delta")), ("vllm", VllmEngine, ("broadcast",))])
def test_external_clients_follow_the_api(tmp_path, monkeypatch, api, client, transports):
    built = []

    async def connect(self):
        built.append(self)
        raise ConnectionError("nobody there")

    monkeypatch.setattr(client, "connect", connect)
    (tmp_path / "config.json").write_text(__import__("json").dumps(MOE))
    kind = ExternalKind(ExternalKindOptions(urls=["http://127.0.0.1:9"], api=api))
    assert kind.transports == transports

    async def main() -> None:
        async with AsyncExitStack() as stack:
            await kind.start(EngineGroupConfig(kind="external"), "ext", FleetContext(model=str(tmp_path),
                                                                                     state_dir=tmp_path), stack)

    with pytest.raises(ConfigError, match="not reachable at start: http://127.0.0.1:9"):
        asyncio.run(main())
    assert type(built[0]) is client
    assert built[0].moe_shape == (None if api == "vllm" else (3, 2))

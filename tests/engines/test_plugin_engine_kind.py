"""A third party's engine kind (think vLLM), registered through ``miles_register_engines`` like the
built-ins: its options are validated under ``engines.N.options``, the transports it declares are
checked at load, and its engines are started behind the router with the built-ins' code path."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from miles_engine import hookimpl
from miles_engine.components import Component
from miles_engine.engines.fleet.build import check_transport, create_kinds, start_fleet
from miles_engine.engines.fleet.config import EngineGroupConfig
from miles_engine.engines.fleet.kinds import EngineKind, FleetContext
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.errors import ConfigError
from miles_engine.hub import Hub, get_plugin_manager
from tests.engines.fakes import FakeEngine


class FakeVllmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step_delay_s: float = 0.0


class FakeVllmKind:
    in_process = False
    transports = ("disk_delta",)

    def __init__(self, options: FakeVllmOptions) -> None:
        self.options = options
        self.started: list[FakeEngine] = []

    async def start(self, group, name, ctx, stack):  # type: ignore[no-untyped-def]
        engines = [FakeEngine(name=f"{name}-{i}", step_delay=self.options.step_delay_s) for i in range(group.replicas)]
        for engine in engines:
            stack.push_async_callback(engine.aclose)
        self.started.extend(engines)
        return engines


class _Plugin:
    @hookimpl
    def miles_register_engines(self):  # type: ignore[no-untyped-def]
        return [Component("fake-vllm", FakeVllmKind, FakeVllmOptions, "a third party's engine kind")]


def _hub() -> Hub:
    pm = get_plugin_manager(load_entrypoints=False)
    pm.register(_Plugin(), name="fake-vllm-plugin")
    return Hub(pm)


def test_a_plugin_kind_is_validated_checked_and_started_behind_the_router(tmp_path: Path) -> None:
    hub = _hub()
    assert not hub.get("engine", "fake-vllm").builtin and hub.get("engine", "server").builtin
    with pytest.raises(ConfigError, match=r"engines\.0\.options.*step_delay"):
        create_kinds(hub, [EngineGroupConfig(kind="fake-vllm", options={"step_delay": 1})])

    groups = [EngineGroupConfig(kind="fake-vllm", replicas=2, options={"step_delay_s": 0.001})]
    kinds = create_kinds(hub, groups)
    assert isinstance(kinds[0], EngineKind)
    check_transport("disk_delta", groups, kinds)
    with pytest.raises(ConfigError) as err:
        check_transport("broadcast", groups, kinds)
    assert "\n" not in str(err.value)
    assert "weights.transport='broadcast'" in str(err.value) and "engines.0.kind='fake-vllm'" in str(err.value)

    async def main() -> None:
        async with AsyncExitStack() as stack:
            router = await start_fleet(groups, kinds, FleetContext(model="unused", state_dir=tmp_path), stack)
            assert sorted(s.name for s in router.slots) == ["fake-vllm-0", "fake-vllm-1"]
            for i in range(4):
                await router.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2), session_id=f"s{i}"))
            m = router.metrics()
            assert m["engines/fake-vllm-0/requests"] == 2 and m["engines/fake-vllm-1/requests"] == 2
            await router.pause("retract")  # a request held by a paused engine is in flight in the metrics
            held = asyncio.create_task(router.generate(GenerateRequest([1, 2], SamplingParams(max_new_tokens=2))))
            for _ in range(200):
                await asyncio.sleep(0.01)
                m = router.metrics()
                if m["engines/fake-vllm-0/inflight"] + m["engines/fake-vllm-1/inflight"]:
                    break
            assert m["engines/fake-vllm-0/inflight"] + m["engines/fake-vllm-1/inflight"] == 1
            await router.resume()
            assert len((await held).output_ids) == 2
            assert router.metrics()["engines/fake-vllm-0/inflight"] == router.metrics()["engines/fake-vllm-1/inflight"] == 0
        assert all(e.closed for e in kinds[0].started)  # torn down with the stack

    asyncio.run(asyncio.wait_for(main(), 60))

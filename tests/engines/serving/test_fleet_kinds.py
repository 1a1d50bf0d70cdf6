"""The `sglang` and `external` engine kinds through the fleet builder, against the fake
``sglang.launch_server`` (real SGLang's response shapes): the run launches and stops its SGLang
servers (device and dtype passed on), and talks to an external server it never stops."""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import AsyncExitStack
from pathlib import Path

from miles_engine.engines.fleet.build import create_kinds, start_fleet
from miles_engine.engines.fleet.config import EngineGroupConfig
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.sglang import SGLangLaunchConfig, SGLangServer
from miles_engine.hub import default_hub
from tests.engines.serving.test_sglang_launcher import _gone, fake_env  # noqa: F401 - the fixture


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_sglang_kind_is_launched_and_stopped_by_the_run(fake_env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    rec = Path(fake_env["FAKE_SGLANG_DIR"])
    groups = [EngineGroupConfig(kind="sglang", device="cuda:1", dtype="bfloat16",
                                options={"model_path": "/models/fake", "start_timeout_s": 60})]
    kinds = create_kinds(default_hub(), groups)

    async def main() -> None:
        async with AsyncExitStack() as stack:
            router = await start_fleet(groups, kinds, FleetContext(model="unused", state_dir=tmp_path, env=fake_env),
                                       stack)
            argv = json.loads((rec / "argv.json").read_text())
            assert argv[argv.index("--model-path") + 1] == "/models/fake" and argv[argv.index("--dtype") + 1] == "bfloat16"
            res = await router.generate(GenerateRequest([7, 8, 9], SamplingParams(max_new_tokens=2), session_id="s"))
            assert res.output_ids == [10, 11] and res.info["engine"] == "sglang-0"
            pids = list(map(int, (rec / "pids").read_text().split()))
        assert all(_gone(pid) for pid in pids)  # the run's own servers stop with it

    asyncio.run(asyncio.wait_for(main(), 120))


def test_external_kind_is_used_and_never_stopped(fake_env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    rec = Path(fake_env["FAKE_SGLANG_DIR"])

    async def main() -> None:
        someone_elses = SGLangServer(SGLangLaunchConfig("/models/fake", env=fake_env, start_timeout_s=60))
        async with someone_elses as engine:
            groups = [EngineGroupConfig(kind="external", options={"urls": [engine.base_url]})]
            kinds = create_kinds(default_hub(), groups)
            async with AsyncExitStack() as stack:
                router = await start_fleet(groups, kinds, FleetContext(model="unused", state_dir=tmp_path), stack)
                res = await router.generate(GenerateRequest([7, 8, 9], SamplingParams(max_new_tokens=2)))
                assert res.output_ids == [10, 11] and res.info["engine"] == "external-0"
            pids = list(map(int, (rec / "pids").read_text().split()))
            assert all(_alive(pid) for pid in pids)  # the run's teardown left the external server alone
            assert await engine.health()

    asyncio.run(asyncio.wait_for(main(), 120))

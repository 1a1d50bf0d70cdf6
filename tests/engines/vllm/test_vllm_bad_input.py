"""``kind: vllm`` and the SGLang kind's devices: what is refused before any server starts, each with
one error naming the cause (these need no vLLM)."""

from __future__ import annotations

import asyncio
import socket
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from miles_engine.engines.fleet.build import check_transport
from miles_engine.engines.fleet.config import EngineGroupConfig, SGLangKindOptions
from miles_engine.engines.fleet.kinds import FleetContext
from miles_engine.engines.fleet.sglang_kind import SGLangKind
from miles_engine.engines.fleet.vllm_kind import VllmKind, vllm_version
from miles_engine.engines.vllm.options import VllmKindOptions
from miles_engine.errors import ConfigError


def _start(options: VllmKindOptions, tmp_path: Path, replicas: int = 1, **ctx: object) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            await VllmKind(options).start(EngineGroupConfig(kind="vllm", replicas=replicas), "vllm",
                                          FleetContext(model=str(tmp_path), state_dir=tmp_path, **ctx), stack)

    asyncio.run(main())


def test_a_python_that_does_not_exist_names_the_option_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as err:
        _start(VllmKindOptions(python=str(tmp_path / "nope" / "python")), tmp_path)
    assert "options.python=" in str(err.value) and "no such file" in str(err.value)
    assert "./dev.sh vllm" in str(err.value) and "MILES_VLLM_PYTHON" in str(err.value)


def test_a_python_without_vllm_is_refused(tmp_path):
    vllm_version.cache_clear()
    with pytest.raises(ConfigError, match=r"cannot import vllm \(ModuleNotFoundError: No module named 'vllm'\)"):
        _start(VllmKindOptions(python=sys.executable), tmp_path)


def test_a_vllm_too_old_for_the_rl_api_is_refused(tmp_path):
    fake = tmp_path / "python"  # answers the version probe as an old vLLM would
    fake.write_text("#!/bin/sh\necho 0.10.2\n")
    fake.chmod(0o755)
    with pytest.raises(ConfigError, match=r"has vLLM 0\.10\.2, older than 0\.32: the RL routes"):
        _start(VllmKindOptions(python=str(fake)), tmp_path)


def test_a_port_in_use_is_refused_before_starting(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 0.32.0\n")
    fake.chmod(0o755)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"options.port={port - 1} .* 127.0.0.1:{port} is in use"):
            _start(VllmKindOptions(python=str(fake), port=port - 1), tmp_path, replicas=2)


def test_true_on_policy_is_refused_with_why(tmp_path):
    with pytest.raises(ConfigError, match="only our engines compute; vLLM's kernels differ"):
        _start(VllmKindOptions(python=str(tmp_path / "python")), tmp_path, true_on_policy=True)


def test_a_transport_vllm_cannot_take_here():
    with pytest.raises(ConfigError) as err:
        check_transport("disk_delta", [EngineGroupConfig(kind="vllm")], [VllmKind(VllmKindOptions())])
    assert "weights.transport='disk_delta' cannot reach engines.0.kind='vllm'" in str(err.value)
    assert "['broadcast']" in str(err.value)


def test_each_replica_gets_its_own_parallel_devices(tmp_path):
    group = EngineGroupConfig(kind="vllm", replicas=2, device="cuda:2")
    kind = VllmKind(VllmKindOptions(tensor_parallel_size=2, data_parallel_size=2))
    ctx = FleetContext(model="m", state_dir=tmp_path)
    assert [kind.environment(group, ctx, i)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["2,3,4,5", "6,7,8,9"]
    cpu = kind.environment(EngineGroupConfig(kind="vllm"), ctx, 0)
    assert cpu["VLLM_CPU_KVCACHE_SPACE"] == "1" and cpu["VLLM_SERVER_DEV_MODE"] == "1"
    argv = kind.command(group, ctx, 1, "/models/x")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and "--enforce-eager" in argv
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "miles"}'


def test_sglang_replicas_get_disjoint_tp_times_dp_devices(tmp_path, monkeypatch):
    seen: list[str] = []

    class Server:
        def __init__(self, cfg, name, **client_kwargs):
            seen.append(cfg.env["CUDA_VISIBLE_DEVICES"])

        async def start(self):
            return self

        async def stop(self):
            return None

    import miles_engine.engines.sglang as sglang

    monkeypatch.setattr(sglang, "SGLangServer", Server)

    async def main() -> None:
        async with AsyncExitStack() as stack:
            await SGLangKind(SGLangKindOptions(model_path="m", tp_size=2, dp_size=2, ep_size=2)).start(
                EngineGroupConfig(kind="sglang", replicas=2, device="cuda"), "sglang",
                FleetContext(model="m", state_dir=tmp_path), stack)

    asyncio.run(main())
    assert seen == ["0,1,2,3", "4,5,6,7"]

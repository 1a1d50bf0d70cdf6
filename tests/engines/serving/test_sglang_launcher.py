"""The SGLang launcher against a fake ``sglang.launch_server`` on PYTHONPATH; the same HTTP
client against real-SGLang response shapes."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
import torch

from miles_engine.engines.launch import EngineStartError
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.sglang import SGLangLaunchConfig, SGLangServer, build_command
from tests.engines.serving.fake_sglang import SOURCE


def test_build_command_passes_flags_through() -> None:
    cfg = SGLangLaunchConfig(
        "/models/qwen", tp_size=2, dp_size=4, ep_size=8, dtype="bfloat16", mem_fraction_static=0.8,
        speculative={"algorithm": "EAGLE", "draft_model_path": "/d", "num_steps": 3, "eagle_topk": 1,
                     "num_draft_tokens": 4},
        extra_args=["--enable-dp-attention", "--context-length", "8192"], python="py")
    assert build_command(cfg, 31000) == [
        "py", "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "31000",
        "--tp-size", "2", "--dp-size", "4", "--ep-size", "8", "--dtype", "bfloat16", "--mem-fraction-static", "0.8",
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/d", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4", "--weight-version", "0",
        "--enable-dp-attention", "--context-length", "8192"]
    assert build_command(SGLangLaunchConfig("m", weight_version=None, python="py"), 1)[-2:] == ["--port", "1"]
    for bad in ({"tp_size": 0}, {"mem_fraction_static": 1.5}, {"speculative": {"algo": "EAGLE"}}):
        with pytest.raises(ValueError):
            build_command(SGLangLaunchConfig("m", **bad), 1)  # type: ignore[arg-type]


@pytest.fixture
def fake_env(tmp_path: Path) -> dict[str, str]:
    pkg = tmp_path / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(SOURCE)
    rec = tmp_path / "rec"
    rec.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_SGLANG")}
    return {**env, "PYTHONPATH": str(tmp_path / "site"), "FAKE_SGLANG_DIR": str(rec)}


def _gone(pid: int, wait_s: float = 3.0) -> bool:
    """Dead or a zombie (an orphan awaiting its reaper) within ``wait_s`` (SIGKILL is async)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.02)


def test_launch_generate_update_and_stop(fake_env: dict[str, str]) -> None:
    rec = Path(fake_env["FAKE_SGLANG_DIR"])
    cfg = SGLangLaunchConfig("/models/fake", tp_size=2, env=fake_env, start_timeout_s=30)

    async def main() -> None:
        server = SGLangServer(cfg, moe_shape=(2, 2))
        async with server as engine:
            assert json.loads((rec / "argv.json").read_text()) == server.command[3:]
            assert engine.weight_version == 0 and not engine.is_miles_server
            res = await engine.generate(GenerateRequest([7, 8, 9], SamplingParams(max_new_tokens=4),
                                                        session_id="sess", return_routed_experts=True))
            assert res.output_ids == [10, 11, 12, 13] and res.output_logprobs == [-0.5] * 4
            assert res.weight_versions == [0] * 4 and res.info["weight_versions_exact"] is False
            assert res.cached_tokens == 1 and res.finish_reason == "length"
            assert json.loads((rec / "routing.json").read_text()) == ["sess", "sess", 2]
            rows = 3 + 4 - 1  # the last 4 of 6 rows are the ones that sampled the output tokens
            assert res.routed_experts == [[[4 * r, 4 * r + 1], [4 * r + 2, 4 * r + 3]] for r in range(rows - 4, rows)]
            with pytest.raises(ValueError, match="out of range"):
                await engine.generate(GenerateRequest([5000]))
            assert await engine.update_weights({"w": torch.ones(2)}) == 1
            update = json.loads((rec / "update.json").read_text())
            assert update["files"] == ["model.safetensors"] and not Path(update["path"]).exists()
            assert engine.weight_version == 1
            assert (await engine.generate(GenerateRequest([1]))).weight_versions[0] == 1
            assert await engine.abort("nope") is True
            await engine.pause("retract")
            await engine.resume()
            leader, child = map(int, (rec / "pids").read_text().split())
        assert _gone(leader) and _gone(child)
    asyncio.run(main())


def test_launch_failure_surfaces_log_tail(fake_env: dict[str, str]) -> None:
    cfg = SGLangLaunchConfig("m", env={**fake_env, "FAKE_SGLANG_FAIL": "1"}, start_timeout_s=30)
    with pytest.raises(EngineStartError, match=r"(?s)exited with code 3.*CUDA out of memory \(fake\)"):
        asyncio.run(SGLangServer(cfg).start())


def test_launch_deadline_kills_the_group(fake_env: dict[str, str]) -> None:
    rec = Path(fake_env["FAKE_SGLANG_DIR"])
    cfg = SGLangLaunchConfig("m", env={**fake_env, "FAKE_SGLANG_HANG": "1"}, start_timeout_s=1.5)
    with pytest.raises(EngineStartError, match=r"(?s)not healthy within.*fake sglang starting"):
        asyncio.run(SGLangServer(cfg).start())
    leader, child = map(int, (rec / "pids").read_text().split())
    assert _gone(leader) and _gone(child)


def test_stop_escalates_to_sigkill(fake_env: dict[str, str]) -> None:
    cfg = SGLangLaunchConfig("m", env={**fake_env, "FAKE_SGLANG_IGNORE_TERM": "1"}, start_timeout_s=30)

    async def main() -> None:
        server = SGLangServer(cfg)
        await server.start()
        assert await server.stop(grace_s=0.3) == -9
    asyncio.run(main())


def test_broadcast_and_check_update_equal_against_sglangs_weight_routes(fake_env: dict[str, str]) -> None:
    """The broadcast transport into a server that joins the group and takes buckets as SGLang does,
    with check-weight-update-equal read back through ``/get_weights_by_name``; then a server that
    corrupts one tensor on every update: the check names it."""
    from miles_engine.weights.broadcast import BroadcastTransport
    from miles_engine.weights.check.errors import WeightCheckError
    from miles_engine.weights.check.transport import CheckedTransport

    gen = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(16, 8, generator=gen),
               "model.layers.0.mlp.up_proj.weight": torch.randn(24, 8, generator=gen),
               "model.norm.weight": torch.ones(8)}

    async def push(env: dict[str, str]) -> int:
        async with SGLangServer(SGLangLaunchConfig("/models/fake", env=env, start_timeout_s=60)) as engine:
            transport = CheckedTransport(BroadcastTransport([engine], backend="gloo", timeout_s=120), [engine])
            try:
                stats = await transport.push(list(weights.items()), 1)
            finally:
                await transport.close()
            assert engine.weight_version == 1 and await engine.fetch_weight_version() == 1
            return stats.tensors_checked

    assert asyncio.run(push(fake_env)) == len(weights)
    with pytest.raises(WeightCheckError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        asyncio.run(push({**fake_env, "FAKE_SGLANG_CORRUPT": "model.layers.0.mlp.up_proj.weight"}))

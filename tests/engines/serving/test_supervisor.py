"""Supervisor: a real engine server subprocess is SIGKILLed mid-generation, restarted with the
current weights at the same version, and every in-flight request completes; crash loops back
off and give up with the log tail. No process outlives a test."""

from __future__ import annotations

import contextlib
import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from miles_engine.engines.errors import EngineCrashLoop
from miles_engine.engines.launch import server_command
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.supervisor import SupervisedEngine

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def group_members(pgid: int) -> list[int]:
    """Live processes of group ``pgid`` that run our engine server: once a group is empty, a
    new process may get its id (pids wrap around), and that one is not ours to judge or kill."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state, _, group = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state not in ("Z", "X") and b"miles_engine" in proc.joinpath("cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def group_gone(pgid: int, wait_s: float = 3.0) -> bool:
    end = time.monotonic() + wait_s
    while group_members(pgid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def kill_members(pgid: int) -> None:
    for pid in group_members(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def closed(sup: SupervisedEngine, pgids: list[int]) -> None:
    await sup.aclose()
    for pgid in pgids:
        if not group_gone(pgid):
            kill_members(pgid)
            pytest.fail(f"process group {pgid} outlived the supervisor")


@pytest.mark.timeout(120)
def test_sigkill_mid_generation_restarts_with_same_weights_and_retries_requests() -> None:
    async def main() -> None:
        sup = SupervisedEngine(server_command("tiny:qwen3", threads=1), name="tiny", env=ENV, cwd=REPO,
                               start_timeout_s=90, backoff_base_s=0.1, monitor_interval_s=0.1)
        await sup.start()
        pgids = [sup.process.pid]
        try:
            meta = {m.name: m for m in sup.weight_metadata()}
            head = meta["lm_head.weight"]
            pushed = {head.name: torch.randn(head.shape, generator=torch.Generator().manual_seed(1))}
            assert await sup.update_weights(pushed, version=3) == 3
            greedy = GenerateRequest([5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=8))
            before = await sup.generate(greedy)
            reqs = [GenerateRequest([1 + i, 2, 3], SamplingParams(max_new_tokens=3000, seed=i), session_id=f"s{i}")
                    for i in range(6)]
            tasks = [asyncio.create_task(sup.generate(r)) for r in reqs]
            await asyncio.sleep(0.4)
            # a random-init model may sample EOS early: only requests still running at the kill
            # must have been retried; at least one must be running for the test to mean anything
            running = [not t.done() for t in tasks]
            assert any(running)
            old = sup.process.pid
            os.killpg(old, signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 90)
            # the requests may all have finished just before the kill: then only the monitor sees the death
            for _ in range(300):
                if sup.restarts:
                    break
                await asyncio.sleep(0.1)
            pgids.append(sup.process.pid)
            assert sup.restarts == 1 and sup.process.pid != old and group_gone(old)
            for r, res, was_running in zip(reqs, results, running):
                assert res.request_id == r.request_id and (res.info.get("retries", 0) >= 1 or not was_running)
                assert res.finish_reason in ("length", "stop") and len(res.output_ids) == len(res.output_logprobs)
                assert set(res.weight_versions) == {3}  # the restarted engine serves the pushed weights' version
            assert sup.weight_version == 3 and sup.client is not None and sup.client.weight_version == 3
            after = await sup.generate(greedy)
            assert after.output_ids == before.output_ids  # same weights after the restart
            assert await sup.health()
        finally:
            await closed(sup, pgids)
    asyncio.run(main())


@pytest.mark.timeout(60)
def test_crash_loop_backs_off_then_fails_clearly(tmp_path: Path) -> None:
    flag = tmp_path / "refuse"
    cmd = server_command(f"fake:delay=0.01,failfile={flag}", engine_factory="tests.engines.fakes:make_fake_engine")

    async def main() -> None:
        sup = SupervisedEngine(cmd, name="loop", env=ENV, cwd=REPO, max_restarts=3, backoff_base_s=0.05,
                               backoff_max_s=0.15, monitor_interval_s=0.05, start_timeout_s=30)
        await sup.start()
        pgids = [sup.process.pid]
        try:
            inflight = asyncio.create_task(sup.generate(GenerateRequest([1], SamplingParams(max_new_tokens=500))))
            aborted = GenerateRequest([1], SamplingParams(max_new_tokens=500))
            second = asyncio.create_task(sup.generate(aborted))
            await asyncio.sleep(0.3)
            flag.touch()
            os.killpg(sup.process.pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
            assert await sup.abort(aborted.request_id)
            with pytest.raises(EngineCrashLoop, match=r"(?s)failed 3 restarts in a row.*refuses to start"):
                await asyncio.wait_for(inflight, 50)
            assert (await second).finish_reason == "abort"
            assert sup.backoffs == [0.05, 0.1, 0.15] and not await sup.health()
            with pytest.raises(EngineCrashLoop):
                await sup.generate(GenerateRequest([1]))
        finally:
            await closed(sup, pgids)
    asyncio.run(main())


@pytest.mark.timeout(60)
def test_hung_engine_is_detected_by_health_checks_and_replaced() -> None:
    cmd = server_command("fake:delay=0.005", engine_factory="tests.engines.fakes:make_fake_engine")

    async def main() -> None:
        sup = SupervisedEngine(cmd, name="hung", env=ENV, cwd=REPO, backoff_base_s=0.05, monitor_interval_s=0.05,
                               health_interval_s=0.2, health_failures=2, start_timeout_s=30,
                               client_kwargs={"health_timeout": 0.3, "generate_timeout": 30})
        await sup.start()
        pgids = [sup.process.pid]
        try:
            task = asyncio.create_task(sup.generate(GenerateRequest([3], SamplingParams(max_new_tokens=100))))
            await asyncio.sleep(0.2)
            old = sup.process.pid
            os.killpg(old, signal.SIGSTOP)  # alive but unresponsive
            res = await asyncio.wait_for(task, 45)
            pgids.append(sup.process.pid)
            assert sup.restarts == 1 and sup.process.pid != old and group_gone(old)
            assert res.finish_reason == "length" and len(res.output_ids) == 100 and res.info["retries"] == 1
        finally:
            await closed(sup, pgids)
    asyncio.run(main())

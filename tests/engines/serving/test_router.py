"""Router: affinity, least-loaded placement, quarantine and re-admission, spread, fan-out."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import torch

from miles_engine.engines.errors import EngineUnavailable
from miles_engine.engines.protocol import GenerateRequest, SamplingParams
from miles_engine.engines.router import Router
from tests.engines.fakes import FakeEngine


def fakes(n: int, **kw: Any) -> list[FakeEngine]:
    return [FakeEngine(name=f"e{i}", **kw) for i in range(n)]


def req(session: str | None = None, n: int = 4, prompt: int = 3) -> GenerateRequest:
    return GenerateRequest(list(range(1, prompt + 1)), SamplingParams(max_new_tokens=n), session_id=session)


def test_session_affinity_holds_across_turns() -> None:
    async def main() -> None:
        router = Router(fakes(3), health_interval_s=0)
        for turn in range(4):
            for s in range(6):
                res = await router.generate(req(f"s{s}"))
                if turn == 0:
                    first = router.session_engine(f"s{s}")
                assert res.info["engine"] == router.session_engine(f"s{s}")
            if turn == 0:
                homes = {f"s{s}": router.session_engine(f"s{s}") for s in range(6)}
        assert {f"s{s}": router.session_engine(f"s{s}") for s in range(6)} == homes and first
        assert Counter(homes.values()) == {"e0": 2, "e1": 2, "e2": 2}  # new sessions spread evenly
        for e in router.slots:  # every turn of a session ran on its home engine
            calls = [c.session_id for c in e.engine.calls]  # type: ignore[attr-defined]
            assert {homes[s] for s in calls} == {e.name}
    asyncio.run(main())


def test_least_loaded_by_inflight_tokens() -> None:
    async def main() -> None:
        router = Router(fakes(2, step_delay=0.01), health_interval_s=0)
        big_req = GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=200), session_id="big", request_id="big")
        big = asyncio.create_task(router.generate(big_req))  # e0 now carries 203 tokens
        await asyncio.sleep(0.02)
        small = [asyncio.create_task(router.generate(req(f"s{i}", n=10))) for i in range(5)]
        await asyncio.sleep(0.02)
        assert [s["inflight_requests"] for s in router.stats()] == [1, 5]
        await asyncio.gather(*small)
        # session-less requests also go to the least-loaded engine
        assert (await router.generate(req(None))).info["engine"] == "e1"
        assert await router.abort("big")
        assert (await big).finish_reason == "abort"
    asyncio.run(main())


def test_quarantine_moves_sessions_and_readmits_at_current_version() -> None:
    async def main() -> None:
        engines = fakes(3)
        router = Router(engines, health_interval_s=0, fail_threshold=2, readmit_after=2)
        for s in range(6):
            await router.generate(req(f"s{s}"))
        sick = router.session_engine("s0")
        engines[int(sick[1])].healthy = False
        await router.check_health()
        assert all(s["healthy"] for s in router.stats())  # one failure is not enough
        await router.check_health()
        stats = {s["engine"]: s for s in router.stats()}
        assert not stats[sick]["healthy"] and "health" in stats[sick]["last_error"]
        res = await router.generate(req("s0"))
        assert res.info["engine"] != sick and router.session_engine("s0") == res.info["engine"]
        for i in range(6):
            assert (await router.generate(req(f"new{i}"))).info["engine"] != sick
        # a weight update while it is quarantined: it is brought up to date on re-admission
        assert await router.update_weights({"head.bias": torch.ones(64)}) == 1
        assert router.versions()[sick] == 0 and router.weight_version == 1
        engines[int(sick[1])].healthy = True
        await router.check_health()
        assert not {s["engine"]: s for s in router.stats()}[sick]["healthy"]
        await router.check_health()
        assert {s["engine"]: s for s in router.stats()}[sick]["healthy"]
        assert router.versions() == {"e0": 1, "e1": 1, "e2": 1}
        assert torch.equal(engines[int(sick[1])].weights()["head.bias"], torch.ones(64))
    asyncio.run(main())


def test_readmission_during_a_push_waits_and_restores_what_the_push_recorded() -> None:
    """A re-admission's restore must not load the previous version over a push in progress: it
    waits for the push (and its record) and then restores the pushed weights."""
    async def main() -> None:
        engines = fakes(2)
        pushed: dict[str, Any] = {"weights": {"head.bias": torch.zeros(64)}, "version": 0}

        async def restore() -> tuple[dict[str, Any], int]:
            return pushed["weights"], pushed["version"]

        router = Router(engines, health_interval_s=0, fail_threshold=1, readmit_after=1, restore=restore)
        engines[1].healthy = False
        await router.check_health()  # e1 quarantined
        engines[1].healthy = True
        async with router.weights_held():  # a push to the admitted engine, then its record
            await engines[0].update_weights({"head.bias": torch.ones(64)}, version=1)
            readmit = asyncio.ensure_future(router.check_health())
            await asyncio.sleep(0.05)
            assert not readmit.done()  # waits for the push
            pushed.update(weights={"head.bias": torch.ones(64)}, version=1)
        await readmit
        assert router.versions() == {"e0": 1, "e1": 1}
        assert torch.equal(engines[1].weights()["head.bias"], torch.ones(64))
    asyncio.run(main())


def test_unavailable_engine_is_quarantined_at_once_and_all_down_is_clear() -> None:
    async def main() -> None:
        engines = fakes(2)

        async def dead(_: GenerateRequest) -> Any:
            raise EngineUnavailable("connection refused")
        engines[0].generate = dead  # type: ignore[method-assign]
        engines[0].healthy = False
        router = Router(engines, health_interval_s=0, retry_unavailable=0)
        with pytest.raises(EngineUnavailable):
            await router.generate(req("a"))
        assert [s["healthy"] for s in router.stats()] == [False, True]
        assert (await router.generate(req("a"))).info["engine"] == "e1"
        # by default the lost request is re-sent to another admitted engine
        retrying = Router(fakes(2), health_interval_s=0)
        retrying.slots[0].engine.generate = dead  # type: ignore[method-assign]
        res = await retrying.generate(req("c"))
        assert res.info["engine"] == "e1" and res.info["router_retries"] == 1
        assert [s["healthy"] for s in retrying.stats()] == [False, True]
        engines[1].healthy = False
        await router.check_health()
        await router.check_health()
        with pytest.raises(EngineUnavailable, match="no healthy engine"):
            await router.generate(req("b"))
        assert not await router.health()
    asyncio.run(main())


def test_even_spread_after_sessions_end_and_lru_bound() -> None:
    async def main() -> None:
        router = Router(fakes(2), health_interval_s=0, max_sessions=6)
        for s in range(4):
            await router.generate(req(f"old{s}"))
        for s in range(4):
            if router.session_engine(f"old{s}") == "e0":
                router.end_session(f"old{s}")
        assert [s["sessions"] for s in router.stats()] == [0, 2]
        for s in range(4):
            await router.generate(req(f"new{s}"))
        assert [s["sessions"] for s in router.stats()] == [3, 3]
        for s in range(4, 8):
            await router.generate(req(f"new{s}"))
        assert sum(s["sessions"] for s in router.stats()) == 6  # least recently used forgotten
        assert router.session_engine("old1") is None or router.session_engine("old3") is None
    asyncio.run(main())


def test_fan_out_pause_resume_update_and_abort() -> None:
    async def main() -> None:
        engines = fakes(3, step_delay=0.01)
        router = await Router(engines, health_interval_s=0.05).start()
        await router.pause("in_place")
        assert [e.pauses for e in engines] == [["in_place"]] * 3
        task = asyncio.create_task(router.generate(req("p", n=5)))
        await asyncio.sleep(0.1)
        assert not task.done()
        await router.resume()
        assert len((await task).output_ids) == 5
        with pytest.raises(ValueError, match="update_weights failed"):
            await router.update_weights({"head.bias": torch.ones(3)})
        assert router.weight_version == 0
        assert await router.update_weights({"head.bias": torch.ones(64)}, version=7) == 7
        assert router.versions() == {"e0": 7, "e1": 7, "e2": 7}
        long = GenerateRequest([1], SamplingParams(max_new_tokens=500), request_id="long")
        task = asyncio.create_task(router.generate(long))
        await asyncio.sleep(0.05)
        assert await router.abort("long") and not await router.abort("unknown")
        assert (await task).finish_reason == "abort"
        assert [m.name for m in router.weight_metadata()] == ["embed.weight", "head.bias"]
        await router.aclose()
        assert all(e.closed for e in engines)
    asyncio.run(main())


def test_router_over_in_process_embedded_engines_keeps_prefixes_warm() -> None:
    from miles_engine.engines.embedded import load_engine

    async def main() -> None:
        engines = {f"emb{i}": load_engine("tiny:qwen3,num_hidden_layers=1", threads=1) for i in range(2)}
        router = Router(engines, health_interval_s=0)
        try:
            rows = {f"s{i}": [1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(4)}
            for turn in range(3):
                results = await asyncio.gather(*(router.generate(GenerateRequest(
                    list(row), SamplingParams(temperature=0, max_new_tokens=6), session_id=s))
                    for s, row in rows.items()))
                for (s, row), res in zip(rows.items(), results):
                    assert res.info["engine"] == router.session_engine(s)
                    if turn:
                        assert res.cached_tokens > 0  # the turn landed where its prefix lives
                    row += res.output_ids + [9, 10]
            assert sorted(s["sessions"] for s in router.stats()) == [2, 2]
        finally:
            await router.aclose()
    asyncio.run(main())

"""A run whose engines are all quarantined (e.g. its external servers went down) stops while it
waits for groups, with one error naming each engine's last error and the recipe key that set the
limit; a fleet with a healthy engine keeps waiting. Bounded by the wait loop's own polling."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles_engine.config.recipe import load_recipe
from miles_engine.engines.router import NoHealthyEngine, Router
from miles_engine.rollout.buffer import AsyncBuffer
from miles_engine.run.training import TrainingRun
from tests.engines.fakes import FakeEngine
from miles_engine.hub import default_hub


def _run(router: Router, timeout_s: float, tmp_path: Path) -> TrainingRun:
    cfg = load_recipe("tiny-terminal", [f"fleet.unhealthy_timeout_s={timeout_s}"], hub=default_hub())
    parts = SimpleNamespace(cfg=cfg, run_dir=tmp_path, mode=None, engines=router, opd=None,
                            trainer=SimpleNamespace(weight_version=0),
                            buffer=AsyncBuffer(cfg.buffer))  # empty: get() waits for groups that never come
    return TrainingRun(parts)  # type: ignore[arg-type]


def test_no_healthy_engine_for_the_configured_time_stops_the_run_naming_the_key(tmp_path: Path) -> None:
    ext, other = FakeEngine(name="ext"), FakeEngine(name="other")
    router = Router([ext, other], health_interval_s=0, fail_threshold=1)

    async def main() -> None:
        ext.healthy = other.healthy = False
        await router.check_health()
        assert router.no_healthy_since is not None
        run = _run(router, 0.01, tmp_path)
        with pytest.raises(NoHealthyEngine) as err:
            await asyncio.wait_for(run.next_groups(1), 60)
        msg = str(err.value)
        assert "\n" not in msg and "fleet.unhealthy_timeout_s=0.01s" in msg
        assert "ext: health check failed" in msg and "other: health check failed" in msg

    asyncio.run(main())


def test_one_healthy_engine_keeps_the_run_waiting(tmp_path: Path) -> None:
    ext, other = FakeEngine(name="ext"), FakeEngine(name="other")
    router = Router([ext, other], health_interval_s=0, fail_threshold=1)

    async def main() -> None:
        ext.healthy = False
        await router.check_health()
        assert router.metrics()["engines/quarantined"] == 1 and router.no_healthy_since is None
        run = _run(router, 0.01, tmp_path)
        with pytest.raises(asyncio.TimeoutError):  # still waiting for groups after two polls: not stopped
            await asyncio.wait_for(run.next_groups(1), 2.5)

    asyncio.run(main())
